"""Flash attention's blocked algorithm in MLX ops, float32: the same block ranges
(`flash.block_ranges`), online softmax and row LSE as the CUDA kernels, so the CPU tests check
the algorithm the kernels implement against the chunked path and MLX's autodiff."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from segback.engine.flash import BQ, block_ranges, effective_window


def _visible(i: np.ndarray, j: np.ndarray, off: int, window: int | None,
             seg: mx.array | None) -> mx.array:
    """[B or 1, 1, qi, kj] visibility of queries i (key positions i + off) and keys j."""
    ip = mx.array(i + off)[:, None]
    jj = mx.array(j)[None]
    vis = jj <= ip
    if window is not None:
        vis = vis & (jj > ip - window)
    vis = vis[None, None]
    if seg is not None:
        same = seg[:, mx.array(i + off)][:, :, None] == seg[:, mx.array(j)][:, None, :]
        vis = vis & same[:, None]
    return vis


def _gqa(x: mx.array, rep: int) -> mx.array:
    return x if rep == 1 else mx.repeat(x, rep, axis=1)


def reference_forward(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                      window: int | None = None, blocks=None, bk: int = 64, bq: int = BQ
                      ) -> tuple[mx.array, mx.array]:
    """The forward kernel's algorithm in float32 MLX ops: per query block (`bq` rows; v2: 128
    or 64), key blocks in order with an online softmax (running max and sum), then O / l and
    LSE = m + log l."""
    B, H, Lq, D = queries.shape
    Lk = keys.shape[2]
    rep = H // keys.shape[1]
    window = effective_window(window, Lk)
    seg = None if blocks is None else blocks.ids
    first, last = (None, None) if blocks is None else (blocks.first, blocks.last)
    kr, _ = block_ranges(Lq, Lk, window, bq, bk, first, last)
    q = queries.astype(mx.float32)
    k, v = _gqa(keys.astype(mx.float32), rep), _gqa(values.astype(mx.float32), rep)
    neg = mx.array(-np.inf, mx.float32)
    outs, lses = [], []
    for qb, (lo, hi) in enumerate(kr):
        i = np.arange(qb * bq, min(qb * bq + bq, Lq))
        qi = q[:, :, i[0]:i[-1] + 1]
        m = mx.full((B, H, len(i), 1), -np.inf)
        ell = mx.zeros((B, H, len(i), 1))
        acc = mx.zeros((B, H, len(i), values.shape[-1]))
        for k0 in range((int(lo) // bk) * bk, int(hi), bk):
            j = np.arange(k0, min(k0 + bk, Lk))
            s = (qi @ k[:, :, j[0]:j[-1] + 1].swapaxes(-1, -2)) * scale
            s = mx.where(_visible(i, j, Lk - Lq, window, seg), s, neg)
            m_new = mx.maximum(m, s.max(-1, keepdims=True))
            base = mx.where(m_new == -np.inf, 0.0, m_new)
            c = mx.exp(m - base)
            p = mx.exp(s - base)
            ell = ell * c + p.sum(-1, keepdims=True)
            acc = acc * c + p @ v[:, :, j[0]:j[-1] + 1]
            m = m_new
        outs.append(acc / mx.where(ell > 0, ell, 1.0))
        lses.append(mx.where(ell > 0, m + mx.log(mx.where(ell > 0, ell, 1.0)), -np.inf)[..., 0])
    return mx.concatenate(outs, axis=2).astype(queries.dtype), mx.concatenate(lses, axis=2)


def reference_backward(queries: mx.array, keys: mx.array, values: mx.array, output: mx.array,
                       lse: mx.array, d_output: mx.array, scale: float,
                       window: int | None = None, blocks=None, bkv: int = 64, bq: int = BQ,
                       dq_tiles: tuple[int, int] | None = None
                       ) -> tuple[mx.array, mx.array, mx.array]:
    """The backward kernels' algorithm in float32 MLX ops: dK/dV per key block (`bkv` keys,
    `bq`-row query blocks) over the query blocks that see it, dQ per query block over its key
    blocks (`dq_tiles` = (rows, keys), default (bq, bkv); v2 tiles dQ unlike dK/dV), P
    recomputed from the LSE."""
    B, H, Lq, D = queries.shape
    Hkv, Lk = keys.shape[1], keys.shape[2]
    rep = H // Hkv
    window = effective_window(window, Lk)
    seg = None if blocks is None else blocks.ids
    first, last = (None, None) if blocks is None else (blocks.first, blocks.last)
    q, do = queries.astype(mx.float32), d_output.astype(mx.float32)
    k, v = _gqa(keys.astype(mx.float32), rep), _gqa(values.astype(mx.float32), rep)
    delta = (do * output.astype(mx.float32)).sum(-1, keepdims=True)
    lse = lse[..., None]
    neg_off = Lk - Lq

    def block(i, j):
        s = (q[:, :, i[0]:i[-1] + 1] @ k[:, :, j[0]:j[-1] + 1].swapaxes(-1, -2)) * scale
        p = mx.where(_visible(i, j, neg_off, window, seg), mx.exp(s - lse[:, :, i[0]:i[-1] + 1]),
                     0.0)
        dp = do[:, :, i[0]:i[-1] + 1] @ v[:, :, j[0]:j[-1] + 1].swapaxes(-1, -2)
        return p, p * (dp - delta[:, :, i[0]:i[-1] + 1])

    _, qr = block_ranges(Lq, Lk, window, bq, bkv, first, last)
    dks, dvs = [], []
    for kb, (lo, hi) in enumerate(qr):
        j = np.arange(kb * bkv, min(kb * bkv + bkv, Lk))
        dk = mx.zeros((B, H, len(j), D))
        dv = mx.zeros((B, H, len(j), values.shape[-1]))
        for q0 in range((int(lo) // bq) * bq, int(hi), bq):
            i = np.arange(q0, min(q0 + bq, Lq))
            p, ds = block(i, j)
            dv = dv + p.swapaxes(-1, -2) @ do[:, :, i[0]:i[-1] + 1]
            dk = dk + ds.swapaxes(-1, -2) @ q[:, :, i[0]:i[-1] + 1]
        dks.append(dk * scale)
        dvs.append(dv)
    dk = mx.concatenate(dks, axis=2).reshape(B, Hkv, rep, Lk, D).sum(2)
    dv = mx.concatenate(dvs, axis=2).reshape(B, Hkv, rep, Lk, -1).sum(2)

    dq_bq, dq_bk = dq_tiles or (bq, bkv)
    kr, _ = block_ranges(Lq, Lk, window, dq_bq, dq_bk, first, last)
    dqs = []
    for qb, (lo, hi) in enumerate(kr):
        i = np.arange(qb * dq_bq, min(qb * dq_bq + dq_bq, Lq))
        dq = mx.zeros((B, H, len(i), D))
        for k0 in range((int(lo) // dq_bk) * dq_bk, int(hi), dq_bk):
            j = np.arange(k0, min(k0 + dq_bk, Lk))
            _, ds = block(i, j)
            dq = dq + ds @ k[:, :, j[0]:j[-1] + 1]
        dqs.append(dq * scale)
    dq = mx.concatenate(dqs, axis=2)
    return dq.astype(queries.dtype), dk.astype(keys.dtype), dv.astype(values.dtype)
