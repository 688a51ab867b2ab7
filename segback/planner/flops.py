"""Model FLOPs of one training step, from the geometry, and the device's measured matmul rate.

`step_flops` counts the matmuls of one step of `segback bench`'s modes (`full`, `ckpt`,
`segmented`) on a `Geometry` (`segback.planner.geometry.read_geometry`) at `seq_len` tokens per
sequence and `batch` sequences. Counting rules:

* A matmul of [m, k] by [k, n] is 2·m·n·k FLOPs. Only matmuls count: norms, RoPE, softmax,
  activations, the softcap and the cross-entropy are elementwise and left out; quantized weights
  count as the dense matmul they stand for (dequantization is not a model FLOP), and the
  embedding is a gather.
* Per token, a layer's linears cost `LayerGeom.linear_flops` forward: 2·in·out for every base
  linear plus 2·r·(in + out) for each rank-r LoRA (x·A, then ·B).
* Backward of a linear: the frozen base weight needs only dX (`cost.BWD_LINEAR` = 1× its
  forward); a LoRA adapter needs its dX (1× its forward) and dA, dB (another 1×), so a layer's
  linear backward is BWD_LINEAR · linear_flops + 2·lora_params per token. Every layer from the
  lowest one carrying LoRA up runs a backward (below it nothing is trainable and no gradient
  flows); the lowest trainable layer's Q/K/V dX is counted although MLX may skip it.
* Attention per token: 4·q_width·keys (Q·Kᵀ and P·V, q_width = heads·head_dim), with `keys` the
  mean number of keys a query sees: causal (i+1 keys at position i) is (L+1)/2 ≈ L/2; a sliding
  window W < L makes it the mean of min(i+1, W) ≈ W (W ≥ L is causal). These are the model's
  FLOPs: MLX's fused kernel under grad scores every key of the [L, L] mask and the chunked one
  whole chunks, which is not counted. Backward: dQ, dK, dV, dP, `cost.BWD_ATTN_FUSED` = 2× the
  forward; chunked attention also recomputes its probabilities (`cost.BWD_ATTN_CHUNKED` -
  BWD_ATTN_FUSED = 1× more), counted as recompute.
* Loss head ([tokens, hidden] · [hidden, vocab], frozen): forward 2·hidden·vocab per row, and
  dX as much again. mlx-lm's `default_loss` builds logits for every input token; segback's
  chunked head (segback.engine.head) only for the loss tokens (`loss_tokens`; default all).
* Gemma-4's per-layer-input projection (hidden → layers·256, frozen, fed by the frozen
  embedding) is a forward-only prologue matmul.
* Recompute, the work a plan repeats (as `cost.CostModel.relative_step_time` models it): `full`
  none; `ckpt` (mlx-lm's grad_checkpoint, one checkpoint per layer) one forward of every layer
  that runs a backward; `segmented`, untiled: the same, one forward of each segment's layers
  (segments below the lowest LoRA layer are skipped by the engine); tiled (`plan.engine.tile`):
  each layer's backward recomputes its forward and its Q/K/V projections once more (the pre
  pass's VJP), and each segment first recomputes the boundaries inside it (the forward of all
  its layers but the last); untiled with `plan.engine.mlp_chunk`, every MLP's forward once more
  (its VJP recomputes it chunk by chunk).

`total` = forward + backward + recompute; `flops_per_token` = total / (batch · seq_len), so
flops_per_token × tokens/s is the FLOP rate a step sustains (recompute included: hardware FLOPs,
not the "useful" 6N-style count; `useful` = forward + backward is returned too).

`matmul_peak` measures the device's dense matmul rate (bfloat16 on a GPU, float32 on the CPU)
once per process, the denominator of `segback bench`'s `hw_fraction`.
"""

from __future__ import annotations

import functools
import math
import time
from typing import Any

import mlx.core as mx

from segback.planner.cost import BWD_ATTN_CHUNKED, BWD_ATTN_FUSED, BWD_LINEAR
from segback.planner.geometry import Geometry, LayerGeom

MODES = ("full", "ckpt", "segmented")


def mean_keys(seq_len: int, window: int | None = None) -> float:
    """Mean number of keys a causal query attends to over `seq_len` positions: (L+1)/2, or
    with a sliding window W < L, (W(W+1)/2 + (L-W)·W) / L (the mean of min(i+1, W))."""
    L = seq_len
    if window is None or window >= L:
        return (L + 1) / 2
    W = window
    return (W * (W + 1) / 2 + (L - W) * W) / L


def layer_flops(g: LayerGeom, seq_len: int) -> dict[str, float]:
    """Per-token FLOPs of one layer: linear and attention forward, their backward, the Q/K/V
    projections' forward (what the tiled engine recomputes once more)."""
    attn = 4.0 * g.q_width * mean_keys(seq_len, g.window)
    lora = 2.0 * g.lora_params  # LoRA's forward; its dA, dB cost as much again
    return dict(linear=g.linear_flops, attention=attn,
                linear_bwd=BWD_LINEAR * g.linear_flops + lora,
                attention_bwd=BWD_ATTN_FUSED * attn, qkv=g.qkv_flops)


