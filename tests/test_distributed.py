"""Data-parallel `segback train`: two local ranks (mlx.launch, ring backend, CPU) against one
process of the same --batch-size (the global batch, as in mlx_lm.lora), on a random tiny-llama.

The two-rank runs are real `mlx.launch -n 2 --backend ring` launches of `segback train` on
127.0.0.1 (offline). They use SGD with momentum: its weights are linear in the gradients, so a
1e-5 tolerance tests the token-weighted all-sum itself (Adam's first steps divide tiny gradients
by their own size, which turns float rounding into visible weight differences) and momentum is
optimizer state the resume has to carry to every rank.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from test_train import chat_rows, parse, read_log, small_cfg, write_jsonl

from segback.backend.blas import find_openblas
from segback.data.dataset import batch_at, batch_groups, collate, epoch_permutation
from segback.data.tokens import ByteTokenizer
from segback.models.random_init import build_model
from segback.trainer import cli, distributed, loop
from segback.trainer.distributed import World

ROOT = Path(__file__).resolve().parents[1]
ITERS = 3
OPTIONS = ["--model", "tiny-llama", "--max-seq-length", "128", "--plan", "2", "--no-progress",
           "--lora-dropout", "0", "--steps-per-eval", "0", "--steps-per-report", "1",
           "--grad-accumulation-steps", "2", "--optimizer", "sgd", "--learning-rate", "0.5",
           "--save-every", "1"]


def launcher() -> str:
    path = Path(sys.executable).parent / "mlx.launch"
    found = str(path) if path.exists() else shutil.which("mlx.launch")
    assert found, "mlx.launch (installed with mlx) is missing"
    return found


def free_ports(n: int = 2) -> int:
    """A base port with n consecutive free ports (the ring backend listens on base + rank)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        try:
            socks = []
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports on 127.0.0.1")


def env() -> dict:
    e = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    lib = find_openblas()
    if lib:  # preloaded already: segback does not re-exec (and announce it) on each rank
        e["LD_PRELOAD"] = ":".join(p for p in (lib, os.environ.get("LD_PRELOAD")) if p)
    return e


