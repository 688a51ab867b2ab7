"""Snakemake's directory lock, freed when the Snakemake that took it is dead.

Snakemake locks a working directory by files in `.snakemake/locks/` that record the outputs,
not the process: after a `kill -9` (or a power loss) they stay, and every later run stops
until someone runs `snakemake --unlock`. The workflow records, once it holds the lock, which
process holds it (`claim`, its onstart hook; `release` on success or error); when the workflow
loads again and every recorded holder is a process of this host that no longer runs, the
lock is stale and is removed (`clear_stale`). Locks of a live Snakemake, of another host (a
shared filesystem) or of a run that recorded nothing are left to Snakemake.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path

from segback.io import pid_alive

HOLDERS = "segback-lock-holders"


def _me() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid()}


def claim(dotdir: str | Path = ".snakemake") -> None:
    """Record this process as a holder of the lock (call once Snakemake holds it)."""
    me = _me()
    folder = Path(dotdir) / HOLDERS
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{me['host']}.{me['pid']}.json").write_text(json.dumps(me))


def release(dotdir: str | Path = ".snakemake") -> None:
    me = _me()
    (Path(dotdir) / HOLDERS / f"{me['host']}.{me['pid']}.json").unlink(missing_ok=True)


def clear_stale(dotdir: str | Path = ".snakemake") -> str | None:
    """Remove Snakemake's lock when every recorded holder is a dead process of this host;
    return the line that says so (None: nothing removed)."""
    dotdir = Path(dotdir)
    locks = list((dotdir / "locks").glob("*.lock"))
    holders = []
    for f in (dotdir / HOLDERS).glob("*.json"):
        try:
            holders.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            return None  # unreadable: not ours to judge
    if not locks or not holders:
        return None
    host = socket.gethostname()
    if any(h.get("host") != host or pid_alive(int(h.get("pid", 0))) for h in holders):
        return None
    shutil.rmtree(dotdir / "locks", ignore_errors=True)
    shutil.rmtree(dotdir / HOLDERS, ignore_errors=True)
    pids = ", ".join(str(h["pid"]) for h in holders)
    return (f"segback: removed the lock of Snakemake process {pids}, which no longer runs "
            "(killed?); its finished jobs are kept and training resumes from its checkpoints")
