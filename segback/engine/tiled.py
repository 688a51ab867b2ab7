"""Sequence-tiled layers: one layer's transient memory is O(tile x width), not O(L x MLP width).

A decoder layer is token-wise except for its attention core. mlx-lm's own layer runs unchanged
on a tile of tokens [t0, t1) with a `TileCache` in place of its KV cache: the cache gives RoPE the
tile's position offset, and the attention call (routed here by `use_attention`) goes to
the cache, which either records the tile's queries and the layer's own keys/values (the *pre*
pass) or returns the tile's rows of an attention output computed over the whole sequence (the
*post* pass). Nothing of the layer's code is copied.

Backward of one layer: recompute Q, K, V (pre pass per tile) and O (chunked attention); VJP of
the post pass per tile (-> dh, dO, parameter grads, rowsum(dO * O)); chunked attention backward
over the whole sequence (-> dQ, dK, dV); VJP of the pre pass per tile (-> dh, parameter grads).
Alive at once: the layer's Q, K, V, dO and their gradients, [L, heads x head_dim] each, plus one
tile's activations; never an [L, MLP width] array. dO, rowsum(dO * O), dQ and the post pass's
dh stay in the tiles or chunks they were computed in (`attention.Rows`): a concatenated copy
beside them would be one more whole-sequence array at the layer's peak.

Two tile sizes: `tile` for the post pass's VJP, the one pass that holds MLP activations and
their cotangents, and `light_tile` (default: `tile`) for the passes that hold no MLP cotangents:
the pre pass, its VJP and the forward post pass. Fewer, larger tiles there cut the per-tile cost
(graph build and kernel launches) where memory allows.

Boundaries (the hidden state entering each segment) and per-layer inputs can live in host memory
(`offload=True`, `segback.engine.offload`): copied out once in the forward (on a worker
thread, while the device computes) and back once in the backward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import weakref

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from segback.engine.masks import MaskSpec
from segback.engine.chunked import Rows
from segback.engine.attention import core_backward, core_forward
from segback.engine.ring_attention import RingMask
from segback.engine.stack import Stack, binder, has_dropout

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


def tiles(length: int, tile: int) -> list[tuple[int, int]]:
    """Token ranges of at most `tile` tokens covering [0, length)."""
    if tile < 1:
        raise ValueError(f"tile must be >= 1 token, not {tile}")
    return [(t0, min(t0 + tile, length)) for t0 in range(0, length, tile)]


class TileFns:
    """The four tile functions of a layer, pure in their array inputs (so `mx.compile` can trace
    each once per tile shape and replay it for every tile and every step).

    Inputs are the tile's hidden rows, its RoPE offset (an array, so all tiles share a trace),
    the attention rows or cotangents, the per-layer input, the donor K/V (sharers), the layer's
    trainable leaves and (shared traces) its frozen ones. Shared (`share_traces`, compiled
    only), one TileFns serves every layer of the same structure (`structure`): it runs its
    template layer (`index`) with the calling layer's weights bound in, so 42 e4b layers trace 3
    kinds, not 42. Otherwise frozen weights are read from the layer itself (constants of a
    trace) and each layer has its own.
    """

    def __init__(self, stack: Stack, index: int, mask: MaskSpec, keys: list[str],
                 owns_kv: bool, has_pli: bool, pli_grad: bool, compile: bool,
                 frozen_keys: list[str] | None = None):
        self.stack, self.index, self.mask, self.keys = stack, index, mask, keys
        self.owns_kv, self.has_pli, self.pli_grad = owns_kv, has_pli, pli_grad
        self.frozen_keys = list(frozen_keys or [])
        self.n_leaves = len(keys)
        self.bind = binder(stack.layers[index], keys + self.frozen_keys)
        self.scale: float | None = None
        self.compiled = compile
        self._saved: list[mx.array] | None = None  # the template's own weights while tracing
        wrap = self._compiled if compile else (lambda f: f)
        self.pre = wrap(self._pre)
        self.post = wrap(self._post)
        self.post_vjp = wrap(self._post_vjp)
        self.pre_vjp = wrap(self._pre_vjp)

    def _compiled(self, fn: Callable) -> Callable:
        """`mx.compile(fn)`, putting the template's own weights back after a call that traced:
        tracing binds placeholders into the layer, which nothing else may see."""
        traced = mx.compile(fn)

        def call(*args):
            out = traced(*args)
            if self._saved is not None:
                self.bind(self._saved)
                self._saved = None
            return out

        return call

    def _run(self, h_t, offset, rows, pli_t, shared, leaves) -> tuple[mx.array, TileCache]:
        if self.compiled and self._saved is None:  # tracing: remember the real weights
            flat = dict(tree_flatten(self.stack.layers[self.index].parameters()))
            self._saved = [flat[k] for k in self.keys + self.frozen_keys]
        self.bind(list(leaves))
        cache = TileCache(offset, rows)
        out, _ = self.stack.layer(self.index, h_t, self.mask, pli_t, shared, cache)
        if rows is None:
            self.scale = cache.scale  # a Python float of the layer, seen while tracing
        return out, cache

    def _split(self, rest):
        """(per-layer input, shared K/V, trainable leaves, frozen leaves) from the trailing
        inputs."""
        rest = list(rest)
        pli = rest.pop(0) if self.has_pli else None
        shared = None if self.owns_kv else (rest.pop(0), rest.pop(0))
        return pli, shared, rest[:self.n_leaves], rest[self.n_leaves:]

    def _pre(self, h_t, offset, *rest):
        """Queries (and own keys, values) of one tile: [B, H, n, D]."""
        _, shared, leaves, frozen = self._split(rest)
        _, c = self._run(h_t, offset, None, None, shared, leaves + frozen)
        return [c.queries] + ([c.keys, c.values] if self.owns_kv else [])

    def _post(self, h_t, offset, o_t, *rest):
        """The layer's output on one tile, given the tile's attention rows."""
        pli, shared, leaves, frozen = self._split(rest)
        return self._run(h_t, offset, o_t, pli, shared, leaves + frozen)[0]

    def _post_vjp(self, h_t, offset, o_t, dh_t, *rest):
        """(dh, dO, [d per-layer input], *leaf grads) of the post pass on one tile."""
        pli, shared, leaves, frozen = self._split(rest)
        with_pli = self.pli_grad and pli is not None

        def f(h, o, *xs):
            p, lv = (xs[0], xs[1:]) if with_pli else (pli, xs)
            return [self._run(h, offset, o, p, shared, list(lv) + frozen)[0]]

        primals = [h_t, o_t] + ([pli] if with_pli else []) + list(leaves)
        return mx.vjp(f, primals, [dh_t])[1]

    def _pre_vjp(self, h_t, offset, dq, *rest):
        """(dh, *leaf grads) of the pre pass on one tile; own dK, dV lead `rest`."""
        rest = list(rest)
        cot = [dq] + ([rest.pop(0), rest.pop(0)] if self.owns_kv else [])
        _, shared, leaves, frozen = self._split(rest)

        def f(h, *lv):
            _, c = self._run(h, offset, None, None, shared, list(lv) + frozen)
            return [c.queries] + ([c.keys, c.values] if self.owns_kv else [])

        return mx.vjp(f, [h_t, *leaves], cot)[1]


def structure(layer: nn.Module) -> tuple:
    """What a compiled trace of `layer` depends on besides its inputs: module types, their
    scalar settings (not the layer's index, which only names it) and every weight's key, shape
    and dtype. Layers equal in this share their compiled tile functions."""
    parts = []
    for path, m in layer.named_modules():
        scalars = tuple(sorted((k, v) for k, v in vars(m).items()
                               if isinstance(v, (bool, int, float, str)) and k != "layer_idx"))
        arrays = tuple(sorted((k, tuple(v.shape), str(v.dtype), float(v.astype(mx.float32).sum()))
                              for k, v in vars(m).items()
                              if isinstance(v, mx.array) and k.startswith("_")))
        parts.append((path, type(m).__name__, scalars, arrays))
    weights = tuple((k, tuple(v.shape), str(v.dtype))
                    for k, v in tree_flatten(layer.parameters()))
    return tuple(parts), weights


# Tile functions per layer module (by id; modules are dicts, so unhashable), kept across steps
# so compiled traces are reused; an entry whose module is gone is replaced.
_FNS: dict[int, tuple[weakref.ref, dict]] = {}


def _fns_of(layer: nn.Module) -> dict:
    ref, fns = _FNS.get(id(layer), (None, None))
    if ref is None or ref() is not layer:
        ref, fns = weakref.ref(layer), {}
        _FNS[id(layer)] = (ref, fns)
    return fns


# Compiled tile functions shared by layers of one structure: (LayerCall key, structure) -> them.
_SHARED: dict[tuple, TileFns] = {}


def _shared_fns(call: LayerCall, key: tuple, layer: nn.Module) -> TileFns:
    skey = (key, structure(layer))
    if skey not in _SHARED:
        trainable = set(call.keys)
        frozen = [k for k, _ in tree_flatten(layer.parameters()) if k not in trainable]
        _SHARED[skey] = TileFns(call.stack, call.index, call.mask, call.keys, call.owns_kv,
                                call.per_layer is not None, call.pli_grad, True, frozen)
    return _SHARED[skey]


@dataclass
class LayerCall:
    """One layer's call in this step: its static tile functions and this step's inputs."""

    stack: Stack
    index: int
    mask: MaskSpec
    tile: int
    keys: list[str]
    per_layer: mx.array | None = None  # [B, L, P] this layer's per-layer input
    shared: KV | None = None  # donor K/V this layer reads (Gemma-4 KV sharing)
    pli_grad: bool = False
    compile: bool = True
    seed: int = 0
    light_tile: int | None = None  # tile of the pre pass, its VJP and the forward post pass
    share_traces: bool = False  # compiled: layers of one structure share their tile functions
    in_flight: int = 2  # tiles scheduled before waiting for the previous one
    # Whether the layer draws dropout masks (compiled traces would replay fixed draws, so such a
    # layer runs eager); None: look. The engine looks once a step: a look walks the layer's
    # modules, which costs more host time than a tile's graph on a GPU.
    dropout: bool | None = None
    kind: str = "chunked"  # the attention engine option: "fused" or "chunked"
    # (local start, local stop, global start) of each contiguous run of positions: a context-
    # parallel shard's (`ring_attention.Shards.runs`); None: one run from 0
    runs: tuple[tuple[int, int, int], ...] | None = None

    def reseed(self, t: int, part: int) -> None:
        """Dropout stream of tile t's pre (0) or post (1) pass, the same in forward and VJP."""
        mx.random.seed(self.seed + 2 * t + part)

    def __post_init__(self):
        layer = self.stack.layers[self.index]
        self.deterministic = not (has_dropout(layer) if self.dropout is None else self.dropout)
        compile = self.compile and self.deterministic
        key = (tuple(self.keys), self.owns_kv, self.per_layer is not None, self.pli_grad,
               self.mask, compile, compile and self.share_traces)
        per_module = _fns_of(layer)
        if key not in per_module:
            per_module[key] = _shared_fns(self, key, layer) if compile and self.share_traces \
                else TileFns(self.stack, self.index, self.mask, self.keys, self.owns_kv,
                             self.per_layer is not None, self.pli_grad, compile)
        self.fns: TileFns = per_module[key]
        if self.fns.frozen_keys:
            flat = dict(tree_flatten(layer.parameters()))
            self.frozen = [flat[k] for k in self.fns.frozen_keys]
        else:
            self.frozen = []

    @property
    def owns_kv(self) -> bool:
        return self.shared is None

    @property
    def light(self) -> int:
        return self.light_tile or self.tile

    @property
    def post_tile(self) -> int:
        """The forward post pass's tile: the light one, unless LoRA dropout needs the post
        VJP's tiles (each tile draws its own mask, the same in the forward and the VJP)."""
        return self.light if self.deterministic else self.tile

    def spans(self, length: int, size: int) -> list[tuple[int, int]]:
        """Tiles of at most `size` tokens covering [0, length), none across two runs (so each
        tile's positions are its offset onwards)."""
        if self.runs is None:
            return tiles(length, size)
        return [(a + t0, a + t1) for a, b, _ in self.runs for t0, t1 in tiles(b - a, size)]

    def offset(self, t0: int) -> mx.array:
        """The position of the tile starting at local row `t0` (RoPE's offset)."""
        if self.runs is not None:
            a, _, start = next(r for r in self.runs if r[0] <= t0 < r[1])
            t0 = start + t0 - a
        return mx.array(t0, mx.int32)

    def extras(self, t0: int, t1: int) -> list[mx.array]:
        """The per-layer input rows and donor K/V, in TileFns' order."""
        out = [] if self.per_layer is None else [self.per_layer[:, t0:t1]]
        return out + ([] if self.shared is None else list(self.shared))



class InFlight:
    """At most `depth` tiles in flight.

    A blocking eval per tile leaves the GPU idle while the host builds the next tile's graph;
    two in flight hide that, for one more tile of transients.
    """

    def __init__(self, depth: int):
        self.depth = depth
        self.prev: tuple | None = None

    def push(self, *arrays) -> None:
        if self.depth < 2:
            mx.eval(*arrays)
            return
        mx.async_eval(*arrays)
        self.drain()
        self.prev = arrays

    def drain(self) -> None:
        if self.prev is not None:
            mx.eval(*self.prev)
            self.prev = None


def attention_forward(call: LayerCall, q: mx.array, k: mx.array, v: mx.array, scale: float
                      ) -> tuple[mx.array, object]:
    """The layer's attention output over the whole sequence (over the ring, for a
    `RingMask`), and what `attention_backward` needs of it."""
    if isinstance(call.mask, RingMask):
        return call.mask.forward(q, k, v, scale)
    return core_forward(q, k, v, scale, call.mask, call.kind)


def attention_backward(call: LayerCall, q: mx.array, k: mx.array, v: mx.array, saved: object,
                       d_out: Rows, delta: Rows, scale: float
                       ) -> tuple[Rows, mx.array, mx.array]:
    """(dQ as `Rows`, dK, dV) of `attention_forward`."""
    if isinstance(call.mask, RingMask):
        L = q.shape[2]
        dq, dk, dv = call.mask.backward(q, k, v, saved, d_out(0, L), delta(0, L), scale)
        return Rows([dq]), dk, dv
    return core_backward(q, k, v, saved, d_out, delta, scale, call.mask)


def _pre(call: LayerCall, h: mx.array, spans, leaves) -> tuple[mx.array, mx.array, mx.array]:
    """Q (and own K, V) over the whole sequence, one tile at a time."""
    qs, ks, vs = [], [], []
    flight = InFlight(call.in_flight)
    for t, (t0, t1) in enumerate(spans):
        call.reseed(t, 0)
        parts = call.fns.pre(h[:, t0:t1], call.offset(t0), *call.extras(t0, t1), *leaves,
                             *call.frozen)
        flight.push(parts)
        qs.append(parts[0])
        if call.owns_kv:
            ks.append(parts[1])
            vs.append(parts[2])
    flight.drain()
    q = _cat(qs, 2)
    k, v = (_cat(ks, 2), _cat(vs, 2)) if call.owns_kv else call.shared
    return q, k, v


def _cat(parts: list[mx.array], axis: int) -> mx.array:
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=axis)


