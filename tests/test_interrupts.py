"""Nothing finished is thrown away: a trainer interrupted (SIGINT, SIGTERM, its workflow gone)
stops with one line and resumes bit for bit; a torn checkpoint falls back to the newest intact
one; a finished run is never trained again.

The trainer runs as `segback train` in a subprocess on a random tiny-llama geometry (seconds).
A process started from a non-interactive shell with `&` ignores SIGINT, and so would its
children: each subprocess here restores the default handler first, as a terminal's would be.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest
from test_train import chat_rows, small_cfg, tiny_run, write_jsonl

REPO = Path(__file__).resolve().parents[1]
ITERS = 64  # 0.05-0.1 s a step: the signal comes after step 3, seconds before the end even
# when the test's own process waits for a core (16 steps ended first once, in CI)


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture
def rows_dir(tmp_path):
    path = tmp_path / "data"
    path.mkdir()
    write_jsonl(path / "train.jsonl", chat_rows(9))
    write_jsonl(path / "valid.jsonl", chat_rows(3, seed=1))
    return path


def train_argv(data: Path, out: Path, iters: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "segback.cli", "train", "--model", "tiny-llama", "--data",
            str(data), "--adapter-path", str(out / "adapter"), "--checkpoint-dir",
            str(out / "ckpt"), "--log", str(out / "log.jsonl"), "--plan", "2",
            "--max-seq-length", "64", "--iters", str(iters), "--batch-size", "2",
            "--learning-rate", "1e-2", "--lora-dropout", "0.1", "--steps-per-eval", "0",
            "--save-every", "1", "--no-progress", "--clean-checkpoints", *extra]


def env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "OPENBLAS_NUM_THREADS": "1"}


def train(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env=env(), capture_output=True, text=True, timeout=300)


def started(argv: list[str], out: Path, step: int) -> subprocess.Popen:
    """The trainer, once its checkpoint of `step` exists."""
    proc = subprocess.Popen(argv, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=_default_sigint)
    deadline = time.time() + 300
    while not (out / "ckpt" / f"step_{step:06d}" / "state.json").exists():
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "the trainer never reached its checkpoint"
        time.sleep(0.02)
    return proc


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The adapter of an uninterrupted run of ITERS steps."""
    tmp = tmp_path_factory.mktemp("reference")
    data = tmp / "data"
    data.mkdir()
    write_jsonl(data / "train.jsonl", chat_rows(9))
    write_jsonl(data / "valid.jsonl", chat_rows(3, seed=1))
    done = train(train_argv(data, tmp, ITERS))
    assert done.returncode == 0, done.stderr
    return (tmp / "adapter" / "adapters.safetensors").read_bytes()


@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM", "workflow gone"])
def test_interrupted_trainer_says_one_line_and_resumes_bit_for_bit(tmp_path, rows_dir,
                                                                   reference, how):
    data = rows_dir  # the reference's rows
    parent = None
    extra = []
    if how == "workflow gone":  # Snakemake killed alone: its job's trainer must not train on
        parent = subprocess.Popen(["sleep", "600"])
        extra = ["--parent-pid", str(parent.pid)]
    argv = train_argv(data, tmp_path, ITERS, *extra)
    proc = started(argv, tmp_path, 3)
    if parent is not None:
        parent.kill()
        parent.wait()
    else:
        proc.send_signal(getattr(signal, how))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    why = f"the workflow that started it (process {parent.pid}) exited" if parent else how
    assert line.startswith(f"segback train: interrupted ({why}) at step "), line
    assert "the last checkpoint is step" in line and "Run the same command again" in line
    assert not (tmp_path / "adapter").exists()  # no output a workflow would take as made

    again = train(argv if parent is None else train_argv(data, tmp_path, ITERS))
    assert again.returncode == 0, again.stderr
    log = [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["resumed_from"] for r in log if "resumed_from" in r][0] >= 3
    assert (tmp_path / "adapter" / "adapters.safetensors").read_bytes() == reference


