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

import argparse
import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from context_cases import CASES, MODELS, RUNS, STEPS, case_inputs, optimizer
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.tuner.trainer import default_loss
from test_distributed import env, free_ports, launcher
from test_engine import _cast, assert_as_exact_as_mlx_lm
from test_train import chat_rows, parse, read_log, write_jsonl

from segback.engine.chunked import default_chunk_size
from segback.engine.plan_file import Plan, PlanError
from segback.engine.ring_attention import RingError, shard_positions
from segback.planner.context import scored_pairs
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


def train_one_process(name, model, batch, lengths) -> tuple[tuple[float, int], dict, dict]:
    """mlx-lm's ((loss, tokens), grads) of the first step and the adapter after STEPS steps,
    in the model's dtype."""
    opt = optimizer(name)
    grad_fn = nn.value_and_grad(model, default_loss)
    for step in range(STEPS):
        (loss, n), grads = grad_fn(model, batch, lengths)
        if step == 0:
            first = (float(loss), int(n)), grads
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state)
    return (*first, dict(tree_flatten(model.trainable_parameters())))


@pytest.fixture(scope="module")
def references() -> dict:
    """Per model: mlx-lm's float32 and float64 (loss, tokens), first-step grads and the adapter
    after STEPS steps, on the whole rows in one process, from the same start."""
    refs = {}
    for name in MODELS:
        model, batch, lengths, *_ = case_inputs(name)
        start = dict(tree_flatten(model.trainable_parameters()))
        (l32, n32), g32, a32 = train_one_process(name, model, batch, lengths)
        model.load_weights(list(start.items()), strict=False)
        _cast(model, mx.float32, mx.float64)
        (l64, _), _, a64 = train_one_process(name, model, batch, lengths)
        _cast(model, mx.float64, mx.float32)
        model.load_weights(list(start.items()), strict=False)
        refs[name] = (model, batch, lengths, l32, l64, n32, g32, a32, a64)
    return refs


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("name,order,steps", RUNS)
def test_ring_equals_one_process(ring_results, references, ranks, name, order, steps):
    model, batch, lengths, l32, l64, ntoks, g32, a32, a64 = references[CASES[name][0]]
    got = np.load(ring_results[ranks] / f"{name}.{order}.npz")
    assert int(got["n"]) == ntoks and 0 < int(got["local_n"]) < ntoks
    assert abs(float(got["loss"]) - l64) <= 5 * abs(l32 - l64) + 1e-6 * abs(l64)
    ours = {k[len("grad."):]: mx.array(got[k]) for k in got.files if k.startswith("grad.")}
    assert_as_exact_as_mlx_lm(model, g32, tree_unflatten(list(ours.items())), batch, lengths)
    if steps < STEPS:
        return
    # after STEPS steps: as close to the float64 adapter as mlx-lm's float32 one is
    adapter = {k[len("adapter."):]: got[k] for k in got.files if k.startswith("adapter.")}
    assert adapter.keys() == a64.keys()
    top = max(float(mx.abs(v).max()) for v in a64.values())
    for k, exact in a64.items():
        exact = np.array(exact)
        ref_err = np.linalg.norm(np.array(a32[k]) - exact)
        err = np.linalg.norm(adapter[k] - exact)
        assert err <= 5 * ref_err + 1e-6 * (np.linalg.norm(exact) + top), (k, err, ref_err)


@pytest.mark.parametrize("ranks", [2, 4])
def test_bad_input_stops_every_rank(ring_results, ranks):
    said = {what: [(ring_results[ranks] / f"{what}.{r}.txt").read_text() for r in range(ranks)]
            for what in ("refused", "indivisible")}
    assert all(f"rank(s) {ranks - 1} have other options" in t for t in said["refused"]), said
    assert all(f"--context-parallel {ranks + 1} does not divide the {ranks} rank(s)" in t
               for t in said["indivisible"]), said
    if ranks == 4:  # every rank names the ranks that cannot send, and what to do
        for r in range(ranks):
            t = (ring_results[ranks] / f"neighbours.{r}.txt").read_text()
            assert "rank(s) 0, 1, 2, 3 could not send" in t and "--backend ring or mpi" in t, t


# ---- segback train --context-parallel --------------------------------------------------------

