"""Calibration: measure a 1- and a 2-layer segment of the real model at two lengths and fit
the cost model's multipliers (non-negative least squares)."""

from __future__ import annotations

import contextlib
import gc
import itertools
import sys
from collections.abc import Iterator, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.tuner.lora import LoRALinear

from segback.engine.attention import fused_routed, use_attention
from segback.engine.memory import reset_peak
from segback.engine.stack import get_stack
from segback.planner.cost import Coefficients, CostModel
from segback.planner.geometry import DTYPES, FULL, GB, Geometry, linears, read_geometry, text_parts


CALIBRATION_LENGTHS = (512, 1024)


def attach_lora(layers: Sequence[nn.Module], rank: int) -> list[tuple[nn.Module, list]]:
    """Wrap the linears of `layers` in LoRA (if they have none); returns what to restore."""
    undo = []
    for layer in layers:
        if any(v.size for _, v in tree_flatten(layer.trainable_parameters())):
            continue
        originals = linears(layer)
        layer.update_modules(tree_unflatten(
            [(p, LoRALinear.from_base(m, r=rank, scale=20.0)) for p, m in originals]))
        undo.append((layer, originals))
    return undo


def measure_segment(model: nn.Module, start: int, stop: int, seq_len: int,
                    batch_size: int = 1, lora_rank: int = 8, descriptors: bool = False) -> float:
    """Peak bytes above the inputs of one segment's vjp, as the engine runs it.

    Runs segback's stack adapter on random hidden states (no embedding or head), with LoRA
    attached to the segment's layers if the model has none; only those layers are touched.
    """
    stack = get_stack(model)
    if any(stack.kv_source[i] < start for i in range(start, stop)):
        raise ValueError("calibration segment must not read K/V from an earlier segment")
    layers = stack.layers[start:stop]
    undo = attach_lora(layers, lora_rank)
    try:
        mx.random.seed(0)
        outer, args = text_parts(model)
        dtype = DTYPES[read_geometry(model).dtype]
        h = mx.random.normal((batch_size, seq_len, args.hidden_size)).astype(dtype)
        pli = None
        if stack.call_layer is not None and getattr(args, "hidden_size_per_layer_input", 0):
            pli = mx.random.normal((batch_size, seq_len, stack.num_layers,
                                    args.hidden_size_per_layer_input)).astype(dtype)
        masks = stack.masks(h, descriptors=descriptors)  # descriptors: attention is routed
        flat = [(i, k, v) for i, layer in enumerate(layers)
                for k, v in tree_flatten(layer.trainable_parameters())]
        params = [v for _, _, v in flat]
        dh = mx.random.normal(h.shape).astype(dtype) * 1e-2
        mx.eval(h, pli, dh, params, [m for m in masks.values() if isinstance(m, mx.array)],
                [layer.parameters() for layer in layers])

        def seg_fn(h_in, *leaves):
            for i, layer in enumerate(layers):
                own = [(k, v) for (j, k, _), v in zip(flat, leaves) if j == i]
                layer.update(tree_unflatten(own), strict=False)
            return [stack.run(start, stop, h_in, masks, pli)[0]]

        gc.collect()
        reset_peak()
        base = mx.get_active_memory()
        _, vjps = mx.vjp(seg_fn, [h, *params], [dh])
        mx.eval(vjps)
        peak = mx.get_peak_memory() - base
        for i, k, v in flat:  # put the untraced leaves back
            layers[i].update(tree_unflatten([(k, v)]), strict=False)
        return float(peak)
    finally:
        for layer, originals in undo:
            layer.update_modules(tree_unflatten(originals))


def calibration_segments(geom: Geometry) -> list[tuple[int, int]]:
    """The first full-attention layer alone, and with the layer before it: both attention kinds
    are measured when the model mixes them, and no segment reads shared K/V."""
    n = geom.num_layers
    f = next((i for i, g in enumerate(geom.layers) if g.kind == FULL), 0)
    if n == 1:
        return [(0, 1)]
    return [(f, f + 1), (f - 1, f + 1) if f > 0 else (0, 2)]


@contextlib.contextmanager
def _attention_mode(model: nn.Module, attention: str) -> Iterator[bool]:
    """Measure with the attention the plan is for: route the model's module through
    segback.engine.attention as the engine does (chunked, or fused where segback picks the
    kernel: CUDA); yields whether it is routed (then masks are descriptors)."""
    if attention != "chunked" and not fused_routed():
        yield False
        return
    layer = text_parts(model)[0].model.layers[0]
    with use_attention([sys.modules[type(layer).__module__]], attention):
        yield True


def _nonneg_lstsq(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with x >= 0 by trying every subset of free variables (3 unknowns)."""
    best, best_res = np.zeros(X.shape[1]), np.inf
    for k in range(1, X.shape[1] + 1):
        for cols in itertools.combinations(range(X.shape[1]), k):
            sol = np.linalg.lstsq(X[:, cols], y, rcond=None)[0]
            if np.any(sol <= 0):
                continue
            x = np.zeros(X.shape[1])
            x[list(cols)] = sol
            res = float(np.sum((X @ x - y) ** 2))
            if res < best_res:
                best, best_res = x, res
    return best


def fit_coefficients(model: nn.Module, geom: Geometry, batch_size: int = 1, lora_rank: int = 8,
                     attention: str = "fused", lengths: Sequence[int] = CALIBRATION_LENGTHS,
                     ) -> Coefficients:
    """Fit the three multipliers to a 1-layer and a 2-layer segment measured at two lengths.

    measured - h_out - dh_in = a * activations + r * kept scores + t * backward scores, one
    equation per (segment, length), solved by non-negative least squares: the lengths separate
    the linear from the quadratic terms, the segment sizes what each layer keeps from what only
    one layer's backward needs. A coefficient the data cannot see stays near its analytic 1.
    """
    segs = calibration_segments(geom)
    rows, ys, measured = [], [], []
    for a, b in segs:
        measured.append([])
        for L in lengths:
            cost = CostModel(geom, L, batch_size, attention)
            with _attention_mode(model, attention) as routed:
                m = measure_segment(model, a, b, L, batch_size, lora_rank, routed)
            measured[-1].append(m / GB)
            rows.append([cost.act[a:b].sum() + cost.bwd[a:b].max(),
                         cost.attn_retained[a:b].sum(), cost.attn_transient[a:b].max()])
            ys.append(m - 2 * cost.hidden_bytes)
    X, y = np.array(rows), np.array(ys)
    scale = X.max(axis=0)
    scale[scale == 0] = 1.0
    sol = _nonneg_lstsq(X / scale, y) / scale
    sol = np.where(X.max(axis=0) > 0, np.clip(sol, 0.05, 100.0), 1.0)
    return Coefficients(*map(float, sol), calibrated=True, lengths=list(lengths),
                        segments=[list(s) for s in segs], measured_gb=measured)