@pytest.mark.parametrize("name", ["adapters.safetensors", "optimizer.safetensors",
                                  "state.json"])
def test_torn_checkpoint_falls_back_to_the_newest_intact_one(tmp_path, capsys, name):
    """A checkpoint whose file was cut short (a full disk under a copy, a torn sync) is named,
    set aside, and the newest intact one resumes: the run still ends with its adapter."""
    rows = chat_rows(9)
    cfg = small_cfg(tmp_path, keep_checkpoints=0)  # 6 steps, checkpoints 2, 4, 6
    tiny_run(cfg, rows)
    want = (tmp_path / "adapters.safetensors").read_bytes()
    torn = tmp_path / "checkpoints" / "step_000006" / name
    torn.write_bytes(torn.read_bytes()[: torn.stat().st_size // 2])
    capsys.readouterr()
    assert tiny_run(cfg, rows)["resumed_from"] == 4
    err = capsys.readouterr().err
    assert f"checkpoint {torn.parent} is damaged ({name}" in err
    assert "resuming from the newest intact one (step 4)" in err
    assert (tmp_path / "adapters.safetensors").read_bytes() == want


def test_torn_resume_adapter_file_is_one_line(tmp_path, rows_dir):
    bad = tmp_path / "torn.safetensors"
    mx.save_safetensors(str(bad), {"x": mx.ones((64, 64))})
    bad.write_bytes(bad.read_bytes()[:200])
    done = train(train_argv(rows_dir, tmp_path, 2, "--resume-adapter-file", str(bad)))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith(f"segback train: error: --resume-adapter-file {bad} cannot be read")
    assert "truncated or corrupt" in line


def test_resume_adapter_file_from_another_base_model_warns(tmp_path, capsys):
    """tiny-llama of seed 1 has every shape of seed 0's: only the recorded base fingerprint
    tells that an adapter trained on one is being loaded into the other."""
    from segback.models.random_init import build_model
    from segback.trainer import cli

    rows = chat_rows(9)
    first = small_cfg(tmp_path / "a", iters=2)
    tiny_run(first, rows)
    adapter = str(tmp_path / "a" / "adapters.safetensors")
    capsys.readouterr()
    tiny_run(small_cfg(tmp_path / "b", iters=2, resume_adapter_file=adapter), rows)
    assert "another base model" not in capsys.readouterr().err  # its own base: quiet
    other = build_model("tiny-llama", seed=1)
    cli.attach(other, small_cfg(tmp_path / "c", iters=2, resume_adapter_file=adapter))
    err = capsys.readouterr().err
    assert f"warning: --resume-adapter-file {adapter} was trained on another base model" in err


def test_a_failed_config_change_keeps_the_finished_run_before_it(tmp_path, capsys):
    """Settings A finish; settings B (another learning rate) start over A's checkpoints and
    fail midway; going back to A trains no step: A's last checkpoint was set aside, not
    deleted, when B started (--restart-on-change, as the workflow runs)."""
    from test_train import KillAt, Killed

    rows = chat_rows(9)
    ckpt = tmp_path / "ckpt"
    a = small_cfg(tmp_path / "out", checkpoint_dir=str(ckpt), restart_on_change=True,
                  clean_checkpoints=True)
    tiny_run(a, rows)
    want = (tmp_path / "out" / "adapters.safetensors").read_bytes()
    b = small_cfg(tmp_path / "out", checkpoint_dir=str(ckpt), restart_on_change=True,
                  clean_checkpoints=True, learning_rate=5e-3)
    with pytest.raises(Killed):
        tiny_run(b, rows, callback=KillAt(3))
    assert [p.name for p in ckpt.glob("step_*")] == ["step_000002"]  # B's
    capsys.readouterr()
    assert tiny_run(a, rows)["resumed_from"] == 6
    assert "these settings finished before" in capsys.readouterr().err
    assert (tmp_path / "out" / "adapters.safetensors").read_bytes() == want
