"""Files: atomic writes (a crash mid-write never leaves a truncated result behind), JSON reads,
YAML errors that name the line (`yaml_problem`, `duplicate_keys`), and where segback caches
what it builds (`cache_root`).

Every writer builds its result in a scratch file (or directory) beside the target, named
`.NAME.HOST.PID.RANDOM.tmp`, and renames it over the target once it is complete. Scratch left by
a killed writer is removed by the next write to the same target: when its process is gone (same
host) or it has not been touched for `STALE_AFTER_S` (any host, e.g. on a shared filesystem).
A write that fails (a full disk, say) raises `WriteError` naming the target and leaves the
previous file as it was.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import shutil
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

STALE_AFTER_S = 24 * 3600  # scratch untouched this long is stale whatever wrote it


class WriteError(OSError):
    """A file could not be written; the previous file (if any) is unchanged."""

    def __str__(self) -> str:
        return str(self.strerror)


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname().split(".")[0]) or "host"


def scratch_path(path: str | Path, suffix: str = "") -> Path:
    """A unique scratch name beside `path` that `clean_stale_scratch` recognizes."""
    path = Path(path)
    return path.with_name(f".{path.name}.{_host()}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
                          f"{suffix}")


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists on this host (one of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def clean_stale_scratch(path: str | Path) -> list[Path]:
    """Remove scratch files/dirs of earlier, killed writes to `path`; return what was removed.

    Recognizes this module's names (`.NAME.HOST.PID.RANDOM.tmp[.suffix]`, `....old`) and the
    older `.NAME.RANDOM.tmp` / `NAME.RANDOM.tmp` / `.STEM.PID.tmp.safetensors` ones (by age).
    Scratch of a live writer (this process included) is left alone.
    """
    path = Path(path)
    name = re.escape(path.name)
    ours = re.compile(rf"\.{name}\.(?P<host>[A-Za-z0-9-]+)\.(?P<pid>\d+)\.[0-9a-f]+\.(tmp|old)"
                      rf"(\.\w+)?")
    legacy = re.compile(rf"(\.?{name}\.\w{{8}}\.tmp|\.{name}\.\d+\.old"
                        rf"|\.{re.escape(path.stem)}\.\d+\.tmp{re.escape(path.suffix)})")
    removed = []
    try:
        entries = list(path.parent.iterdir())
    except OSError:
        return removed
    now, host, me = time.time(), _host(), os.getpid()
    for entry in entries:
        m = ours.fullmatch(entry.name)
        if m is None and not legacy.fullmatch(entry.name):
            continue
        try:
            age = now - entry.lstat().st_mtime
        except OSError:
            continue
        if m is not None:
            pid = int(m["pid"])
            if pid == me and m["host"] == host:
                continue
            stale = age > STALE_AFTER_S or (m["host"] == host and not pid_alive(pid))
        else:
            stale = age > STALE_AFTER_S
        if not stale:
            continue
        try:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
            removed.append(entry)
        except OSError:
            pass  # another cleaner got there first, or not ours to remove
    return removed


_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


def _write_error(path: Path, e: OSError) -> WriteError:
    reason = (e.strerror or str(e)).rstrip(".")
    hint = (" Free space there (or make it writable) and run again." if e.errno in _FULL
            else " Check that there is free space and that the directory is writable, then run "
                 "again.")
    err = WriteError(e.errno, f"cannot write {path}: {reason}; the previous {path.name} (if "
                              f"any) is left unchanged.{hint}")
    err.filename = str(path)
    return err


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _remove_scratch(tmp: Path) -> None:
    """Remove a failed write's scratch file; never raise over the error that made it fail (on
    a read-only filesystem even unlinking a file that was never made raises EROFS)."""
    try:
        tmp.unlink(missing_ok=True)
    except OSError:
        pass


def atomic_write_file(path: str | Path, write: Callable[[Path], None], suffix: str = "",
                      check: Callable[[Path], None] | None = None) -> None:
    """Let `write(tmp)` create the scratch file, `check(tmp)` verify it, fsync it and rename it
    over `path`. Any OSError becomes a `WriteError` naming `path`; the scratch file is removed."""
    path = Path(path)
    tmp = scratch_path(path, suffix)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        clean_stale_scratch(path)
        write(tmp)
        if check is not None:
            check(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as e:
        _remove_scratch(tmp)
        if isinstance(e, WriteError):
            raise
        raise _write_error(path, e) from e
    except BaseException:
        _remove_scratch(tmp)
        raise


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write `data` to a scratch file beside `path`, fsync, then rename over `path`."""

    def write(tmp: Path) -> None:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # less the umask
        try:
            _write_all(fd, data)
        finally:
            os.close(fd)

    atomic_write_file(path, write)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, obj: Any, indent: int | None = 2) -> None:
    atomic_write_text(path, json.dumps(obj, indent=indent) + "\n")


