"""Model FLOPs per step (segback.planner.flops) against hand counts, and bench's throughput keys."""

import pytest

from segback.benchmark.worker import throughput
from segback.engine import EngineOptions, Plan
from segback.models.random_init import GEOMETRIES
from segback.planner.flops import matmul_peak, mean_keys, step_flops
from segback.planner.geometry import read_geometry, resolve_model

RANK = 8


def geometry(name: str, lora_layers: int | None = None):
    model, _ = resolve_model(name, "float32", None)
    return read_geometry(model, RANK, lora_layers, "float32", name)


def hand_count(L: int, lora_layers: int | None = None) -> dict:
    """tiny-llama per token, from its config: 2*m*n*k per matmul, frozen base linears dX only,
    LoRA dX + dA + dB, causal attention (L+1)/2 keys, head on every token."""
    c = GEOMETRIES["tiny-llama"]
    d, inter, V = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    n = c["num_hidden_layers"]
    hd = d // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * hd
    shapes = [(d, d), (d, kv), (d, kv), (d, d), (d, inter), (d, inter), (inter, d)]  # q k v o g u d
    base = sum(2 * i * o for i, o in shapes)
    lora = sum(2 * RANK * (i + o) for i, o in shapes)
    attn = 2 * 2 * d * (L + 1) / 2  # Q.K^T and P.V over (L+1)/2 keys on average
    fwd = base + lora + attn
    bwd = base + 2 * lora + 2 * attn
    head = 2 * d * V
    trained = n if lora_layers is None else lora_layers
    return dict(layer_fwd=fwd, n=n, full=n * fwd + head + trained * bwd + head,
                layers_fwd_trained=trained * fwd)


def test_tiny_llama_hand_count():
    L, B = 64, 2
    g = geometry("tiny-llama")
    hand = hand_count(L)
    full = step_flops(g, L, B, "full")
    assert full["flops_per_token"] == pytest.approx(hand["full"], rel=1e-12)
    assert full["flops_per_token"] == 951808  # worked out on paper at L = 64
    assert full["tokens"] == B * L and full["recompute"] == 0
    assert full["total"] == full["forward"] + full["backward"] == full["useful"]


@pytest.mark.parametrize("plan", [None, Plan([(0, 1), (1, 2), (2, 3), (3, 4)], EngineOptions())])
def test_segmented_is_full_plus_one_forward(plan):
    L, B = 64, 1
    g = geometry("tiny-llama")
    full = step_flops(g, L, B, "full")
    seg = step_flops(g, L, B, "segmented", plan)
    one_forward = hand_count(L)["n"] * hand_count(L)["layer_fwd"] * B * L
    assert seg["total"] - full["total"] == pytest.approx(one_forward, rel=1e-12)
    assert seg["recompute"] == pytest.approx(one_forward, rel=1e-12)
    assert step_flops(g, L, B, "ckpt")["total"] == pytest.approx(seg["total"], rel=1e-12)


def test_tiled_and_chunked_recompute():
    L = 64
    g = geometry("tiny-llama")
    fwd = hand_count(L)["layer_fwd"] * L
    attn = 4 * 64 * (L + 1) / 2 * L
    qkv = sum(x.qkv_flops for x in g.layers) * L
    base = step_flops(g, L, 1, "segmented")
    chunked = step_flops(g, L, 1, "segmented", Plan([(0, 4)], EngineOptions(attention="chunked")))
    assert chunked["recompute"] - base["recompute"] == pytest.approx(4 * attn, rel=1e-12)
    tiled = step_flops(g, L, 1, "segmented", Plan([(0, 3), (3, 4)], EngineOptions(tile=16)))
    # every layer's forward + its Q/K/V once more + boundaries 1, 2 inside segment [0, 3)
    # + chunked attention's probabilities
    expect = 4 * fwd + qkv + 2 * fwd + 4 * attn
    assert tiled["recompute"] == pytest.approx(expect, rel=1e-12)
    assert tiled["useful"] == base["useful"]
    # chunked MLPs: gate, up and down (with their LoRA) once more per layer
    c = GEOMETRIES["tiny-llama"]
    d, inter = c["hidden_size"], c["intermediate_size"]
    mlp = sum(2 * i * o + 2 * RANK * (i + o) for i, o in [(d, inter), (d, inter), (inter, d)])
    chunks = step_flops(g, L, 1, "segmented", Plan([(0, 4)], EngineOptions(mlp_chunk=16)))
    assert chunks["recompute"] - base["recompute"] == pytest.approx(4 * mlp * L, rel=1e-12)


def test_loss_tokens_and_lora_layers():
    L = 64
    g = geometry("tiny-llama")
    c = GEOMETRIES["tiny-llama"]
    head = 2 * c["hidden_size"] * c["vocab_size"]
    seg = step_flops(g, L, 1, "segmented", loss_tokens=L // 2)
    all_rows = step_flops(g, L, 1, "segmented")
    assert all_rows["total"] - seg["total"] == pytest.approx(2 * head * L // 2)
    # mlx-lm's default_loss builds logits for every token whatever the mask
    full = step_flops(g, L, 1, "full")
    assert step_flops(g, L, 1, "full", loss_tokens=1)["total"] == full["total"]
    # LoRA on the top 2 layers: only they run a backward (and a recompute)
    g2 = geometry("tiny-llama", lora_layers=2)
    hand = hand_count(L, lora_layers=2)
    assert step_flops(g2, L, 1, "full")["flops_per_token"] == pytest.approx(
        hand["full"] - 2 * 2 * RANK * 1024, rel=1e-12)  # bottom layers carry no LoRA forward
    ckpt = step_flops(g2, L, 1, "ckpt")
    assert ckpt["recompute"] == pytest.approx(hand["layers_fwd_trained"] * L, rel=1e-12)
    assert step_flops(g2, L, 1, "segmented", Plan([(0, 2), (2, 4)], EngineOptions()))[
        "recompute"] == pytest.approx(ckpt["recompute"], rel=1e-12)


def test_sliding_window_keys():
    assert mean_keys(64) == 32.5
    assert mean_keys(8, 16) == 4.5  # window past the sequence: causal
    W, L = 8, 64
    assert mean_keys(L, W) == pytest.approx(sum(min(i + 1, W) for i in range(L)) / L)
    g = geometry("tiny-gemma3")  # window 8, every third layer full
    f = step_flops(g, L, 1, "full")
    g_long = step_flops(g, 2 * L, 1, "full")
    sliding = [x for x in g.layers if x.window]
    full_layers = [x for x in g.layers if not x.window]
    assert sliding and full_layers
    # attention grows by its key count per token: sliding layers barely, full ones by L/2
    grow = sum(3 * 4 * x.q_width * (mean_keys(2 * L, x.window) - mean_keys(L, x.window))
               for x in g.layers)
    assert g_long["flops_per_token"] - f["flops_per_token"] == pytest.approx(grow, rel=1e-9)


def test_matmul_peak_and_row_keys():
    peak = matmul_peak()
    assert peak > 1e8  # anything slower than 0.1 GFLOP/s is not a matmul
    assert matmul_peak() == peak  # measured once per process
    g = geometry("tiny-llama")
    row = throughput(g, 64, 1, "ckpt", None, None, 1000.0, 2e12)
    assert row["flops_per_token"] == 1345536
    assert row["model_tflops"] == pytest.approx(1345536 * 1000 / 1e12, rel=1e-3)
    assert row["device_matmul_tflops"] == 2.0
    assert row["hw_fraction"] == pytest.approx(row["model_tflops"] / 2.0, rel=1e-3)
    assert row["matmul_dtype"] == "float32"
