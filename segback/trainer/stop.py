"""How a run is stopped from outside: SIGINT, SIGTERM, or the workflow that started it exiting.

Each becomes a KeyboardInterrupt in the main thread, which the loop turns into one line naming
the last checkpoint (`checkpoints.Interrupted`); nothing is lost that a rerun of the same
command does not resume. `parent_pid` is the workflow's process (Snakemake's rule passes its
`$PPID`): when Snakemake is killed alone, its jobs run on as orphans, and a trainer that trains
on would race the rerun for the checkpoints.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from segback.io import pid_alive

POLL_S = 1.0


@contextmanager
def interruptible(parent_pid: int | None = None) -> Iterator[None]:
    """SIGINT and SIGTERM raise KeyboardInterrupt inside, and so does `parent_pid` exiting.
    A SIGINT the process was started ignoring (`&` in a script) stays ignored, as POSIX
    means it to."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    done, orphaned = threading.Event(), threading.Event()

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"the workflow that started it (process {parent_pid}) exited"
                                if orphaned.is_set() else signal.Signals(signum).name)

    def watch() -> None:
        while not done.wait(POLL_S):
            if not pid_alive(parent_pid):
                orphaned.set()
                os.kill(os.getpid(), signal.SIGTERM)
                return

    saved = {s: signal.signal(s, interrupt) for s in (signal.SIGINT, signal.SIGTERM)
             if signal.getsignal(s) is not signal.SIG_IGN}

    watcher = threading.Thread(target=watch, daemon=True) if parent_pid else None
    if watcher is not None:
        watcher.start()
    try:
        yield
    finally:
        done.set()
        for s, handler in saved.items():
            signal.signal(s, handler)
