"""One writer per adapter directory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from segback.lock import LockedError, exclusive

HOLD = ("import sys, time\nfrom segback.lock import exclusive\n"
        "with exclusive(sys.argv[1]):\n    print('held', flush=True)\n    time.sleep(60)\n")


def _holder(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_second_writer_is_refused_with_the_holders_pid(tmp_path):
    proc = _holder(tmp_path)
    try:
        with pytest.raises(LockedError, match=f"process {proc.pid} on "):
            with exclusive(tmp_path):
                pass
    finally:
        proc.kill()
        proc.wait()


def test_lock_of_a_killed_process_is_taken_over(tmp_path):
    proc = _holder(tmp_path)
    os.kill(proc.pid, signal.SIGKILL)  # no cleanup runs
    proc.wait()
    tic = time.perf_counter()
    with exclusive(tmp_path) as path:
        assert path.read_text().split("\n")[0] == str(os.getpid())
    assert time.perf_counter() - tic < 1.0
    with exclusive(tmp_path):  # and released again on exit
        pass


def test_second_trainer_on_the_same_adapter_path_is_refused(tmp_path):
    """`segback train` holds its --adapter-path: a second one exits at once, naming the first."""
    proc = _holder(tmp_path)
    try:
        out = subprocess.run([sys.executable, "-m", "segback.cli", "train", "--model",
                              "tiny-llama", "--data", str(tmp_path / "nodata"),
                              "--adapter-path", str(tmp_path), "--iters", "1"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 2
        assert f"is being written by process {proc.pid}" in out.stderr, out.stderr
    finally:
        proc.kill()
        proc.wait()