def launch(args: list[str]) -> subprocess.CompletedProcess:
    """`mlx.launch -n 2 --backend ring -p PORT -- python -m segback.cli train ARGS`. The launcher
    exits 0 even when a rank fails, so a rank's failure is read from its warning."""
    cmd = [launcher(), "-n", "2", "--backend", "ring", "-p", str(free_ports()), "--",
           sys.executable, "-m", "segback.cli", "train", *args]
    p = subprocess.run(cmd, cwd=ROOT, env=env(), stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, timeout=300)
    failed = "Node with rank" in p.stderr or p.returncode != 0
    assert not failed, f"{' '.join(cmd)}\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}"
    return p


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Two ranks of --batch-size 4 (2 rows each) for 3 steps; the same resumed from its step-2
    checkpoint; one process of --batch-size 4."""
    if not mx.distributed.is_available("ring"):
        pytest.skip("this MLX build has no ring backend (mx.distributed.is_available('ring') "
                    "is False)")
    tmp = tmp_path_factory.mktemp("dist")
    write_jsonl(tmp / "data" / "train.jsonl", chat_rows(16))
    (tmp / "sgd.yaml").write_text("optimizer_config:\n  sgd:\n    momentum: 0.9\n")
    common = [*OPTIONS, "--data", str(tmp / "data"), "-c", str(tmp / "sgd.yaml"),
              "--iters", str(ITERS)]
    two = tmp / "two"
    first = launch([*common, "--batch-size", "4", "--adapter-path", str(two)])
    shutil.copytree(two, tmp / "uninterrupted")
    shutil.rmtree(two / "checkpoints" / f"step_{ITERS:06d}")  # as if killed after step 2
    again = launch([*common, "--batch-size", "4", "--adapter-path", str(two)])
    one = tmp / "one"
    assert cli.main(parse([*common, "--batch-size", "4", "--adapter-path", str(one)])) == 0
    return {"two": two, "one": one, "uninterrupted": tmp / "uninterrupted", "first": first,
            "again": again, "tmp": tmp}


def losses(out: Path) -> list[dict]:
    return [r for r in read_log(out / "train_log.jsonl") if "loss" in r]


def test_two_ranks_equal_one_process_of_the_same_batch_size(runs):
    two, one = losses(runs["two"]), losses(runs["one"])
    assert [r["step"] for r in two] == [r["step"] for r in one] == list(range(1, ITERS + 1))
    assert [r["tokens"] for r in two] == [r["tokens"] for r in one]  # all ranks' tokens
    assert [r["input_tokens"] for r in two] == [r["input_tokens"] for r in one]
    np.testing.assert_allclose([r["loss"] for r in two], [r["loss"] for r in one], rtol=1e-5)
    np.testing.assert_allclose([r["grad_norm"] for r in two], [r["grad_norm"] for r in one],
                               rtol=1e-5)
    assert two[0]["loss"] != pytest.approx(two[-1]["loss"], rel=1e-3)  # it trained
    a = mx.load(str(runs["two"] / "adapters.safetensors"))
    b = mx.load(str(runs["one"] / "adapters.safetensors"))
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_allclose(np.array(a[k]), np.array(b[k]), rtol=1e-5, atol=1e-7,
                                   err_msg=k)
    assert max(float(mx.max(mx.abs(v))) for k, v in a.items() if k.endswith("lora_b")) > 1e-3
    assert all(len(r["rank_peak_gb"]) == 2 and r["peak_gb"] == max(r["rank_peak_gb"])
               for r in two)


def test_world_size_is_recorded_and_resume_continues(runs):
    summary = json.loads((runs["two"] / "train_summary.json").read_text())
    assert summary["world_size"] == 2 and summary["global_batch_size"] == 4
    assert summary["batch_size"] == 4 and summary["rank_batch_size"] == 2
    assert summary["resumed_from"] == ITERS - 1
    state = json.loads((runs["two"] / "checkpoints" / f"step_{ITERS:06d}" / "state.json"
                        ).read_text())
    assert state["world_size"] == 2
    one = json.loads((runs["one"] / "train_summary.json").read_text())
    assert one["world_size"] == 1 and one["global_batch_size"] == 4
    # the resumed run ends where the uninterrupted one did (weights and momentum restored on
    # both ranks from rank 0's checkpoint)
    a = mx.load(str(runs["two"] / "adapters.safetensors"))
    b = mx.load(str(runs["uninterrupted"] / "adapters.safetensors"))
    for k in a:
        np.testing.assert_array_equal(np.array(a[k]), np.array(b[k]), err_msg=k)
    assert losses(runs["two"])[-1]["loss"] == losses(runs["uninterrupted"])[-1]["loss"]


def test_only_rank_zero_speaks(runs):
    for p, steps in ((runs["first"], ITERS), (runs["again"], 1)):
        lines = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
        assert len(lines) == 1 and lines[0]["world_size"] == 2, p.stdout  # the result line
        assert p.stderr.count("Iter ") == steps, p.stderr  # one report per step, not two
        assert p.stderr.count("trainable parameters") == 1, p.stderr
    assert runs["again"].stderr.count("resuming from") == 1
    log = read_log(runs["two"] / "train_log.jsonl")  # one writer: no record twice
    steps = [r["step"] for r in log if "loss" in r]
    assert steps == sorted(set(steps))


def test_resume_with_another_number_of_ranks_is_refused(runs, tmp_path, capsys):
    out = tmp_path / "two"
    shutil.copytree(runs["two"], out)
    common = [*OPTIONS, "--data", str(runs["tmp"] / "data"), "-c",
              str(runs["tmp"] / "sgd.yaml"), "--batch-size", "4", "--adapter-path", str(out)]
    assert cli.main(parse([*common, "--iters", str(ITERS + 1)])) == 2
    err = capsys.readouterr().err
    assert "2 rank(s), this run has 1" in err and "mlx.launch -n 2" in err, err
    assert "--no-resume" in err
    assert cli.main(parse([*common, "--iters", "1", "--no-resume"])) == 0  # as it says


def old_meaning(runs, tmp_path) -> Path:
    """The two-rank run as an older segback wrote it: --batch-size 2 per rank, a global batch
    of 4, and no `batch_size_is` in its checkpoints."""
    out = tmp_path / "old"
    shutil.copytree(runs["two"], out)
    for state_file in (out / "checkpoints").glob("step_*/state.json"):
        state = json.loads(state_file.read_text())
        del state["batch_size_is"]
        state["identity"]["batch_size"] = state["config"]["batch_size"] = 2
        state_file.write_text(json.dumps(state))
    shutil.rmtree(out / "checkpoints" / f"step_{ITERS:06d}")
    return out


@pytest.mark.parametrize("batch", [2, 4])
def test_checkpoint_of_the_old_per_rank_meaning(runs, tmp_path, capsys, batch):
    """An adapter directory trained when --batch-size meant per rank resumes with a note when
    given its global batch (4, the same batches), and is refused, saying what to give, under
    its old number (2, which now means half the batch); never a silent change of batch."""
    from segback.trainer.checkpoints import ResumeError, Run

    out = old_meaning(runs, tmp_path)
    cfg = small_cfg(out, data=str(runs["tmp"] / "data"), max_seq_length=128, batch_size=batch,
                    grad_accumulation_steps=2, optimizer="sgd", learning_rate=0.5,
                    optimizer_config={"sgd": {"momentum": 0.9}}, lora_dropout=0.0,
                    lora_rank=8, lora_scale=20.0, iters=ITERS, warmup=0, save_every=1)
    model = build_model("tiny-llama")
    cli.attach(model, cfg)
    train_set = loop.as_dataset(chat_rows(16), ByteTokenizer(), cfg, "train")  # its data
    run = Run(cfg, model, train_set, world_size=2)
    if batch == 2:
        with pytest.raises(ResumeError, match="--batch-size 2 per rank on 2 ranks .* resume "
                                              "with --batch-size 4"):
            run.start(model, cli.build_optimizer(cfg), {})
        return
    assert run.start(model, cli.build_optimizer(cfg), {}) == ITERS - 1
    assert "that is --batch-size 4 as it is read now" in capsys.readouterr().err


def test_a_batch_the_ranks_cannot_share_is_refused():
    with pytest.raises(distributed.DistributedError, match="--batch-size 3 is the global batch, "
                                                           "split across 2 ranks"):
        distributed.rank_batch(3, World(None, 0, 2))
    assert distributed.rank_batch(4, World(None, 1, 2)) == 2


# ---- without a launcher ----------------------------------------------------------------------


def test_each_rank_reads_its_slice_padded_alone():
    """Rank r's part of global batch k (--batch-size 2b) is rows [r*b, (r+1)*b) of the batch
    one process of batch 2b reads, collated as if alone (its own width)."""
    rows = chat_rows(9, seed=3) + [{"messages": [{"role": "user", "content": "hi"},
                                                 {"role": "assistant", "content": "yo"}]}] * 3
    cfg = small_cfg(Path("unused"), max_seq_length=128)
    ds = loop.as_dataset(rows, ByteTokenizer(), cfg, "train")
    b, seed = 2, 5
    groups = batch_groups(ds, 2 * b)
    for index in range(2 * len(groups)):
        epoch, pos = divmod(index, len(groups))
        group = groups[epoch_permutation(len(groups), seed, epoch)[pos]]
        whole, _ = batch_at(ds, index, 2 * b, seed, cfg.max_seq_length)
        for r in range(2):
            got, got_len = distributed.batch_at(ds, index, 2 * b, seed, cfg.max_seq_length,
                                                World(None, r, 2))
            want, want_len = collate([ds[i] for i in group[r * b:(r + 1) * b]],
                                     cfg.max_seq_length)
            assert got.tolist() == want.tolist() and got_len.tolist() == want_len.tolist()
            assert got.tolist() == whole[r * b:(r + 1) * b, :got.shape[1]].tolist()


def test_single_process_is_unchanged():
    world = distributed.init()
    assert world.size == 1 and world.main and distributed.init() is world
    assert distributed.rank_seed(123, world) == 123
    tree = {"a": mx.ones((2,)), "b": [mx.zeros((1,))]}
    assert world.all_sum_tree(tree) is tree and world.broadcast_int(7) == 7
    assert distributed.rank_seed(123, World(None, 1, 2)) != 123