def layer_forward(call: LayerCall, h: mx.array, leaves: list[mx.array]
                  ) -> tuple[mx.array, KV | None]:
    """The layer's output for all L tokens (and its own K/V), computed tile by tile."""
    B, L, _ = h.shape
    q, k, v = _pre(call, h, call.spans(L, call.light), leaves)
    o, _ = attention_forward(call, q, k, v, call.fns.scale)
    mx.eval(o)
    del q
    outs = []
    flight = InFlight(call.in_flight)
    for t, (t0, t1) in enumerate(call.spans(L, call.post_tile)):
        call.reseed(t, 1)
        out = call.fns.post(h[:, t0:t1], call.offset(t0), o[:, :, t0:t1], *call.extras(t0, t1),
                            *leaves, *call.frozen)
        flight.push(out)
        outs.append(out)
    flight.drain()
    return _cat(outs, 1), ((k, v) if call.owns_kv else None)


def layer_vjp(
    call: LayerCall,
    h: mx.array,
    dh_out: mx.array,
    params: list[mx.array],
    d_own_kv: list[mx.array] | None = None,
) -> tuple[mx.array, mx.array | None, KV | None, list[mx.array]]:
    """Backward of one layer, tile by tile.

    Returns (dh_in, d per-layer input, (dK, dV) for the donor this layer reads, parameter grads).
    `d_own_kv` is the cotangent of this layer's own K/V from the layers that share it.
    """
    B, L, _ = h.shape
    spans, light = call.spans(L, call.tile), call.spans(L, call.light)
    q, k, v = _pre(call, h, light, params)
    scale = call.fns.scale
    o, saved = attention_forward(call, q, k, v, scale)
    mx.eval(o, saved if isinstance(saved, mx.array) else [])

    grads = [mx.zeros_like(p) for p in params]
    dhs, dos, deltas, dplis = [], [], [], []
    with_pli = call.pli_grad and call.per_layer is not None
    flight = InFlight(call.in_flight)
    for t, (t0, t1) in enumerate(spans):
        o_t = o[:, :, t0:t1]
        call.reseed(t, 1)
        dh_t, do_t, *rest = call.fns.post_vjp(
            h[:, t0:t1], call.offset(t0), o_t, dh_out[:, t0:t1], *call.extras(t0, t1), *params,
            *call.frozen
        )
        if with_pli:
            dplis.append(rest.pop(0))
        grads = [g + d for g, d in zip(grads, rest)]
        delta = (do_t.astype(mx.float32) * o_t.astype(mx.float32)).sum(-1, keepdims=True)
        flight.push(dh_t, do_t, delta, grads, dplis[-1:])
        dhs.append(dh_t)
        dos.append(do_t)
        deltas.append(delta)
    flight.drain()
    del o, o_t  # the last tile's slice would keep all of O's buffer alive
    # dO, rowsum(dO * O) and dQ stay in their pieces: a concatenated copy beside them would be
    # one more [L, heads x head_dim] array at the layer's peak.
    dq, dk, dv = attention_backward(call, q, k, v, saved, Rows(dos), Rows(deltas), scale)
    del dos, deltas, q, k, v, saved
    d_shared = None
    if call.owns_kv and d_own_kv is not None:
        dk, dv = dk + d_own_kv[0], dv + d_own_kv[1]
    elif not call.owns_kv:
        d_shared = (dk, dv)
    mx.eval(dq.pieces, dk, dv)

    dh_post = Rows(dhs, axis=1)
    del dhs
    dh_in = []
    for t, (t0, t1) in enumerate(light):
        own = [dk[:, :, t0:t1], dv[:, :, t0:t1]] if call.owns_kv else []
        call.reseed(t, 0)
        dh_t, *rest = call.fns.pre_vjp(
            h[:, t0:t1], call.offset(t0), dq(t0, t1), *own, *call.extras(t0, t1), *params,
            *call.frozen
        )
        grads = [g + d for g, d in zip(grads, rest)]
        dh_in.append(dh_post(t0, t1) + dh_t)
        dh_post.release(t1)  # as the tiles are read, their pieces go: dh is held once, not twice
        dq.release(t1)
        flight.push(dh_in[-1], grads)
    flight.drain()
    del dq, dk, dv, dh_post
    dpli = _cat(dplis, 1) if with_pli else None
    return _cat(dh_in, 1), dpli, d_shared, grads


