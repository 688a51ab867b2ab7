"""Ring attention: one sequence's attention across the ranks of a context-parallel group, exact.

Each rank holds the queries, keys and values of its shard of the sequence (`Shards`: contiguous,
or zig-zag, which gives every rank an early and a late piece so causal work is balanced). The
key/value blocks travel around the ring (`mx.distributed` send/recv to the next rank, from the
previous one); every rank attends its queries to each block as it passes and merges the partial
results with their log-sum-exp (flash-attention style), so no rank ever holds more than two
blocks, and no [L, L] array exists.

- Forward: R steps; step s attends to the block of rank (r - s) mod R, while the next block is
  already on its way. Each chunk of queries scores only the keys of the block it may see (a
  range: positions are sorted), so a zig-zag shard's causal work is its share of the pairs;
  blocks no query of a chunk sees are skipped, and only their transfer is paid. Saves O and
  the row LSE.
- Backward: recomputes each block's probabilities from the saved LSE (nothing of the forward's
  scores is kept); the block's dK/dV accumulators travel with it around the ring, each rank adds
  its queries' share, and one last hop brings them home to the block's owner.
- Exchanges in one step are packed into one message, and every rank issues them in one order:
  each ring attention's exchanges start after its inputs (queries, or the output cotangent) and
  everything after it waits for all of them, including blocks no query of the rank sees. Ranks
  build different graphs (their skipped blocks differ), so without this two attentions'
  messages could interleave differently on two ranks (a Gemma-4 sharer's K/V depend on nothing
  of the layers before it) and pair up wrongly.
- Masks are built from global positions: causal, or sliding over `window` keys as mlx-lm's
  `create_causal_mask(window_size=...)`. Shards of unequal length (L not divisible by R) are
  padded for the exchange with keys no query sees.

Arithmetic is float32 (softmax, LSE, accumulators), as the chunked attention's. Keys and values
travel in their own dtype (casting them is exact), dK/dV in float32.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import Any, Literal

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from segback.engine.chunked import default_chunk_size
from segback.engine.attention import sdpa_for_mlx_lm, swap_attention

ORDERS = ("zigzag", "contiguous")
_PAD = 1 << 40  # the position of a padding key: after every query, so never visible


class RingError(ValueError):
    """A context-parallel layout that cannot run (too short a sequence, a bad order)."""


@dataclass(frozen=True)
class Shards:
    """Which global positions (of L) each of R ranks holds, in the order it holds them. Equal
    (and hashed) by how they were made: `shard_positions(length, size, order)`."""

    length: int
    order: str
    positions: tuple[np.ndarray, ...] = field(compare=False)

    @property
    def size(self) -> int:
        return len(self.positions)

    @property
    def padded(self) -> int:
        """The exchanged block length: the longest shard."""
        return max(len(p) for p in self.positions)

    def runs(self, rank: int) -> list[tuple[int, int, int]]:
        """(local start, local stop, global start) of each contiguous run of rank's shard."""
        pos = self.positions[rank]
        cuts = np.flatnonzero(np.diff(pos) != 1) + 1
        starts = np.concatenate([[0], cuts])
        stops = np.concatenate([cuts, [len(pos)]])
        return [(int(a), int(b), int(pos[a])) for a, b in zip(starts, stops)]

    def pieces(self, rank: int) -> list[tuple[int, int]]:
        """Local (start, stop) of the pieces rank holds: its shard, or its two zig-zag pieces
        (contiguous runs, adjacent for the middle rank)."""
        n = len(self.positions[rank])
        if self.order == "contiguous":
            return [(0, n)]
        first = self.length // (2 * self.size) + (rank < self.length % (2 * self.size))
        return [(0, first), (first, n)]

    def chunks(self, rank: int, size: int) -> list[tuple[int, int]]:
        """Local (start, stop) of at most `size` queries, none across two pieces: a chunk's
        keys then are one range of every block (`_key_range`), never those of two runs, and
        the middle rank, whose pieces meet, chunks its diagonal block as finely as the others
        (causal work stays balanced)."""
        return [(a + c, min(a + c + size, b)) for a, b in self.pieces(rank)
                for c in range(0, b - a, size)]

    def key_positions(self, rank: int) -> np.ndarray:
        """Rank's key positions padded to `padded` with never-visible ones."""
        pos = self.positions[rank]
        return np.concatenate([pos, np.full(self.padded - len(pos), _PAD, np.int64)])


