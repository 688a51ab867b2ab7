"""Chunked attention: an O(L) backward of MLX ops, on every device.

The VJP of `mx.fast.scaled_dot_product_attention` materializes [B, H, L, L] scores, probabilities
and their gradients where MLX has no fused backward (and a sliding window saves nothing). Here
the backward walks the queries one chunk at a time, flash-attention-2 style: a chunk recomputes
its scores against only the keys it can see, so memory is O(chunk x L) (causal) or
O(chunk x (chunk + window)) (sliding), and a sliding layer does O(L x window) work.

- Row logsumexp: not stored. A chunk holds complete score rows, so the backward recomputes its
  softmax exactly from the scores it needs anyway; the forward keeps only its output (for
  rowsum(dO * O)).
- Forward: chunked the same way (no [L, L] array, no mask array). A causal call may use mx.fast's
  kernel instead (`fused_forward`), by default only on Metal, whose kernel is flash-style.
- Chunks run strictly in order (`mx.depends`), else MLX's scheduler may start many at once.
  dK/dV accumulate in float32; matmuls run in the input dtype, softmax and dS in float32.
- On CUDA, buffers live until the CUDA graph that used them has run, and mlx batches 20 ops per
  graph by default: several chunks' scores stay alive at once. `MLX_MAX_OPS_PER_BUFFER=4` (set
  before mlx starts; segback's CLI sets it on CUDA, `segback/backend/ops_per_buffer.py`) or
  `mx.set_memory_limit` bound that; see bench/attention_bench.py.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import mlx.core as mx

from segback.engine.masks import Blocks


# Chunks are sized so one [B, H, chunk, visible keys] float32 score array stays under this many
# elements (256 MB); the backward keeps ~4 such arrays alive.
SCORE_BUDGET = 1 << 26
MIN_CHUNK = 64
MAX_CHUNK = 1024


def default_chunk_size(
    batch: int, heads: int, q_len: int, k_len: int, window: int | None = None
) -> int:
    """Largest power-of-two query chunk in [MIN_CHUNK, MAX_CHUNK] whose scores fit SCORE_BUDGET.

    Bigger chunks mean fewer, larger matmuls (faster); the budget bounds the per-chunk memory.
    A sliding chunk also sees its own width of keys beyond the window, so its chunk is at most
    the window (work <= 2 x L x window).
    """
    chunk = MAX_CHUNK
    if window is not None:
        while chunk > MIN_CHUNK and chunk > window:
            chunk //= 2
    while chunk > MIN_CHUNK:
        visible = k_len if window is None else min(k_len, chunk + window - 1)
        if batch * heads * chunk * visible <= SCORE_BUDGET:
            break
        chunk //= 2
    return max(1, min(chunk, q_len))


def attention_shape(
    batch: int, heads: int, q_len: int, k_len: int, window: int | None,
    chunk_size: int | None = None,
) -> tuple[int | None, int]:
    """(window, chunk) as the kernels take them: a window covering every key becomes None."""
    if window is not None and window >= k_len:
        window = None  # the window covers everything: plain causal
    return window, chunk_size or default_chunk_size(batch, heads, q_len, k_len, window)


def _key_range(q0: int, q1: int, offset: int, window: int | None) -> tuple[int, int]:
    """Keys [k0, k1) seen by queries [q0, q1) (query i sits at key position i + offset)."""
    k1 = q1 + offset
    k0 = 0 if window is None else max(0, q0 + offset - window + 1)
    return k0, k1


def _chunk_mask(
    q0: int, q1: int, k0: int, k1: int, offset: int, window: int | None
) -> mx.array | None:
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


def _probs_from_scores(s: mx.array, mask: mx.array | None, scale: float) -> mx.array:
    s = s.astype(mx.float32) * scale
    if mask is not None:
        s = mx.where(mask, s, mx.finfo(mx.float32).min)
    return mx.softmax(s, axis=-1, precise=True)


def _dscores(p: mx.array, dp: mx.array, delta: mx.array, scale: float) -> mx.array:
    """dS = P * (dP - rowsum(dO * O)), times the scale (dS is only used as scale * dS)."""
    return (p * (dp.astype(mx.float32) - delta) * scale).astype(dp.dtype)


# Fusing the elementwise passes (shapeless: chunks differ in width) saves score-sized temporaries
# and memory traffic, which dominate a chunk's cost on a GPU.
_probs_from_scores_fused = mx.compile(_probs_from_scores, shapeless=True)
_dscores_fused = mx.compile(_dscores, shapeless=True)


def _probs(
    q: mx.array, k: mx.array, scale: float, mask: mx.array | None, rep: int
) -> mx.array:
    """Float32 softmax of a chunk's scores; q [B, Hkv, rep * c, D], k [B, Hkv, kv, D]."""
    s = q @ k.swapaxes(-1, -2)
    B, Hkv, n, kv = s.shape
    if mask is not None:
        s = s.reshape(B, Hkv, rep, n // rep, kv)  # the [c, kv] mask broadcasts over rep
    return _probs_from_scores_fused(s, mask, scale).reshape(B, Hkv, n, kv)


def _chunks(Lq: int, chunk: int, offset: int, window: int | None,
            blocks: Blocks | None = None):
    """(q0, q1, k0, k1, mask) for each query chunk: its rows, visible keys and their mask."""
    for q0 in range(0, Lq, chunk):
        q1 = min(q0 + chunk, Lq)
        k0, k1 = _key_range(q0, q1, offset, window)
        if blocks is None:
            yield q0, q1, k0, k1, _chunk_mask(q0, q1, k0, k1, offset, window)
            continue
        k0 = max(k0, int(blocks.first[q0 + offset]))
        yield q0, q1, k0, k1, blocks.mask(q0 + offset, q1 + offset, k0, k1, window)


def _q_chunk(x: mx.array, q0: int, q1: int) -> mx.array:
    """Rows [q0, q1) of a [B, Hkv, rep, L, D] array as [B, Hkv, rep * c, D]."""
    B, Hkv, rep, _, D = x.shape
    return x[:, :, :, q0:q1].reshape(B, Hkv, rep * (q1 - q0), D)


def _add_rows(acc: mx.array, update: mx.array, start: int) -> mx.array:
    """acc[:, :, start:start + n] += update, in float32."""
    stop = start + update.shape[2]
    return mx.slice_update(
        acc, acc[:, :, start:stop] + update.astype(mx.float32), mx.array([start]), (2,)
    )


class Rows:
    """An array kept as the pieces it was computed in (along `axis`, the sequence), read a row
    range at a time: the tiled engine's dO, dQ and dh never exist as one concatenated copy
    beside their pieces (at e4b's global layers that copy is 8 KB a token, 1 GB at 128K)."""

    def __init__(self, pieces: Sequence[mx.array], axis: int = 2):
        self.pieces, self.axis = list(pieces), axis
        self.starts = [0]
        for x in self.pieces:
            self.starts.append(self.starts[-1] + x.shape[axis])

    def __call__(self, a: int, b: int) -> mx.array:
        """Rows [a, b) (along `axis`) as one array."""
        parts = []
        lead = (slice(None),) * self.axis
        for x, s0, s1 in zip(self.pieces, self.starts, self.starts[1:]):
            if s1 > a and s0 < b:  # a released piece is never asked for again
                parts.append(x[lead + (slice(max(a, s0) - s0, min(b, s1) - s0),)])
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=self.axis)

    def release(self, b: int) -> None:
        """Let go of the pieces wholly before row `b` (a reader done with them frees them)."""
        for j, s1 in enumerate(self.starts[1:]):
            if s1 <= b:
                self.pieces[j] = None


