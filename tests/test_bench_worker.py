"""The bench's worker runner: stderr passes through as it comes, a timeout keeps the last lines."""

import sys

from segback.benchmark.cli import _run_worker

SLOW = ("import sys, time\n"
        "print('bench ckpt: step 0/2 1.0 s', file=sys.stderr, flush=True)\n"
        "time.sleep(30)\n"
        "print('{\"never\": 1}')\n")


def test_timeout_keeps_how_far_it_got(capfd):
    code, out, tail = _run_worker([sys.executable, "-c", SLOW], {}, timeout=3)
    assert code is None and out == ""
    assert tail == ["bench ckpt: step 0/2 1.0 s"]
    assert "step 0/2" in capfd.readouterr().err  # echoed while the worker ran


def test_exit_code_stdout_and_stderr():
    script = "import sys; print('{\"a\": 1}'); print('boom', file=sys.stderr); sys.exit(3)"
    code, out, tail = _run_worker([sys.executable, "-c", script], {}, timeout=30)
    assert (code, out.strip(), tail) == (3, '{"a": 1}', ["boom"])