def shard_positions(length: int, ranks: int, order: str = "zigzag") -> Shards:
    """Split positions [0, length) over `ranks`: contiguous pieces, or zig-zag (rank r holds
    pieces r and 2R-1-r of 2R), pieces as equal as `np.array_split` makes them."""
    if order not in ORDERS:
        raise RingError(f"context-parallel order must be one of {ORDERS}, not {order!r}")
    pieces = ranks if order == "contiguous" else 2 * ranks
    if length < pieces:
        raise RingError(
            f"a sequence of {length} tokens cannot be split into {pieces} non-empty "
            f"{'shards' if order == 'contiguous' else 'zig-zag pieces (2 per rank)'} for "
            f"{ranks} context ranks: use fewer context ranks or longer sequences")
    parts = np.array_split(np.arange(length, dtype=np.int64), pieces)
    if order == "contiguous":
        return Shards(length, order, tuple(parts))
    return Shards(length, order, tuple(np.concatenate([parts[r], parts[pieces - 1 - r]])
                                       for r in range(ranks)))


@dataclass(frozen=True)
class Ring:
    """This rank's place in its context-parallel group: `rank` of `size`, and the global ranks
    (in `group`) of the previous and next member, whom it receives from and sends to."""

    group: Any
    rank: int
    size: int
    prev: int
    next: int
    order: str = "zigzag"
    stream: Any = field(default=None, compare=False)  # the exchanges' stream (overlap)

    def shards(self, length: int) -> Shards:
        return shard_positions(length, self.size, self.order)

    def rotate(self, x: mx.array) -> mx.array:
        """x sent to the next rank; the previous rank's x received. Odd ranks receive first,
        so a ring of blocking sends always has a receiver ready."""
        kw = {"group": self.group, "stream": self.stream}
        if self.rank % 2:
            y = mx.distributed.recv_like(x, self.prev, **kw)
            sent = mx.distributed.send(mx.depends(x, y), self.next, **kw)
        else:
            sent = mx.distributed.send(x, self.next, **kw)
            y = mx.distributed.recv_like(mx.depends(x, sent), self.prev, **kw)
        return mx.depends(y, sent)


def _key_range(qpos: np.ndarray, kpos: np.ndarray, window: int | None
               ) -> tuple[str, int, int]:
    """('none', 'all' or 'some', k0, k1): the keys kpos[k0:k1] are the only ones queries `qpos`
    may see (causal, within the window), and whether none, all or some (query, key) pairs of
    that range are visible. Both are sorted (a shard's positions are; pads come last)."""
    k1 = int(np.searchsorted(kpos, qpos[-1], side="right"))  # keys <= the last query
    k0 = 0 if window is None else int(np.searchsorted(kpos, qpos[0] - window + 1))
    if k1 <= k0:
        return "none", 0, 0
    keys = kpos[k0:k1]
    if window is not None:
        # the latest key at or before each query: some pair is visible iff one is in the window
        j = np.searchsorted(keys, qpos, side="right") - 1
        ok = j >= 0
        if not np.any(qpos[ok] - keys[j[ok]] < window):
            return "none", 0, 0
    every = keys[-1] <= qpos[0] and (window is None or qpos[-1] - keys[0] < window)
    return ("all" if every else "some"), k0, k1


def _mask(qpos: np.ndarray, kpos: np.ndarray, window: int | None) -> mx.array:
    """Boolean [c, nk]: key visible to query (causal, within the window)."""
    q = mx.array(qpos)[:, None]
    k = mx.array(kpos)[None]
    m = k <= q
    return m & (q - k < window) if window is not None else m


