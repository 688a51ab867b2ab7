"""Carry the workflow's Python dependencies to an offline machine as wheels, in parts.

Run it with the interpreter of a set-up checkout (`make setup`): the packages to carry are the
ones installed there for `segback[experiment]` (the same versions CI tests), fetched as wheels
for the target's Python and platform. Packages that PyPI ships only as source are built here
into pure-Python wheels. The wheels go into one tar file split into parts small enough for
one transfer each; `install.sh` beside this file joins and installs them on the target.

    .venv/bin/python workflow/offline/bundle.py .offline --python 3.12 --have have.txt

`--have` names packages the target already has (a `pip list --format=freeze` there, or one
name per line): they are left out, except the few `--carry` names whose versions matter.
MLX itself is left out by default: an accelerator's build (e.g. mlx-cuda) comes by its own
route.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import subprocess
import sys
import tarfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

# Carried even where the target has them: segback needs their recent APIs (transformers' GGUF
# tokenizer conversion) and transformers checks its own pins at import.
DEFAULT_CARRY = ("transformers", "tokenizers", "huggingface-hub", "safetensors", "regex", "click")
DEFAULT_SKIP = ("mlx", "mlx-cpu", "mlx-metal", "mlx-cuda", "mlx-cuda-12", "mlx-cuda-13", "mlx-lm")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64", "any")


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(root: str, extras: list[str], python: str) -> dict[str, str]:
    """{name: version} of `root` and everything it needs (with `extras`), as installed here,
    with markers evaluated for the target's Python version."""
    env = default_environment()
    env.update(python_version=python, python_full_version=f"{python}.0")
    seen: dict[str, str] = {}
    todo = [(root, tuple(extras))]
    while todo:
        name, ext = todo.pop()
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            sys.exit(f"bundle: {name} is needed but not installed here; run `make setup` first")
        key = norm(dist.metadata["Name"])
        new = key not in seen
        seen[key] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is not None and not any(
                    req.marker.evaluate({**env, "extra": e}) for e in (*ext, "")):
                continue
            if new or ext:
                todo.append((req.name, tuple(req.extras)))
    seen.pop(norm(root), None)
    return seen


def read_have(path: Path | None) -> set[str]:
    if path is None:
        return set()
    names = set()
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            names.add(norm(re.split(r"[=<>~! ]", line, maxsplit=1)[0]))
    return names


def fetch(name: str, version: str, out: Path, python: str) -> Path:
    """The wheel of name==version for the target: PyPI's binary, else built here (pure Python)."""
    before = set(out.iterdir())
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", python, "--implementation", "cp", "-d", str(out)]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    if subprocess.run([*cmd, f"{name}=={version}"], capture_output=True).returncode != 0:
        built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w",
                                str(out), f"{name}=={version}"], capture_output=True, text=True)
        if built.returncode != 0:
            sys.exit(f"bundle: no wheel of {name}=={version} for Python {python}:\n{built.stderr}")
    new = [p for p in set(out.iterdir()) - before if p.suffix == ".whl"]
    if not new:  # already there from an earlier run
        new = [p for p in out.glob("*.whl") if norm(p.name.split("-")[0]) == norm(name)]
    wheel = new[0]
    tags = wheel.name[:-4].split("-")[-3:]
    if tags[2] != "any" and "x86_64" not in tags[2]:
        sys.exit(f"bundle: {wheel.name} is not for the target platform")
    return wheel


def split(path: Path, part_mb: int) -> list[Path]:
    """`split -b`: parts named path.part.aa, .ab, ... joined back with `cat`."""
    size = part_mb * 1024 * 1024
    parts = []
    with open(path, "rb") as f:
        i = 0
        while chunk := f.read(size):
            suffix = chr(ord("a") + i // 26) + chr(ord("a") + i % 26)
            part = path.with_name(f"{path.name}.part.{suffix}")
            part.write_bytes(chunk)
            parts.append(part)
            i += 1
    return parts


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="output folder (wheels/, bundle.tar.part.*)")
    ap.add_argument("--python", default="3.12", help="the target's Python version")
    ap.add_argument("--extras", default="experiment", help="segback extras to carry (comma list)")
    ap.add_argument("--have", type=Path, help="packages the target already has (pip freeze)")
    ap.add_argument("--carry", default=",".join(DEFAULT_CARRY),
                    help="packages carried even when --have lists them")
    ap.add_argument("--skip", default=",".join(DEFAULT_SKIP), help="packages never carried")
    ap.add_argument("--part-mb", type=int, default=60, help="largest part, in MiB")
    args = ap.parse_args(argv)

    need = closure("segback", [e for e in args.extras.split(",") if e], args.python)
    always = {norm(s) for s in args.carry.split(",") if s}
    leave = (read_have(args.have) - always) | {norm(s) for s in args.skip.split(",") if s}
    carry = {n: v for n, v in sorted(need.items()) if n not in leave}
    wheels = args.out / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    for n, v in carry.items():
        w = fetch(n, v, wheels, args.python)
        print(f"{w.stat().st_size / 2**20:7.1f} MiB  {w.name}")
    keep = {norm(p.name.split("-")[0]) for p in wheels.glob("*.whl")} - set(carry)
    for p in wheels.glob("*.whl"):  # wheels of an earlier run that is no longer needed
        if norm(p.name.split("-")[0]) in keep:
            p.unlink()
    tar = args.out / "bundle.tar"
    for old in args.out.glob("bundle.tar.part.*"):
        old.unlink()
    with tarfile.open(tar, "w") as t:
        t.add(wheels, arcname="wheels")
    parts = split(tar, args.part_mb)
    tar.unlink()
    total = sum(p.stat().st_size for p in parts) / 2**20
    print(f"bundle: {len(carry)} packages, {total:.1f} MiB in {len(parts)} part(s) of at most "
          f"{args.part_mb} MiB: " + " ".join(str(p) for p in parts))
    print("bundle: on the target, with every part in one folder: "
          "bash workflow/offline/install.sh FOLDER SITE_DIR")


if __name__ == "__main__":
    main()
