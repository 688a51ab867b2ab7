"""Context parallelism (issue 37): one sequence split over 2 and 4 local ranks (mlx.launch, ring
backend, CPU) gives the loss and LoRA gradients of one process on the whole sequence.

Tolerances are derived, not tuned: ring attention sums a softmax row in other pieces and order
than mlx-lm, so its float32 result differs from mlx-lm's float32 one by rounding. The bound is
`test_engine.assert_as_exact_as_mlx_lm`'s: our error against float64 within a few times
mlx-lm's own float32 error against float64 (a wrong mask, position or cotangent is orders of
magnitude above it). Trained adapters (SGD: weights linear in the gradients) then agree to
float32 rounding of the gradients.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from context_cases import CASES, case_inputs
from mlx_lm.tuner.trainer import default_loss
from test_distributed import env, free_ports, launcher
from test_engine import _cast, assert_as_exact_as_mlx_lm
from test_train import chat_rows, parse, read_log, write_jsonl

from segback.engine.ring_attention import RingError, shard_positions
from segback.trainer import cli
from segback.trainer.cli import check_context
from segback.trainer.config import TrainConfigError, TrainConfig

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent


def run_ranks(n: int, args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    """`mlx.launch -n n --backend ring -- python ARGS` on 127.0.0.1; a rank's failure is read
    from the launcher's warning (it exits 0 even then)."""
    cmd = [launcher(), "-n", str(n), "--backend", "ring", "-p", str(free_ports(n)), "--",
           sys.executable, *args]
    p = subprocess.run(cmd, cwd=ROOT, env=env(), stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, timeout=timeout)
    assert "Node with rank" not in p.stderr and p.returncode == 0, \
        f"{' '.join(cmd)}\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}"
    return p


@pytest.fixture(scope="module")
def ring_results(tmp_path_factory) -> dict[int, Path]:
    if not mx.distributed.is_available("ring"):
        pytest.skip("this MLX build has no ring backend")
    out = {}
    for n in (2, 4):
        out[n] = tmp_path_factory.mktemp(f"ranks{n}")
        run_ranks(n, [str(HERE / "context_ranks.py"), str(out[n])])
    return out


@pytest.fixture(scope="module")
def references() -> dict:
    """Per case: mlx-lm's float32 (loss, grads) and the float64 (loss, grads) on the whole
    rows in one process."""
    refs = {}
    for name in CASES:
        model, batch, lengths, _ = case_inputs(name)
        (l32, n32), g32 = nn.value_and_grad(model, default_loss)(model, batch, lengths)
        _cast(model, mx.float32, mx.float64)
        (l64, _), _ = nn.value_and_grad(model, default_loss)(model, batch, lengths)
        _cast(model, mx.float64, mx.float32)
        refs[name] = (model, batch, lengths, float(l32), float(l64), int(n32), g32)
    return refs


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("order", ["zigzag", "contiguous"])
@pytest.mark.parametrize("name", list(CASES))
def test_ring_equals_one_process(ring_results, references, ranks, order, name):
    model, batch, lengths, l32, l64, ntoks, g32 = references[name]
    got = np.load(ring_results[ranks] / f"{name}.{order}.npz")
    assert int(got["n"]) == ntoks and 0 < int(got["local_n"]) < ntoks
    assert abs(float(got["loss"]) - l64) <= 5 * abs(l32 - l64) + 1e-6 * abs(l64)
    ours = {k[len("grad."):]: mx.array(got[k]) for k in got.files if k.startswith("grad.")}
    from mlx.utils import tree_unflatten
    assert_as_exact_as_mlx_lm(model, g32, tree_unflatten(list(ours.items())), batch, lengths)


def test_ranks_that_disagree_all_stop(ring_results):
    for n in (2, 4):
        said = (ring_results[n] / "refused.txt").read_text()
        assert f"rank(s) {n - 1} have other options" in said, said


# ---- segback train --context-parallel --------------------------------------------------------