@dataclass(frozen=True)
class _Plan:
    """Static per-call work: query chunks, and per (step, chunk) which keys of the block in
    hand it may see and whether all of them show (`_key_range`)."""

    chunks: list[tuple[int, int]]
    owners: list[int]
    seen: dict[tuple[int, int], tuple[str, int, int]]

    @classmethod
    def make(cls, shards: Shards, ring: Ring, window: int | None, chunk: int) -> _Plan:
        chunks = shards.chunks(ring.rank, chunk)
        owners = [(ring.rank - s) % ring.size for s in range(ring.size)]
        qpos = shards.positions[ring.rank]
        keys = {o: shards.key_positions(o) for o in owners}
        seen = {(s, j): _key_range(qpos[a:b], keys[o], window)
                for s, o in enumerate(owners) for j, (a, b) in enumerate(chunks)}
        return cls(chunks, owners, seen)


def _block(k: mx.array, v: mx.array, length: int) -> mx.array:
    """[K | V] as they travel: in their own dtype (a float32 copy of the block in hand is made
    where it is attended), padded to the exchanged block length."""
    kv = mx.concatenate([k, v.astype(k.dtype)], axis=-1)
    pad = length - k.shape[2]
    return mx.pad(kv, [(0, 0), (0, 0), (0, pad), (0, 0)]) if pad else kv


def _add_keys(acc: mx.array, update: mx.array, start: int) -> mx.array:
    """acc[:, :, start:start + n] += update (a range of a block's keys)."""
    stop = start + update.shape[2]
    return mx.slice_update(acc, acc[:, :, start:stop] + update, mx.array([start]), (2,))


def _scores(qc: mx.array, kb: mx.array, scale: float) -> mx.array:
    """[B, Hkv, rep, c, nk] float32 scores; qc [B, Hkv, rep, c, D], kb [B, Hkv, nk, D]."""
    return (qc @ kb[:, :, None].swapaxes(-1, -2)) * scale


def ring_forward(q: mx.array, k: mx.array, v: mx.array, scale: float, window: int | None,
                 ring: Ring, shards: Shards, chunk: int) -> tuple[mx.array, mx.array]:
    """(O [B, H, n, D], LSE [B, H, n, 1] float32) of this rank's queries over the whole ring."""
    B, H, n, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[-1]
    rep = H // Hkv
    plan = _Plan.make(shards, ring, window, chunk)
    qpos = shards.positions[ring.rank]
    q5 = q.astype(mx.float32).reshape(B, Hkv, rep, n, D)
    kv = mx.depends(_block(k, v, shards.padded), q)  # the exchanges start after what came before
    lowest = mx.finfo(mx.float32).min
    m = [mx.full((B, Hkv, rep, b - a, 1), lowest) for a, b in plan.chunks]
    lsum = [mx.zeros((B, Hkv, rep, b - a, 1)) for a, b in plan.chunks]
    acc = [mx.zeros((B, Hkv, rep, b - a, Dv)) for a, b in plan.chunks]
    for s, owner in enumerate(plan.owners):
        following = ring.rotate(kv) if s + 1 < ring.size else None  # in flight meanwhile
        kpos = shards.key_positions(owner)
        kvf = kv.astype(mx.float32)
        for j, (a, b) in enumerate(plan.chunks):
            seen, k0, k1 = plan.seen[s, j]
            if seen == "none":
                continue
            kb, vb = kvf[:, :, k0:k1, :D], kvf[:, :, k0:k1, D:]
            sc = _scores(q5[:, :, :, a:b], kb, scale)
            if seen == "some":
                sc = mx.where(_mask(qpos[a:b], kpos[k0:k1], window), sc, -mx.inf)
            m_new = mx.maximum(m[j], sc.max(axis=-1, keepdims=True))
            p = mx.exp(sc - m_new)
            alpha = mx.exp(m[j] - m_new)
            lsum[j] = lsum[j] * alpha + p.sum(axis=-1, keepdims=True)
            acc[j] = acc[j] * alpha + p @ vb[:, :, None]
            m[j] = m_new
        if following is not None:
            kv = following
    out = mx.concatenate([x / lx for x, lx in zip(acc, lsum)], axis=3)
    lse = mx.concatenate([mx_ + mx.log(lx) for mx_, lx in zip(m, lsum)], axis=3)
    # every exchange runs, also of blocks no query here sees: the others wait for them
    out = mx.depends(out.reshape(B, H, n, Dv).astype(q.dtype), kv)
    return out, lse.reshape(B, H, n, 1)


