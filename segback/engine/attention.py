"""Attention with an O(L) backward, as a drop-in for mlx-lm's `scaled_dot_product_attention`.

The VJP of `mx.fast.scaled_dot_product_attention` materializes [B, H, L, L] scores, probabilities
and their gradients (DESIGN.md: 38 GB at L=32K, and a sliding window saves nothing). Here the
backward walks the queries one chunk at a time, flash-attention-2 style: a chunk recomputes its
scores against only the keys it can see, so memory is O(chunk x L) (causal) or
O(chunk x (chunk + window)) (sliding), and a sliding layer does O(L x window) work.

Since a chunk holds complete score rows, its softmax (and so the row logsumexp) is recomputed
exactly in the backward from the scores it needs anyway: nothing beyond the output is stored.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Iterator, Literal, Optional, Sequence

import mlx.core as mx

# Chunks are sized so one [B, H, chunk, visible keys] float32 score array stays under this many
# elements (256 MB); the backward keeps ~4 such arrays alive.
SCORE_BUDGET = 1 << 26
MIN_CHUNK = 64
MAX_CHUNK = 1024


@dataclass(frozen=True)
class MaskSpec:
    """A mask described instead of materialized: "causal", or "sliding" over `window` keys."""

    kind: Literal["causal", "sliding"] = "causal"
    window: Optional[int] = None

    def __post_init__(self):
        if self.kind not in ("causal", "sliding"):
            raise ValueError(f"unknown mask kind {self.kind!r}")
        if self.kind == "sliding" and (self.window is None or self.window < 1):
            raise ValueError("a sliding mask needs a positive window")


def default_chunk_size(
    batch: int, heads: int, q_len: int, k_len: int, window: Optional[int] = None
) -> int:
    """Largest power-of-two query chunk in [MIN_CHUNK, MAX_CHUNK] whose scores fit SCORE_BUDGET.

    Bigger chunks mean fewer, larger matmuls (faster); the budget bounds the per-chunk memory.
    """
    chunk = MAX_CHUNK
    while chunk > MIN_CHUNK:
        visible = k_len if window is None else min(k_len, chunk + window - 1)
        if batch * heads * chunk * visible <= SCORE_BUDGET:
            break
        chunk //= 2
    return max(1, min(chunk, q_len))


def _key_range(q0: int, q1: int, offset: int, window: Optional[int]) -> tuple[int, int]:
    """Keys [k0, k1) seen by queries [q0, q1) (query i sits at key position i + offset)."""
    k1 = q1 + offset
    k0 = 0 if window is None else max(0, q0 + offset - window + 1)
    return k0, k1


def _chunk_mask(
    q0: int, q1: int, k0: int, k1: int, offset: int, window: Optional[int]
) -> Optional[mx.array]:
    """Boolean [q1 - q0, k1 - k0] visibility of the chunk, or None when every key is visible."""
    causal_cut = k1 - 1 > q0 + offset
    window_cut = window is not None and k0 <= q1 - 1 + offset - window
    if not (causal_cut or window_cut):
        return None
    qpos = mx.arange(q0 + offset, q1 + offset)[:, None]
    kpos = mx.arange(k0, k1)[None]
    mask = qpos >= kpos
    if window is not None:
        mask = mask & (qpos < kpos + window)
    return mask


def _probs(
    q: mx.array, k: mx.array, scale: float, mask: Optional[mx.array], rep: int
) -> mx.array:
    """Float32 softmax of a chunk's scores; q [B, Hkv, rep * c, D], k [B, Hkv, kv, D]."""
    s = (q @ k.swapaxes(-1, -2)).astype(mx.float32) * scale
    if mask is not None:
        B, Hkv, n, kv = s.shape
        s = s.reshape(B, Hkv, rep, n // rep, kv)
        s = mx.where(mask, s, mx.finfo(mx.float32).min).reshape(B, Hkv, n, kv)
    return mx.softmax(s, axis=-1, precise=True)


def _q_chunk(x: mx.array, q0: int, q1: int) -> mx.array:
    """Rows [q0, q1) of a [B, Hkv, rep, L, D] array as [B, Hkv, rep * c, D]."""
    B, Hkv, rep, _, D = x.shape
    return x[:, :, :, q0:q1].reshape(B, Hkv, rep * (q1 - q0), D)


def _make_chunked(scale: float, window: Optional[int], chunk: int, fused_forward: bool):
    """Build the custom-VJP attention for fixed static arguments (cached by the caller)."""

    def split(queries: mx.array, keys: mx.array) -> tuple[mx.array, int, int]:
        B, H, Lq, D = queries.shape
        Hkv, Lk = keys.shape[1], keys.shape[2]
        rep = H // Hkv
        return queries.reshape(B, Hkv, rep, Lq, D), rep, Lk - Lq

    @mx.custom_function
    def attend(queries: mx.array, keys: mx.array, values: mx.array) -> mx.array:
        if fused_forward:
            return mx.fast.scaled_dot_product_attention(
                queries, keys, values, scale=scale, mask="causal"
            )
        B, H, Lq, D = queries.shape
        q5, rep, offset = split(queries, keys)
        outs = []
        for q0 in range(0, Lq, chunk):
            q1 = min(q0 + chunk, Lq)
            k0, k1 = _key_range(q0, q1, offset, window)
            mask = _chunk_mask(q0, q1, k0, k1, offset, window)
            qc = _q_chunk(q5, q0, q1)
            if outs:
                qc = mx.depends(qc, outs[-1])  # one chunk's scores alive at a time (see vjp)
            p = _probs(qc, keys[:, :, k0:k1], scale, mask, rep)
            o = p.astype(values.dtype) @ values[:, :, k0:k1]
            outs.append(o.reshape(B, -1, rep, q1 - q0, values.shape[-1]))
        out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=3)
        return out.reshape(B, H, Lq, values.shape[-1])

    @attend.vjp
    def attend_vjp(primals, cotangent, output):
        queries, keys, values = primals
        B, H, Lq, D = queries.shape
        Hkv, Lk = keys.shape[1], keys.shape[2]
        q5, rep, offset = split(queries, keys)
        do5 = cotangent.reshape(B, Hkv, rep, Lq, D)
        o5 = output.reshape(B, Hkv, rep, Lq, D)
        # delta = rowsum(dO * O): the softmax-gradient correction, O(L * D) for all rows at once.
        delta5 = (do5.astype(mx.float32) * o5.astype(mx.float32)).sum(-1, keepdims=True)
        dk = mx.zeros((B, Hkv, Lk, D), mx.float32)
        dv = mx.zeros((B, Hkv, Lk, D), mx.float32)
        dqs = []
        for q0 in range(0, Lq, chunk):
            q1 = min(q0 + chunk, Lq)
            k0, k1 = _key_range(q0, q1, offset, window)
            mask = _chunk_mask(q0, q1, k0, k1, offset, window)
            qc = _q_chunk(q5, q0, q1)
            if dqs:
                # Chunks run in order, each after the last one's results: without this, the
                # scheduler may start many chunks at once and hold their scores together.
                qc = mx.depends(qc, [dqs[-1], dk, dv])
            kc, vc = keys[:, :, k0:k1], values[:, :, k0:k1]
            doc = _q_chunk(do5, q0, q1)
            p = _probs(qc, kc, scale, mask, rep)
            dv_c = p.astype(doc.dtype).swapaxes(-1, -2) @ doc
            dp = (doc @ vc.swapaxes(-1, -2)).astype(mx.float32)
            ds = p * (dp - _q_chunk(delta5, q0, q1)) * scale
            ds = ds.astype(queries.dtype)
            dqs.append((ds @ kc).reshape(B, Hkv, rep, q1 - q0, D))
            dk_c = ds.swapaxes(-1, -2) @ qc
            dk = mx.slice_update(dk, dk[:, :, k0:k1] + dk_c.astype(mx.float32), mx.array([k0]), (2,))
            dv = mx.slice_update(dv, dv[:, :, k0:k1] + dv_c.astype(mx.float32), mx.array([k0]), (2,))
        dq = dqs[0] if len(dqs) == 1 else mx.concatenate(dqs, axis=3)
        return (
            dq.reshape(B, H, Lq, D).astype(queries.dtype),
            dk.astype(keys.dtype),
            dv.astype(values.dtype),
        )

    return attend