def _rows(x: mx.array | Rows, q0: int, q1: int, Hkv: int) -> mx.array:
    """Rows [q0, q1) of a [B, H, L, D] array (or Rows) as [B, Hkv, rep * c, D]."""
    r = x(q0, q1) if isinstance(x, Rows) else x[:, :, q0:q1]
    B, H, c, D = r.shape
    return r.reshape(B, Hkv, H // Hkv * c, D)


def _split(queries: mx.array, keys: mx.array) -> tuple[mx.array, int, int]:
    """Queries as [B, Hkv, rep, Lq, D], the GQA repeat, and the query offset Lk - Lq."""
    B, H, Lq, D = queries.shape
    Hkv, Lk = keys.shape[1], keys.shape[2]
    rep = H // Hkv
    return queries.reshape(B, Hkv, rep, Lq, D), rep, Lk - Lq


def attention_forward(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, window: int | None,
    chunk: int, blocks: Blocks | None = None,
) -> mx.array:
    """Chunked causal/sliding attention output [B, H, Lq, D]; one chunk's scores alive at once."""
    B, H, Lq, D = queries.shape
    q5, rep, offset = _split(queries, keys)
    outs = []
    for q0, q1, k0, k1, mask in _chunks(Lq, chunk, offset, window, blocks):
        qc = _q_chunk(q5, q0, q1)
        if outs:
            qc = mx.depends(qc, outs[-1])  # one chunk's scores alive at a time
        p = _probs(qc, keys[:, :, k0:k1], scale, mask, rep)
        o = p.astype(values.dtype) @ values[:, :, k0:k1]
        outs.append(o.reshape(B, -1, rep, q1 - q0, values.shape[-1]))
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=3)
    return out.reshape(B, H, Lq, values.shape[-1])


