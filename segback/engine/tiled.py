"""Sequence-tiled layers: one layer's transient memory is O(tile x width), not O(L x MLP width).

A decoder layer is token-wise except for its attention core. mlx-lm's own layer runs unchanged
on a tile of tokens [t0, t1) with a `TileCache` in place of its KV cache: the cache gives RoPE the
tile's position offset, and the attention call (routed here by `use_chunked_attention`) goes to
the cache, which either records the tile's queries and the layer's own keys/values (the *pre*
pass) or returns the tile's rows of an attention output computed over the whole sequence (the
*post* pass). Nothing of the layer's code is copied.

Backward of one layer: recompute Q, K, V (pre pass per tile) and O (chunked attention); VJP of
the post pass per tile (-> dh, dO, parameter grads, rowsum(dO * O)); chunked attention backward
over the whole sequence (-> dQ, dK, dV); VJP of the pre pass per tile (-> dh, parameter grads).
Alive at once: the layer's Q, K, V, dO and their gradients, [L, heads x head_dim] each, plus one
tile's activations; never an [L, MLP width] array. Tiles are queued with `mx.async_eval`, at
most two in flight (the GPU runs one tile while Python builds the next).

Boundaries (the hidden state entering each segment) and per-layer inputs can live in host memory
(`offload=True`): they are copied out once in the forward and back once in the backward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_unflatten

from segback.engine.attention import (
    MaskSpec,
    attention_backward,
    attention_forward,
    attention_shape,
)
from segback.models.stack import Stack

KV = tuple[mx.array, mx.array]


class TileCache:
    """Stands in for mlx-lm's KV cache while a layer runs on tokens [offset, offset + n)."""

    def __init__(self, offset: int, rows: mx.array | None = None):
        self.offset = offset
        self.rows = rows  # post pass: this tile's attention output [B, H, n, D]
        self.queries: mx.array | None = None
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.scale = 1.0

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> KV:
        self.keys, self.values = keys, values
        return keys, values

    def segback_attend(self, queries, keys, values, scale):
        if self.rows is not None:
            return self.rows
        self.queries, self.scale = queries, scale
        B, H, n, _ = queries.shape
        return mx.zeros((B, H, n, values.shape[-1]), queries.dtype)  # never evaluated


def _queue(prev: Any, *arrays: Any) -> tuple:
    """Queue this tile's arrays, then wait for the previous tile's: the GPU runs tile t while
    Python builds tile t + 1, and at most two tiles' buffers exist at once."""
    mx.async_eval(*arrays)
    if prev is not None:
        mx.eval(*prev)
    return arrays


def tiles(length: int, tile: int) -> list[tuple[int, int]]:
    """Token ranges of at most `tile` tokens covering [0, length)."""
    if tile < 1:
        raise ValueError(f"tile must be >= 1 token, not {tile}")
    return [(t0, min(t0 + tile, length)) for t0 in range(0, length, tile)]


@dataclass
class HostStore:
    """Arrays parked in host memory (offload) or kept on the device; counts host bytes."""

    offload: bool
    host_bytes: int = 0
    peak_host_bytes: int = 0
    _sizes: dict[int, int] = field(default_factory=dict)

    def put(self, x: mx.array) -> Any:
        if not self.offload:
            return x
        mx.eval(x)
        dtype = x.dtype
        raw = np.array(x.view(mx.uint16) if dtype == mx.bfloat16 else x)
        self.host_bytes += raw.nbytes
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
        return raw, dtype

    def get(self, handle: Any) -> mx.array:
        if not self.offload:
            return handle
        raw, dtype = handle
        x = mx.array(raw)
        return x.view(mx.bfloat16) if dtype == mx.bfloat16 else x

    def drop(self, handle: Any) -> None:
        if self.offload and handle is not None:
            self.host_bytes -= handle[0].nbytes


@dataclass
class LayerCall:
    """Everything fixed about one layer's call in this step."""

    stack: Stack
    index: int
    mask: MaskSpec
    tile: int
    seed: int
    per_layer: mx.array | None = None  # [B, L, P] this layer's per-layer input
    shared: KV | None = None  # donor K/V this layer reads (Gemma-4 KV sharing)

    @property
    def owns_kv(self) -> bool:
        return self.shared is None

    def run(self, h_t: mx.array, t: int, t0: int, t1: int, cache: TileCache, part: int,
            pli_t: mx.array | None = None) -> mx.array:
        """mlx-lm's layer on one tile, with this tile's dropout stream (replayed on recompute)."""
        mx.random.seed(self.seed + 4 * t + part)
        if pli_t is None and self.per_layer is not None:
            pli_t = self.per_layer[:, t0:t1]
        out, _ = self.stack.layer(self.index, h_t, self.mask, pli_t, self.shared, cache)
        return out

    def attention(self, B: int, H: int, L: int) -> tuple[int | None, int]:
        window = self.mask.window if self.mask.kind == "sliding" else None
        return attention_shape(B, H, L, L, window)