def ring_backward(q: mx.array, k: mx.array, v: mx.array, lse: mx.array, d_out: mx.array,
                  delta: mx.array, scale: float, window: int | None, ring: Ring,
                  shards: Shards, chunk: int) -> tuple[mx.array, mx.array, mx.array]:
    """(dQ, dK, dV) of `ring_forward`, given rowsum(dO * O) `delta` [B, H, n, 1] (float32);
    dK and dV of every block come home to its owner."""
    B, H, n, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[-1]
    rep = H // Hkv
    plan = _Plan.make(shards, ring, window, chunk)
    qpos = shards.positions[ring.rank]
    f32 = mx.float32
    q5 = q.astype(f32).reshape(B, Hkv, rep, n, D)
    do5 = d_out.astype(f32).reshape(B, Hkv, rep, n, Dv)
    lse5 = lse.reshape(B, Hkv, rep, n, 1)
    delta = delta.astype(f32).reshape(B, Hkv, rep, n, 1)
    kv = mx.depends(_block(k, v, shards.padded), [d_out, lse])
    # [dK | dV] of the block in hand, accumulated along the ring (float32: it is summed on R
    # ranks, and rounding it on the way would be error that one process does not make)
    dkv = mx.zeros(kv.shape, f32)
    dq = [mx.zeros((B, Hkv, rep, b - a, D)) for a, b in plan.chunks]
    for s, owner in enumerate(plan.owners):
        # K/V leave after the last step's dK/dV did: one order of messages on every rank
        following = ring.rotate(mx.depends(kv, dkv)) if s + 1 < ring.size else None
        kpos = shards.key_positions(owner)
        kvf = kv.astype(f32)
        for j, (a, b) in enumerate(plan.chunks):
            seen, k0, k1 = plan.seen[s, j]
            if seen == "none":
                continue
            kb, vb = kvf[:, :, k0:k1, :D], kvf[:, :, k0:k1, D:]
            qc, doc = q5[:, :, :, a:b], do5[:, :, :, a:b]
            sc = _scores(qc, kb, scale)
            if seen == "some":
                sc = mx.where(_mask(qpos[a:b], kpos[k0:k1], window), sc, -mx.inf)
            p = mx.exp(sc - lse5[:, :, :, a:b])
            dv = (p.swapaxes(-1, -2) @ doc).sum(axis=2)
            dp = doc @ vb[:, :, None].swapaxes(-1, -2)
            ds = p * (dp - delta[:, :, :, a:b]) * scale
            dq[j] = dq[j] + ds @ kb[:, :, None]
            dk = (ds.swapaxes(-1, -2) @ qc).sum(axis=2)
            dkv = _add_keys(dkv, mx.concatenate([dk, dv], axis=-1), k0)
        # dK/dV go on to the next rank after this step's K/V left
        dkv = ring.rotate(dkv if following is None else mx.depends(dkv, following))
        if following is not None:
            kv = following
    dq_all = mx.concatenate(dq, axis=3).reshape(B, H, n, D).astype(q.dtype)
    dq_all = mx.depends(dq_all, dkv)  # what comes after waits for every exchange
    dkv = dkv[:, :, :n]
    return dq_all, dkv[..., :D].astype(k.dtype), dkv[..., D:].astype(v.dtype)


def ring_sdpa(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: RingMask
              ) -> mx.array:
    """Attention of this rank's queries over the whole sequence's keys, with its VJP.

    q [B, H, n, D], k/v [B, Hkv, n, D]: this rank's shard (positions
    `mask.shards.positions[mask.ring.rank]`).
    """

    @mx.custom_function
    def attend(q, k, v):
        return mask.forward(q, k, v, scale)

    @attend.vjp
    def attend_vjp(primals, cotangents, outputs):
        out, lse = outputs
        d_out = cotangents[0]
        delta = (d_out.astype(mx.float32) * out.astype(mx.float32)).sum(-1, keepdims=True)
        return mask.backward(*primals, lse, d_out, delta, scale)

    return attend(q, k, v)[0]