def attention_backward(
    queries: mx.array, keys: mx.array, values: mx.array, output: mx.array,
    d_output: mx.array | Rows, scale: float, window: int | None, chunk: int,
    delta: mx.array | Rows | None = None, dq_rows: bool = False, blocks: Blocks | None = None,
) -> tuple[mx.array | Rows, mx.array, mx.array]:
    """(dQ, dK, dV) of `attention_forward`, recomputing each query chunk's scores.

    `delta` = rowsum(dO * O) in float32, [B, H, Lq, 1]; given, `output` may be None (a caller
    that computed delta tile by tile need not keep O alive). `d_output` and `delta` may be
    `Rows`; `dq_rows` returns dQ as `Rows` of its chunks (no concatenated copy).
    """
    B, H, Lq, D = queries.shape
    Hkv, Lk = keys.shape[1], keys.shape[2]
    q5, rep, offset = _split(queries, keys)
    if delta is None:
        # rowsum(dO * O): the softmax-gradient correction, O(L * D) for all rows at once.
        do = d_output(0, Lq) if isinstance(d_output, Rows) else d_output
        delta = (do.astype(mx.float32) * output.astype(mx.float32)).sum(-1, keepdims=True)
    dk = mx.zeros((B, Hkv, Lk, D), mx.float32)
    dv = mx.zeros((B, Hkv, Lk, D), mx.float32)
    dqs = []
    for q0, q1, k0, k1, mask in _chunks(Lq, chunk, offset, window, blocks):
        qc = _q_chunk(q5, q0, q1)
        if dqs:
            # Chunks run in order, each after the last one's results: without this, the
            # scheduler may start many chunks at once and hold their scores together.
            qc = mx.depends(qc, [dqs[-1], dk, dv])
        kc, vc = keys[:, :, k0:k1], values[:, :, k0:k1]
        doc = _rows(d_output, q0, q1, Hkv)
        p = _probs(qc, kc, scale, mask, rep)
        dv_c = p.astype(doc.dtype).swapaxes(-1, -2) @ doc
        dp = doc @ vc.swapaxes(-1, -2)
        ds = _dscores_fused(
            p, dp, _rows(delta, q0, q1, Hkv), scale
        ).astype(queries.dtype)
        dqs.append((ds @ kc).reshape(B, H, q1 - q0, D).astype(queries.dtype))
        dk_c = ds.swapaxes(-1, -2) @ qc
        dk = _add_rows(dk, dk_c, k0)
        dv = _add_rows(dv, dv_c, k0)
    dq = Rows(dqs) if dq_rows else dqs[0] if len(dqs) == 1 else mx.concatenate(dqs, axis=2)
    return dq, dk.astype(keys.dtype), dv.astype(values.dtype)


def _make_chunked(scale: float, window: int | None, chunk: int, fused_forward: bool,
                  blocks: Blocks | None = None):
    """Build the custom-VJP attention for fixed static arguments (cached by the caller, but
    for packed `blocks`, which change every batch)."""

    @mx.custom_function
    def attend(queries: mx.array, keys: mx.array, values: mx.array) -> mx.array:
        if fused_forward:
            return mx.fast.scaled_dot_product_attention(
                queries, keys, values, scale=scale, mask="causal"
            )
        return attention_forward(queries, keys, values, scale, window, chunk, blocks)

    @attend.vjp
    def attend_vjp(primals, cotangent, output):
        queries, keys, values = primals
        return attention_backward(queries, keys, values, output, cotangent, scale, window, chunk,
                                  blocks=blocks)

    return attend


@functools.cache
def _cached_chunked(scale: float, window: int | None, chunk: int, fused_forward: bool):
    return _make_chunked(scale, window, chunk, fused_forward)


def chunked_sdpa(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    scale: float,
    window: int | None = None,
    chunk_size: int | None = None,
    fused_forward: bool | None = None,
    blocks: Blocks | None = None,
) -> mx.array:
    """Causal (optionally sliding-window) attention whose backward is O(L) in memory.

    Layout as mlx: queries [B, H, Lq, D], keys/values [B, Hkv, Lk, D], H a multiple of Hkv,
    Lq <= Lk (query i sits at key position i + Lk - Lq). With `window`, query i sees keys j with
    i - window < j <= i, as mlx-lm's `create_causal_mask(N, window_size=window)`. With
    `blocks` (packed rows), only keys of its own example; chunks are then at most about an
    example long, and read keys from their earliest example's start on.
    """
    B, H, Lq, D = queries.shape
    _, Hkv, Lk, Dk = keys.shape
    if Dk != D or values.shape[-1] != D or values.shape[:3] != keys.shape[:3]:
        raise ValueError("chunked_sdpa needs keys and values shaped [B, Hkv, Lk, D] like queries")
    if H % Hkv or keys.shape[0] != B:
        raise ValueError(f"{H} query heads cannot share {Hkv} key/value heads")
    if Lq > Lk:
        raise ValueError(f"more queries ({Lq}) than keys ({Lk})")
    window, chunk = attention_shape(B, H, Lq, Lk, window, chunk_size)
    if blocks is not None:
        if chunk_size is None:  # a chunk spans about one example: few keys beyond its own
            while chunk > MIN_CHUNK and chunk > blocks.mean_length:
                chunk //= 2
        return _make_chunked(float(scale), window, int(chunk), False, blocks)(
            queries, keys, values)
    if fused_forward is None:
        fused_forward = mx.metal.is_available()
    fused = fused_forward and window is None and mx.default_device() == mx.gpu
    return _cached_chunked(float(scale), window, int(chunk), fused)(queries, keys, values)