@functools.lru_cache(maxsize=None)
def _cached_chunked(scale: float, window: Optional[int], chunk: int, fused_forward: bool):
    return _make_chunked(scale, window, chunk, fused_forward)


def chunked_sdpa(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    scale: float,
    window: Optional[int] = None,
    chunk_size: Optional[int] = None,
) -> mx.array:
    """Causal (optionally sliding-window) attention whose backward is O(L) in memory.

    Layout as mlx: queries [B, H, Lq, D], keys/values [B, Hkv, Lk, D], H a multiple of Hkv,
    Lq <= Lk (query i sits at key position i + Lk - Lq). With `window`, query i sees keys j with
    i - window < j <= i, as mlx-lm's `create_causal_mask(N, window_size=window)`.
    """
    B, H, Lq, D = queries.shape
    _, Hkv, Lk, Dk = keys.shape
    if Dk != D or values.shape[-1] != D or values.shape[:3] != keys.shape[:3]:
        raise ValueError("chunked_sdpa needs keys and values shaped [B, Hkv, Lk, D] like queries")
    if H % Hkv or keys.shape[0] != B:
        raise ValueError(f"{H} query heads cannot share {Hkv} key/value heads")
    if Lq > Lk:
        raise ValueError(f"more queries ({Lq}) than keys ({Lk})")
    if window is not None and window >= Lk:
        window = None  # the window covers everything: plain causal
    chunk = chunk_size or default_chunk_size(B, H, Lq, Lk, window)
    fused = window is None and mx.default_device() == mx.gpu
    return _cached_chunked(float(scale), window, int(chunk), fused)(queries, keys, values)