def _plan_parts(plan: Any, n: int
                ) -> tuple[list[tuple[int, int]], str, int | None, int | None]:
    """(segments, attention, tile, mlp_chunk) of a `segback.engine.Plan` (None: one segment,
    fused)."""
    if plan is None:
        return [(0, n)], "fused", None, None
    engine = getattr(plan, "engine", None)
    segments = [(int(a), int(b)) for a, b in plan.segments]
    attention = getattr(engine, "attention", "fused") or "fused"
    tile = getattr(engine, "tile", None)
    return segments, ("chunked" if tile else attention), tile, getattr(engine, "mlp_chunk", None)


def step_flops(geom: Geometry, seq_len: int, batch: int = 1, mode: str = "segmented",
               plan: Any = None, loss_tokens: int | None = None) -> dict[str, float]:
    """FLOPs of one training step (see the module docstring for what is counted).

    `mode` is `full`, `ckpt` or `segmented`; `plan` (segmented only) is the
    `segback.engine.Plan` that runs (segments, attention, tile), None for one untiled segment
    with fused attention. `loss_tokens` (all `batch · seq_len` when None) is how many rows
    segback's head computes. Returns forward, backward, recompute, total and useful (= forward
    + backward) FLOPs for the whole step, `tokens`, `loss_tokens` and `flops_per_token`.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    L, B = int(seq_len), int(batch)
    tokens = B * L
    n = geom.num_layers
    per = [layer_flops(g, L) for g in geom.layers]
    trainable = [i for i, g in enumerate(geom.layers) if g.lora_params]
    first = trainable[0] if trainable else n  # layers >= first run a backward
    segments, attention, tile, mlp_chunk = _plan_parts(plan if mode == "segmented" else None, n)
    chunked = mode == "segmented" and attention == "chunked"

    fwd = [p["linear"] + p["attention"] for p in per]
    forward = sum(fwd) + 2.0 * geom.hidden * geom.per_layer_width
    backward = sum(p["linear_bwd"] + p["attention_bwd"] for p in per[first:])
    if mode == "full":
        recompute = 0.0
    elif mode == "ckpt":
        recompute = sum(fwd[first:])
    else:
        run = [(a, b) for a, b in segments if b > first]  # the engine skips frozen segments
        recompute = sum(sum(fwd[a:b]) for a, b in run)
        if tile:
            recompute += sum(per[i]["qkv"] for a, b in run for i in range(a, b))
            recompute += sum(sum(fwd[a:b - 1]) for a, b in run)
        elif mlp_chunk:  # every MLP's forward once more, in its VJP
            recompute += sum(geom.layers[i].mlp_flops for a, b in run for i in range(a, b))
        if chunked:
            recompute += sum((BWD_ATTN_CHUNKED - BWD_ATTN_FUSED) * p["attention"]
                             for p in per[first:])

    head_rows = tokens if mode != "segmented" or loss_tokens is None else int(loss_tokens)
    head = 2.0 * geom.hidden * geom.vocab * head_rows
    out = dict(forward=forward * tokens + head,
               backward=(backward * tokens + head) if first < n else 0.0,
               recompute=recompute * tokens)
    out["useful"] = out["forward"] + out["backward"]
    out["total"] = out["useful"] + out["recompute"]
    out.update(tokens=tokens, loss_tokens=head_rows, flops_per_token=out["total"] / tokens)
    return out


def default_matmul_dtype():
    """bfloat16 on a GPU, float32 on the CPU (the dtypes `segback bench` trains in)."""
    return mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32


def matmul_peak(dtype: Any = None) -> float:
    """Measured FLOP/s of a square matmul on the default device in `dtype` (default:
    `default_matmul_dtype`). The size doubles from 256 until one product takes >= 25 ms (at
    most 16384 on a GPU, 8192 on the CPU), then the product is repeated for ~0.3 s; cached per
    (dtype, device) for the process."""
    dt = dtype if dtype is not None else default_matmul_dtype()
    return _matmul_peak(str(dt).split(".")[-1], str(mx.default_device()))


@functools.cache
def _matmul_peak(dtype_name: str, device: str) -> float:
    dt = getattr(mx, dtype_name)
    max_n = 16384 if mx.default_device() == mx.gpu else 8192
    key_a, key_b = mx.random.split(mx.random.key(0))
    n = 256
    while True:
        a = mx.random.normal((n, n), key=key_a).astype(dt)
        b = mx.random.normal((n, n), key=key_b).astype(dt)
        mx.eval(a, b)
        mx.eval(a @ b)  # warm-up (kernel selection, buffer cache)
        tic = time.perf_counter()
        mx.eval(a @ b)
        one = time.perf_counter() - tic
        if one >= 0.025 or n >= max_n:
            break
        n *= 2
    reps = max(2, math.ceil(0.3 / max(one, 1e-6)))
    tic = time.perf_counter()
    for _ in range(reps):
        mx.eval(a @ b)
    elapsed = time.perf_counter() - tic
    del a, b
    mx.clear_cache()
    return 2.0 * n**3 * reps / elapsed