@dataclass(frozen=True)
class RingMask:
    """A layer's mask under context parallelism: causal or sliding over `window`, attended
    over the whole ring. The untiled engine's attention calls reach it through `ring_sdpa`;
    the tiled engine calls `forward` and `backward` once per layer. `chunk`: queries per block
    of scores (None: `default_chunk_size`'s)."""

    kind: Literal["causal", "sliding"]
    window: int | None
    ring: Ring
    shards: Shards
    chunk: int | None = None

    def _shape(self, q: mx.array) -> tuple[int | None, int]:
        """(the window, None where it covers the sequence; queries per chunk)."""
        B, H, n, _ = q.shape
        window = self.window if self.kind == "sliding" else None
        if window is not None and window >= self.shards.length:
            window = None
        return window, self.chunk or default_chunk_size(B, H, n, self.shards.padded, None)

    def forward(self, q: mx.array, k: mx.array, v: mx.array, scale: float
                ) -> tuple[mx.array, mx.array]:
        """(O, row LSE) of this rank's queries: `ring_forward`."""
        window, chunk = self._shape(q)
        return ring_forward(q, k, v, scale, window, self.ring, self.shards, chunk)

    def backward(self, q: mx.array, k: mx.array, v: mx.array, lse: mx.array,
                 d_out: mx.array, delta: mx.array, scale: float
                 ) -> tuple[mx.array, mx.array, mx.array]:
        """(dQ, dK, dV) of `forward`: `ring_backward`."""
        window, chunk = self._shape(q)
        return ring_backward(q, k, v, lse, d_out, delta, scale, window, self.ring,
                             self.shards, chunk)


@contextlib.contextmanager
def use_ring_attention(modules: Sequence[ModuleType | str], chunk_size: int | None = None
                       ) -> Iterator[None]:
    """Route the mlx-lm modules' attention calls with a `RingMask` to `ring_sdpa` (the rest to
    `sdpa_for_mlx_lm`), as `attention.use_attention` does; then restore."""

    def sdpa(queries, keys, values, cache, scale, mask, sinks=None):
        if isinstance(mask, RingMask) and cache is None and sinks is None:
            return ring_sdpa(queries, keys, values, scale,
                             replace(mask, chunk=chunk_size) if chunk_size else mask)
        if isinstance(mask, RingMask):
            raise RingError("context-parallel attention takes no KV cache and no sinks")
        return sdpa_for_mlx_lm(queries, keys, values, cache, scale, mask, sinks,
                               chunk_size=chunk_size)

    with swap_attention(modules, sdpa):
        yield


class ShardRope(nn.Module):
    """A layer's RoPE at a shard's global positions: each contiguous run rotated from its own
    start (a zig-zag shard has two). The layer's own offset (0 without a cache) is ignored."""

    def __init__(self, rope: nn.Module, runs: list[tuple[int, int, int]]):
        super().__init__()
        self._rope, self._runs = rope, runs  # private: not parameters, the tree is unchanged

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        parts = [self._rope(x[..., a:b, :], offset=start) for a, b, start in self._runs]
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-2)


@contextlib.contextmanager
def use_shard_positions(layers: Sequence[nn.Module], runs: list[tuple[int, int, int]]
                        ) -> Iterator[None]:
    """Every attention module of `layers` rotates at the shard's global positions (mlx-lm's
    layers read RoPE as `self.rope`), then gets its own RoPE back."""
    swapped = []
    for layer in layers:
        for _, module in layer.named_modules():
            rope = module.get("rope") if isinstance(module, nn.Module) else None
            if isinstance(rope, nn.Module) and not isinstance(rope, ShardRope):
                swapped.append((module, rope))
    try:
        for module, rope in swapped:
            module["rope"] = ShardRope(rope, runs)
        yield
    finally:
        for module, rope in swapped:
            module["rope"] = rope