ITERS = 3
OPTIONS = ["--model", "tiny-llama", "--max-seq-length", "128", "--plan", "2", "--no-progress",
           "--lora-dropout", "0", "--steps-per-eval", "0", "--steps-per-report", "1",
           "--optimizer", "sgd", "--learning-rate", "0.5", "--iters", str(ITERS)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    """One process of batch 2 (untiled, 2 layers a segment); 2 ranks as one context ring (batch
    2), each running the tiled engine with offload on its shard; 4 ranks as 2 data x 2 context
    ranks (global batch 2, as in mlx_lm.lora: 1 row per data rank), each rank's plan made by
    the planner for its shard (--plan auto)."""
    if not mx.distributed.is_available("ring"):
        pytest.skip("this MLX build has no ring backend")
    tmp = tmp_path_factory.mktemp("cp")
    write_jsonl(tmp / "data" / "train.jsonl", chat_rows(16))
    (tmp / "sgd.yaml").write_text("optimizer_config:\n  sgd:\n    momentum: 0.9\n")
    common = [*OPTIONS, "--data", str(tmp / "data"), "-c", str(tmp / "sgd.yaml")]
    train = ["-m", "segback.cli", "train", *common]
    run_ranks(2, [*train, "--batch-size", "2", "--context-parallel", "2", "--tile", "16",
                  "--offload", "true", "--adapter-path", str(tmp / "ring2")])
    run_ranks(4, [*train, "--batch-size", "2", "--context-parallel", "2", "--plan", "auto",
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
    if run == "ring2":
        assert summary["engine"]["tile"] == 16 and summary["engine"]["offload"]


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
    cfg = TrainConfig(model="tiny-llama", data="x", max_seq_length=16, context_parallel=8)
    with pytest.raises(TrainConfigError, match="16 pieces, more than the 15 tokens"):
        check_context(cfg)


def test_zigzag_balances_causal_work():
    """The pairs each rank's ring attention scores (`scored_pairs`, as the engine chunks its
    queries against key ranges): zig-zag keeps the busiest rank within 10% of the mean,
    contiguous does not; and no rank scores fewer pairs than its queries see."""
    L, R = 4096, 4
    for order in ("zigzag", "contiguous"):
        shards = shard_positions(L, R, order)
        chunk = default_chunk_size(1, 32, shards.padded, shards.padded)
        work = [scored_pairs(shards, r, None, chunk) for r in range(R)]
        exact = [int((p + 1).sum()) for p in shards.positions]
        assert all(w >= e for w, e in zip(work, exact))
        busiest = max(work) / np.mean(work)
        assert (busiest <= 1.10) if order == "zigzag" else (busiest > 1.5), (order, busiest)


# ---- segback plan --context-parallel -------------------------------------------------------


def test_plan_per_rank(tmp_path, capsys):
    """A rank's plan: its shard's length, a peak that falls with R, the bytes it sends (each
    forward R - 1 K/V blocks, each backward R - 1 K/V and R dK/dV blocks; untiled, two forwards
    a layer), its ring buffers (K/V in hand and arriving, the float32 copy attended, dK/dV in
    hand and arriving), and a plan file that refuses a longer shard."""
    from segback.models.random_init import geometry_config
    from segback.planner import plan_segments
    from segback.planner.cli import add_arguments, main

    L = 4096
    cfg = geometry_config("tiny-llama")
    kv_width = cfg["num_key_value_heads"] * cfg["hidden_size"] // cfg["num_attention_heads"]
    block = L // 4 * 2 * kv_width  # [K | V] of a shard, per byte of its elements
    plans = {R: plan_segments("tiny-llama", L, context_parallel=R, segments=1)
             for R in (1, 2, 4)}
    assert plans[1].context == {}
    assert plans[1].predicted_peak_gb > plans[2].predicted_peak_gb > plans[4].predicted_peak_gb
    c = plans[4].context
    assert (c["ranks"], c["shard_tokens"], c["seq_len"]) == (4, 1024, L)
    layers = cfg["num_hidden_layers"]
    assert c["messages_per_step"] == layers * (2 * 3 + 7)
    # K/V in bfloat16 (the geometry's dtype), dK/dV in float32
    assert c["sent_gb_per_step"] * 1024**3 == pytest.approx(layers * (9 * 2 + 4 * 4) * block)
    assert c["ring_buffer_gb"] * 1024**3 == pytest.approx((2 * 2 + 3 * 4) * block)
    assert 1.0 <= c["balance"] <= 1.10
    tiled = plan_segments("tiny-llama", L, context_parallel=4, segments=2, tile=256)
    # a segment of 2 layers recomputes its first layer's forward once more
    assert tiled.context["messages_per_step"] == c["messages_per_step"] + 2 * 3

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "plan.json"
    assert main(parser.parse_args(["--model", "tiny-llama", "--seq", str(L), "--out", str(out),
                                   "--context-parallel", "4"])) == 0
    said = capsys.readouterr().out
    assert "context parallel: 4 ranks (zigzag), 1024 of 4096 tokens each" in said, said
    plan = Plan.read(out)
    assert plan.context["shard_tokens"] == 1024
    assert plan.check(layers, seq_len=1024)
    with pytest.raises(PlanError, match="made for shards of 1024 tokens"):
        plan.check(layers, seq_len=1025)
    with pytest.raises(ValueError, match="cannot be calibrated or timed"):
        plan_segments("tiny-llama", L, context_parallel=2, measure=1)
