"""segback.experiment.workflow_lock: Snakemake's lock is freed only when every Snakemake that
recorded holding it is a dead process of this host."""

from __future__ import annotations

import json
import os
import socket
import subprocess

from segback.experiment import workflow_lock


def locked(tmp_path, holders: list[dict]):
    dot = tmp_path / ".snakemake"
    (dot / "locks").mkdir(parents=True)
    (dot / "locks" / "0.output.lock").write_text("results/x\n")
    (dot / workflow_lock.HOLDERS).mkdir()
    for i, h in enumerate(holders):
        (dot / workflow_lock.HOLDERS / f"{i}.json").write_text(json.dumps(h))
    return dot


def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_a_killed_snakemakes_lock_is_freed(tmp_path):
    dot = locked(tmp_path, [{"host": socket.gethostname(), "pid": dead_pid()}])
    said = workflow_lock.clear_stale(dot)
    assert said and "no longer runs" in said
    assert not (dot / "locks").exists()


def test_a_live_or_remote_or_unknown_holder_keeps_it(tmp_path):
    here = socket.gethostname()
    for n, holders in enumerate([
            [{"host": here, "pid": os.getpid()}],  # alive
            [{"host": here, "pid": dead_pid()}, {"host": here, "pid": os.getpid()}],
            [{"host": "another-host", "pid": dead_pid()}],  # cannot tell from here
            []]):  # a Snakemake that recorded nothing (started before this workflow did)
        dot = locked(tmp_path / str(n), holders)
        assert workflow_lock.clear_stale(dot) is None
        assert (dot / "locks" / "0.output.lock").exists()


def test_claim_and_release(tmp_path):
    dot = tmp_path / ".snakemake"
    workflow_lock.claim(dot)
    (mine,) = (dot / workflow_lock.HOLDERS).iterdir()
    assert json.loads(mine.read_text()) == {"host": socket.gethostname(), "pid": os.getpid()}
    workflow_lock.release(dot)
    assert not mine.exists()