def atomic_write_jsonl(path: str | Path, rows: Iterable[Any]) -> None:
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))


@contextmanager
def atomic_dir(out: str | Path) -> Iterator[Path]:
    """Yield a scratch directory beside `out`; on success it replaces `out` (a previous `out` is
    removed only once the new one is in place), on failure it is removed and `out` is untouched.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_scratch(out)
    tmp = scratch_path(out)
    try:
        tmp.mkdir(mode=0o777)  # less the umask (not mkdtemp's 0700: DIR may be shared)
    except OSError as e:
        raise _write_error(out, e) from e
    try:
        yield tmp
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, WriteError) or e.errno not in _FULL:
            raise
        raise _write_error(out, e) from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    try:
        if out.exists() or out.is_symlink():
            old = scratch_path(out).with_suffix(".old")
            os.replace(out, old)
        os.replace(tmp, out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not out.exists():
            os.replace(old, out)
        raise _write_error(out, e) from e
    if old is not None:
        shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink()


def read_jsonl(path: str | Path) -> list[Any]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def read_json(path: str | Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def cache_root() -> Path:
    """Where segback caches what it builds (GGUF conversions, CUDA kernels): $SEGBACK_CACHE, else
    ~/.cache/segback."""
    root = os.environ.get("SEGBACK_CACHE") or Path.home() / ".cache" / "segback"
    return Path(root)


def duplicate_keys(path: str | Path) -> list[str]:
    """A line for each key given twice in one mapping of the YAML file at `path`."""
    found: list[str] = []

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen: dict = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                if key in seen:
                    found.append(f"{path}, line {key_node.start_mark.line + 1}: key `{key}` is "
                                 f"given twice (also line {seen[key]}); YAML would keep the "
                                 "last silently: keep one")
                else:
                    seen[key] = key_node.start_mark.line + 1
            return super().construct_mapping(node, deep)

    try:
        yaml.load(Path(path).read_text(encoding="utf-8"), Loader=Loader)  # noqa: S506
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return []  # Snakemake has read it already, or says why it cannot
    return found


def yaml_problem(path: str | Path, error: Exception, text: str = "") -> str:
    """'FILE, line L, column C: not valid YAML: PROBLEM', with the line itself, for a YAML error
    (PyYAML keeps the position in problem_mark; its str() says '<unicode string>')."""
    mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    if "'\\t'" in problem:
        problem += " (YAML indents with spaces, not tabs)"
    context, cmark = getattr(error, "context", None), getattr(error, "context_mark", None)
    if context and cmark is not None and mark is not cmark:
        problem += f" ({context} from line {cmark.line + 1})"
    if mark is None:
        return f"{path}: not valid YAML: {problem}"
    where = f"{path}, line {mark.line + 1}, column {mark.column + 1}: not valid YAML: {problem}"
    lines = text.splitlines()
    if mark.line < len(lines):
        where += f"\n    {mark.line + 1} | {lines[mark.line]}"
    return where
