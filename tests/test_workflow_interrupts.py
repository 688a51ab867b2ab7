"""Every interrupt of the real workflow, followed by the one documented command, resumes from
the last checkpoint and ends with the adapter of an uninterrupted run, bit for bit; a finished
training is never redone; no interrupted run's log holds a traceback.

The interrupts, as a user meets them: Ctrl-C (SIGINT to Snakemake and its jobs), SIGINT or
SIGKILL of the Snakemake process alone (its job runs on: Snakemake waits for it after SIGINT,
orphans it after SIGKILL), SIGKILL of the trainer, and a power loss (SIGKILL of them all).
Snakemake runs in its own session, so a signal reaches only what the case says; a process
started with `&` from a non-interactive shell ignores SIGINT, so the default handler is
restored first, as in a terminal. The upstream stages run once and are copied into each case.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from test_workflow import SMOKE, SNAKEFILE, STAGE_MODULES, snakemake, write_yaml

BRANCH = Path("results/tiny/seq512")
ITERS = 10  # about 1.2 s a step on 2 cores, after 20 s of start-up
CASES = ["ctrl-c", "snakemake-sigint", "snakemake-sigkill", "trainer-sigkill", "power-loss"]


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(workdir of an uninterrupted run, its adapter bytes, the documented command)."""
    for module in STAGE_MODULES:
        pytest.importorskip(module, reason=f"stage module {module} not written yet")
    tmp = tmp_path_factory.mktemp("interrupts")
    smoke = yaml.safe_load(SMOKE.read_text())
    over = write_yaml(tmp / "long.yaml", {"train": {**smoke["train"], "iters": ITERS,
                                                    "save_every": 2, "val_every": 100}})
    # The README's command (`make run` runs the same): after any interrupt, run it again.
    cmd = ["--cores", "2", "--rerun-incomplete", "--configfile", str(SMOKE), str(over), "--",
           str(BRANCH / "adapter")]
    ref = tmp / "ref"
    ref.mkdir()
    snakemake(ref, *cmd)
    return ref, (ref / BRANCH / "adapter" / "adapters.safetensors").read_bytes(), cmd


def trainer_pid(ckpt: Path) -> int:
    return int((ckpt / ".segback.lock").read_text().split()[0])


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize("case", CASES)
def test_interrupted_workflow_resumes_with_the_same_command(tmp_path, reference, case):
    ref, want, cmd = reference
    work = tmp_path / "work"
    shutil.copytree(ref, work, symlinks=True)  # the finished upstream stages, their metadata
    for made in ("adapter", "train_log.jsonl", "train_work"):
        p = work / BRANCH / made
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    env = {k: v for k, v in os.environ.items() if k != "SEGBACK"}
    proc = subprocess.Popen([sys.executable, "-m", "snakemake", "--snakefile", str(SNAKEFILE),
                             "--directory", str(work), *cmd], cwd=work, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, preexec_fn=_default_sigint)
    ckpt = work / BRANCH / "train_work" / "checkpoints"
    deadline = time.time() + 600
    while not (ckpt / "step_000002" / "state.json").exists():
        assert proc.poll() is None and time.time() < deadline, "training never reached 2"
        time.sleep(0.02)
    trainer = trainer_pid(ckpt)
    if case == "ctrl-c":
        os.killpg(proc.pid, signal.SIGINT)
    elif case == "snakemake-sigint":
        proc.send_signal(signal.SIGINT)
    elif case == "snakemake-sigkill":
        proc.kill()
    elif case == "trainer-sigkill":
        os.kill(trainer, signal.SIGKILL)
    else:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=600)
    deadline = time.time() + 60  # an orphaned trainer stops by itself once Snakemake is gone
    while not gone(trainer):
        assert time.time() < deadline, f"{case}: the trainer ran on without its workflow"
        time.sleep(0.1)
    log = work / "results" / "logs" / "tiny" / "seq512" / "train_lora.log"
    assert "Traceback" not in log.read_text(), (case, log.read_text()[-3000:])

    out = snakemake(work, *cmd).stdout  # the same command, nothing else (no --unlock)
    assert "Traceback" not in out
    rows = [json.loads(x) for x in (work / BRANCH / "train_log.jsonl").open()]
    resumed = [r["resumed_from"] for r in rows if "resumed_from" in r]
    assert resumed and resumed[-1] >= 2, (case, rows)
    if case == "snakemake-sigint":  # the job ran to its end: nothing is trained again
        assert resumed[-1] == ITERS
    assert (work / BRANCH / "adapter" / "adapters.safetensors").read_bytes() == want, case
    assert [p.name for p in ckpt.glob("step_*")] == [f"step_{ITERS:06d}"]  # the last stays
