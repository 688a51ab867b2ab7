"""One writer per output directory: an exclusive lock that dies with its process.

`fcntl.flock` locks belong to the open file, so the kernel releases them when the holder exits,
however it exits (kill -9, power loss): a lock left by a dead process is simply free. The file
records who holds it, so a refused writer can say which process to stop.
"""

from __future__ import annotations

import fcntl
import os
import socket
from contextlib import contextmanager
from pathlib import Path
from collections.abc import Iterator

LOCK_FILE = ".segback.lock"


class LockedError(RuntimeError):
    """Another live process writes this directory."""


def _holder(path: Path) -> str:
    try:
        pid, host, *cmd = path.read_text().split("\n", 2)
    except OSError:
        return "another process"
    return f"process {pid} on {host}" + (f" ({cmd[0].strip()})" if cmd and cmd[0].strip()
                                        else "")


@contextmanager
def exclusive(directory: str | Path, what: str = "segback train") -> Iterator[Path]:
    """Hold `directory`'s lock for the body; refuse at once if a live process holds it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise LockedError(
                f"{directory} is being written by {_holder(path)}: two writers would mix their "
                f"checkpoints and logs. Wait for it or stop it, then run {what} again.") from None
        cmd = " ".join(Path(f"/proc/{os.getpid()}/cmdline").read_text().split("\0")).strip() \
            if Path(f"/proc/{os.getpid()}/cmdline").exists() else what
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n{socket.gethostname()}\n{cmd[:300]}\n".encode(), 0)
        yield path
    finally:
        os.close(fd)  # releases the lock