def _pre(call: LayerCall, h: mx.array, spans) -> tuple[mx.array, mx.array, mx.array, float]:
    """Q (and own K, V) over the whole sequence, one tile at a time."""
    qs, ks, vs = [], [], []
    scale = 1.0
    prev = None
    for t, (t0, t1) in enumerate(spans):
        cache = TileCache(t0)
        call.run(h[:, t0:t1], t, t0, t1, cache, 0)
        parts = [cache.queries] + ([cache.keys, cache.values] if call.owns_kv else [])
        prev = _queue(prev, parts)
        qs.append(cache.queries)
        scale = cache.scale
        if call.owns_kv:
            ks.append(cache.keys)
            vs.append(cache.values)
    q = _cat(qs, 2)
    k, v = (_cat(ks, 2), _cat(vs, 2)) if call.owns_kv else call.shared
    return q, k, v, scale


def _cat(parts: list[mx.array], axis: int) -> mx.array:
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=axis)


def layer_forward(call: LayerCall, h: mx.array) -> tuple[mx.array, KV | None]:
    """The layer's output for all L tokens (and its own K/V), computed tile by tile."""
    B, L, _ = h.shape
    spans = tiles(L, call.tile)
    q, k, v, scale = _pre(call, h, spans)
    window, chunk = call.attention(B, q.shape[1], L)
    o = attention_forward(q, k, v, scale, window, chunk)
    mx.async_eval(o)
    del q
    outs = []
    prev = None
    for t, (t0, t1) in enumerate(spans):
        out = call.run(h[:, t0:t1], t, t0, t1, TileCache(t0, o[:, :, t0:t1]), 1)
        prev = _queue(prev, out)
        outs.append(out)
    out = _cat(outs, 1)
    mx.eval(out)
    return out, ((k, v) if call.owns_kv else None)


def layer_vjp(
    call: LayerCall,
    h: mx.array,
    dh_out: mx.array,
    params: list[mx.array],
    bind: Callable[[list[mx.array]], None],
    d_own_kv: list[mx.array] | None = None,
    want_per_layer: bool = False,
) -> tuple[mx.array, mx.array | None, KV | None, list[mx.array]]:
    """Backward of one layer, tile by tile.

    Returns (dh_in, d per-layer input, (dK, dV) for the donor this layer reads, parameter grads).
    `d_own_kv` is the cotangent of this layer's own K/V from the layers that share it.
    """
    B, L, _ = h.shape
    spans = tiles(L, call.tile)
    q, k, v, scale = _pre(call, h, spans)
    window, chunk = call.attention(B, q.shape[1], L)
    o = attention_forward(q, k, v, scale, window, chunk)
    mx.async_eval(o)

    grads = [mx.zeros_like(p) for p in params]
    dhs, dos, deltas, dplis = [], [], [], []
    with_pli = want_per_layer and call.per_layer is not None
    prev = None
    for t, (t0, t1) in enumerate(spans):
        def post(h_t, o_t, *rest, t=t, t0=t0, t1=t1):
            pli_t = rest[0] if with_pli else None
            bind(list(rest[1:] if with_pli else rest))
            return [call.run(h_t, t, t0, t1, TileCache(t0, o_t), 1, pli_t)]

        o_t = o[:, :, t0:t1]
        primals = [h[:, t0:t1], o_t] + ([call.per_layer[:, t0:t1]] if with_pli else []) + params
        _, (dh_t, do_t, *rest) = mx.vjp(post, primals, [dh_out[:, t0:t1]])
        if with_pli:
            dplis.append(rest.pop(0))
        grads = [g + d for g, d in zip(grads, rest)]
        delta = (do_t.astype(mx.float32) * o_t.astype(mx.float32)).sum(-1, keepdims=True)
        prev = _queue(prev, dh_t, do_t, delta, grads, dplis)
        dhs.append(dh_t)
        dos.append(do_t)
        deltas.append(delta)
    del o
    dq, dk, dv = attention_backward(
        q, k, v, None, _cat(dos, 2), scale, window, chunk, delta=_cat(deltas, 2)
    )
    del dos, deltas
    d_shared = None
    if call.owns_kv and d_own_kv is not None:
        dk, dv = dk + d_own_kv[0], dv + d_own_kv[1]
    elif not call.owns_kv:
        d_shared = (dk, dv)
    mx.async_eval(dq, dk, dv)
    prev = None

    for t, (t0, t1) in enumerate(spans):
        def pre(h_t, *leaves, t=t, t0=t0, t1=t1):
            bind(list(leaves))
            cache = TileCache(t0)
            call.run(h_t, t, t0, t1, cache, 0)
            return [cache.queries] + ([cache.keys, cache.values] if call.owns_kv else [])

        cot = [dq[:, :, t0:t1]] + ([dk[:, :, t0:t1], dv[:, :, t0:t1]] if call.owns_kv else [])
        _, (dh_t, *rest) = mx.vjp(pre, [h[:, t0:t1], *params], cot)
        grads = [g + d for g, d in zip(grads, rest)]
        dhs[t] = dhs[t] + dh_t
        prev = _queue(prev, dhs[t], grads)
    dpli = _cat(dplis, 1) if with_pli else None
    return _cat(dhs, 1), dpli, d_shared, grads


def bind_layer(layer, keys: list[str]) -> Callable[[list[mx.array]], None]:
    """Put (traced) values of a layer's trainable leaves into the layer."""
    def bind(leaves: list[mx.array]) -> None:
        if keys:
            layer.update(tree_unflatten(list(zip(keys, leaves))), strict=False)
    return bind