ITERS = 3
OPTIONS = ["--model", "tiny-llama", "--max-seq-length", "128", "--plan", "2", "--no-progress",
           "--lora-dropout", "0", "--steps-per-eval", "0", "--steps-per-report", "1",
           "--optimizer", "sgd", "--learning-rate", "0.5", "--iters", str(ITERS)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    """One process of batch 2; 2 ranks as one context ring (batch 2); 4 ranks as 2 data x 2
    context ranks (global batch 2, as in mlx_lm.lora: 1 row per data rank)."""
    if not mx.distributed.is_available("ring"):
        pytest.skip("this MLX build has no ring backend")
    tmp = tmp_path_factory.mktemp("cp")
    write_jsonl(tmp / "data" / "train.jsonl", chat_rows(16))
    (tmp / "sgd.yaml").write_text("optimizer_config:\n  sgd:\n    momentum: 0.9\n")
    common = [*OPTIONS, "--data", str(tmp / "data"), "-c", str(tmp / "sgd.yaml")]
    train = ["-m", "segback.cli", "train", *common]
    run_ranks(2, [*train, "--batch-size", "2", "--context-parallel", "2",
                  "--adapter-path", str(tmp / "ring2")])
    run_ranks(4, [*train, "--batch-size", "2", "--context-parallel", "2",
                  "--context-order", "contiguous", "--adapter-path", str(tmp / "grid")])
    assert cli.main(parse([*common, "--batch-size", "2", "--adapter-path", str(tmp / "one")])
                    ) == 0
    return {k: tmp / k for k in ("ring2", "grid", "one")}


@pytest.mark.parametrize("run", ["ring2", "grid"])
def test_training_equals_one_process(trained, run):
    ours = [r for r in read_log(trained[run] / "train_log.jsonl") if "loss" in r]
    one = [r for r in read_log(trained["one"] / "train_log.jsonl") if "loss" in r]
    assert [r["tokens"] for r in ours] == [r["tokens"] for r in one]
    np.testing.assert_allclose([r["loss"] for r in ours], [r["loss"] for r in one], rtol=1e-5)
    assert one[0]["loss"] != pytest.approx(one[-1]["loss"], rel=1e-3)  # it trained
    assert all(len(r["rank_peak_gb"]) == (2 if run == "ring2" else 4) for r in ours)
    a = mx.load(str(trained[run] / "adapters.safetensors"))
    b = mx.load(str(trained["one"] / "adapters.safetensors"))
    assert sorted(a) == sorted(b)
    top = max(float(mx.abs(v).max()) for v in b.values())
    for k in a:
        assert float(mx.abs(a[k] - b[k]).max()) <= 1e-5 * top, k
    summary = json.loads((trained[run] / "train_summary.json").read_text())
    assert summary["context_parallel"] == 2
    assert summary["world_size"] == (1 if run == "ring2" else 2)  # data ranks


# ---- bad input (no launcher needed) ----------------------------------------------------------


def test_context_ranks_must_divide_the_world(tmp_path, capsys):
    write_jsonl(tmp_path / "data" / "train.jsonl", chat_rows(4))
    code = cli.main(parse([*OPTIONS, "--data", str(tmp_path / "data"), "--context-parallel",
                           "2", "--adapter-path", str(tmp_path / "out")]))
    err = capsys.readouterr().err
    assert code == 2 and "--context-parallel 2 does not divide the 1 rank(s)" in err, err


def test_more_pieces_than_tokens_is_refused():
    with pytest.raises(RingError, match="cannot be split into 8 non-empty zig-zag"):
        shard_positions(7, 4, "zigzag")
    assert [len(p) for p in shard_positions(7, 4, "contiguous").positions] == [2, 2, 2, 1]
    from segback.engine.plan_file import Plan

    cfg = TrainConfig(model="tiny-llama", data="x", max_seq_length=16, context_parallel=8)
    with pytest.raises(TrainConfigError, match="16 pieces, more than the 15 tokens"):
        check_context(cfg, Plan(segments=[(0, 4)]))


def test_zigzag_balances_causal_work():
    """Rank r's causal work is the number of (query, key) pairs it scores: zig-zag keeps every
    rank within 10% of the mean, contiguous does not."""
    L, R = 4096, 4
    for order, worst in (("zigzag", 0.10), ("contiguous", 0.5)):
        work = [int((p + 1).sum()) for p in shard_positions(L, R, order).positions]
        spread = (max(work) - min(work)) / np.mean(work)
        assert (spread <= worst) if order == "zigzag" else (spread > worst), (order, spread)
