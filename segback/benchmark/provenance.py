"""Where a benchmark row was measured: what every row of bench/data/runs.jsonl starts with.

The UTC date, the git revision of this checkout ("-dirty" with uncommitted changes to tracked
files), the machine (platform, CPU model, core count, host memory, GPU name and memory; no host
name), the mlx and mlx-lm versions, and the sweep configuration and run label. `segback bench`
and the bench/ scripts write rows with it.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path


def git_revision(root: str | Path | None = None) -> str | None:
    """Short revision of the checkout segback runs from, "-dirty" if a tracked file differs
    from it; None outside a git checkout (an installed wheel) or without git."""
    root = Path(root or Path(__file__).resolve().parents[2])
    env = os.environ | {"GIT_OPTIONAL_LOCKS": "0"}  # read only: never touch a shared index

    def git(*cmd: str) -> str:
        return subprocess.run(["git", "-C", str(root), *cmd], capture_output=True, text=True,
                              check=True, timeout=30, env=env).stdout.strip()

    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() != root.resolve():
            return None  # segback is installed inside some other repository
        rev = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return rev + ("-dirty" if dirty else "")


_DEVICE_INFO = """import json, mlx.core as mx
gpu = mx.cuda.is_available() or mx.metal.is_available()
print(json.dumps({k: v for k, v in mx.device_info().items()} if gpu else None))"""


def _gpu_info() -> dict | None:
    """mlx's description of its GPU (None on a CPU-only mlx). Asked in a child process unless
    mlx is loaded here already: a parent holding a GPU context would take device memory from
    the modes it runs."""
    mx = sys.modules.get("mlx.core")
    if mx is not None:
        try:
            gpu = mx.cuda.is_available() or mx.metal.is_available()
            return dict(mx.device_info()) if gpu else None
        except (AttributeError, RuntimeError):  # an mlx without device_info
            return None
    try:
        out = subprocess.run([sys.executable, "-c", _DEVICE_INFO], capture_output=True,
                             text=True, timeout=120)
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    if platform.system() == "Darwin":
        try:
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"],
                                  capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or None


@functools.cache
def machine() -> dict:
    """The machine, without its host name: platform, CPU model, cores, host memory, GPU."""
    try:
        host_gb = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3, 1)
    except (ValueError, OSError, AttributeError):
        host_gb = None
    gpu = _gpu_info() or {}
    gpu_bytes = gpu.get("total_memory") or gpu.get("memory_size")
    return {"platform": f"{platform.system()}-{platform.machine()}", "cpu": _cpu_model(),
            "cores": os.cpu_count(), "memory_gb": host_gb,
            "gpu": gpu.get("device_name") or gpu.get("architecture") if gpu else None,
            "gpu_memory_gb": round(gpu_bytes / 1024**3, 1) if gpu_bytes else None}


def _version(dist: str) -> str | None:
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


@functools.cache
def _static_provenance() -> dict:
    return {"git": git_revision(), "machine": machine(), "mlx": _version("mlx"),
            "mlx_lm": _version("mlx-lm")}


def provenance(config: str | None = None, run: str | None = None) -> dict:
    """What every row of bench/data/runs.jsonl starts with (bench/ scripts use it too)."""
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            **_static_provenance(), "config": config, "run": run}


def with_provenance(row: dict, config: str | None = None, run: str | None = None) -> dict:
    """`row` after its provenance; the row's own keys (e.g. the worker's "mlx") win."""
    head = provenance(config, run)
    return head | row | {k: head[k] for k in ("date", "config", "run")}


def append_rows(path: str | Path, rows: list[dict]) -> None:
    """Append JSON lines to `path` (one write: concurrent appenders do not interleave lines)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
