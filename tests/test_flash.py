"""The flash kernels' algorithm (segback.engine.flash), run with MLX ops on the CPU: block ranges
cover every visible pair, and the blocked forward (output, LSE) and backward (dQ, dK, dV) equal
a dense float32 attention and its autodiff for causal, sliding-window, GQA and packed masks."""

import mlx.core as mx
import numpy as np
import pytest

from segback.engine import flash
from segback.engine.attention import Blocks, fused_kernel

EPS = float(np.finfo(np.float32).eps)


def _segments(B, L, seed):
    rng = np.random.default_rng(seed)
    out = np.zeros((B, L), np.int32)
    for b in range(B):
        cuts = np.sort(rng.choice(np.arange(1, L), size=3, replace=False))
        out[b] = np.searchsorted(cuts, np.arange(L), side="right")
    return out


def _dense_visible(Lq, Lk, window, seg):
    i = np.arange(Lq)[:, None] + (Lk - Lq)
    j = np.arange(Lk)[None]
    vis = j <= i
    if window is not None:
        vis &= j > i - window
    vis = np.broadcast_to(vis, (1 if seg is None else seg.shape[0], Lq, Lk)).copy()
    if seg is not None:
        vis &= seg[:, Lk - Lq:, None] == seg[:, None, :]
    return vis


def _dense(q, k, v, scale, vis):
    rep = q.shape[1] // k.shape[1]
    k, v = mx.repeat(k, rep, axis=1), mx.repeat(v, rep, axis=1)
    s = (q @ k.swapaxes(-1, -2)) * scale
    s = mx.where(mx.array(vis)[:, None], s, -mx.inf)
    return mx.softmax(s, axis=-1, precise=True) @ v, mx.logsumexp(s, axis=-1)


CASES = [  # (B, H, Hkv, L, D, window, packed)
    (1, 2, 2, 150, 16, None, False),   # L not a multiple of the blocks
    (2, 4, 2, 130, 8, None, False),    # GQA
    (1, 2, 1, 200, 16, 37, False),     # window smaller than a block
    (1, 2, 2, 140, 8, 90, False),      # window larger than a block
    (1, 2, 2, 96, 8, 500, False),      # window covering every key: plain causal
    (2, 2, 1, 160, 8, None, True),     # packed examples
    (2, 2, 2, 170, 8, 40, True),       # packed, windowed
]


@pytest.mark.parametrize("B,H,Hkv,L,D,window,packed", CASES)
def test_block_ranges_cover_every_visible_pair(B, H, Hkv, L, D, window, packed):
    seg = _segments(B, L, 1) if packed else None
    blocks = Blocks(seg) if packed else None
    first, last = (blocks.first, blocks.last) if packed else (None, None)
    vis = _dense_visible(L, L, window if window and window < L else None, seg).any(0)
    for bq, bk in ((64, 64), (64, 32), (32, 128), (128, 64), (128, 32), (32, 32)):
        kr, qr = flash.block_ranges(L, L, window if window and window < L else None, bq, bk,
                                    first, last)
        i, j = np.nonzero(vis)
        lo, hi = kr[i // bq, 0], kr[i // bq, 1]
        assert ((j >= (lo // bk) * bk) & (j < hi)).all()
        lo, hi = qr[j // bk, 0], qr[j // bk, 1]
        assert ((i >= (lo // bq) * bq) & (i < hi)).all()
        # and the ranges skip what is wholly masked: a causal query block sees no later keys
        assert (kr[:, 1] <= np.minimum(np.arange(len(kr)) * bq + bq, L)).all()


@pytest.mark.parametrize("B,H,Hkv,L,D,window,packed", CASES)
def test_blocked_algorithm_equals_dense_attention(B, H, Hkv, L, D, window, packed):
    mx.random.seed(0)
    q = mx.random.normal((B, H, L, D))
    k = mx.random.normal((B, Hkv, L, D))
    v = mx.random.normal((B, Hkv, L, D))
    do = mx.random.normal((B, H, L, D))
    scale = D ** -0.5
    seg = _segments(B, L, 1) if packed else None
    blocks = Blocks(seg) if packed else None
    vis = _dense_visible(L, L, window, seg)

    o, lse = flash.reference_forward(q, k, v, scale, window, blocks, bk=32)
    want_o, want_lse = _dense(q, k, v, scale, vis)
    # float32 sums of up to L terms, each rounded: a bound of a few L * eps relative to |V|.
    tol = 4 * L * EPS
    assert mx.abs(o - want_o).max().item() <= tol * mx.abs(v).max().item()
    assert mx.abs(lse - want_lse).max().item() <= tol * mx.abs(want_lse).max().item()

    got = flash.reference_backward(q, k, v, o, lse, do, scale, window, blocks, bkv=32, bq=64)
    _, want = mx.vjp(lambda q, k, v: _dense(q, k, v, scale, vis)[0], [q, k, v], [do])
    for g, w in zip(got, want):
        assert g.shape == w.shape
        assert mx.abs(g - w).max().item() <= 4 * tol * mx.abs(w).max().item()


def test_fused_kernel_choice_off_cuda():
    """Off CUDA, `attention="fused"` keeps mlx-lm's own path for every case."""
    q = mx.zeros((1, 2, 256, 128), mx.bfloat16)
    if flash.available():
        pytest.skip("this checks the choice where no CUDA GPU is the default device")
    assert fused_kernel(q, q) == "composed"
    assert fused_kernel(q, q, window=16) == "composed"
    assert not flash.supports(q, q)


def _geometry(name):
    from segback.planner.geometry import read_geometry, resolve_model

    model, model_id = resolve_model(name, "bfloat16", 4)
    return read_geometry(model, 8, None, "bfloat16", model_id)


def test_cost_model_charges_the_fast_kernels():
    """Planning for CUDA (fast_kernels): causal head-dim-128 layers run MLX's kernel, Gemma's
    head dims and windows the flash kernel, and neither keeps [L, L] scores: an untiled plan's
    peak grows about linearly in L, and fused attention is predicted faster than chunked."""
    from segback.planner.cost import Coefficients, CostModel
    from segback.planner.search import best_by_count

    llama, e4b = _geometry("llama-3.1-8b"), _geometry("e4b")
    cuda = dict(fast_kernels=True, coef=Coefficients(activation=1.6))
    assert {CostModel(llama, 8192, 1, **cuda).kernel(g) for g in llama.layers} == {"mlx"}
    assert {CostModel(e4b, 8192, 1, **cuda).kernel(g) for g in e4b.layers} == {"flash"}
    assert {CostModel(e4b, 8192, 1, fast_kernels=False).kernel(g) for g in e4b.layers} \
        == {"composed"}
    assert {CostModel(e4b, 8192, 1, tile=2048, fast_kernels=False).kernel(g)
            for g in e4b.layers} == {"chunked"}

    def peak(L, **kw):
        cost = CostModel(llama, L, 1, **kw)
        return cost.evaluate(best_by_count(cost)[32])["peak"]

    resting = peak(2, **cuda)
    grow = (peak(32768, **cuda) - resting) / (peak(8192, **cuda) - resting)
    assert grow < 4.5  # linear in L (x4), where composed scores grow x16
    old = (peak(32768, fast_kernels=False) - resting) / (peak(8192, fast_kernels=False) - resting)
    assert old > 8
    for L in (8192, 32768):
        fused = CostModel(llama, L, 1, "fused", **cuda)
        chunked = CostModel(llama, L, 1, "chunked", **cuda)
        segs = best_by_count(fused)[8]
        assert fused.relative_step_time(segs) < chunked.relative_step_time(segs)
        assert fused.relative_step_time(segs) >= 1.0


# v2's tilings (flash._tiles_v2): forward (rows, keys), dK/dV (keys, rows), dQ (rows, keys).
V2_TILES = {D: flash._tiles_v2(D) for D in (256, 512)}


@pytest.mark.parametrize("D_tiles", [256, 512])
@pytest.mark.parametrize("B,H,Hkv,L,D,window,packed", CASES)
def test_v2_tiling_equals_dense_attention(B, H, Hkv, L, D, window, packed, D_tiles):
    """The blocked algorithm with v2's block sizes (128-row query blocks, dQ tiled unlike
    dK/dV) still equals dense attention: its block ranges cover every visible pair."""
    cfg = V2_TILES[D_tiles]
    mx.random.seed(1)
    q = mx.random.normal((B, H, L, D))
    k = mx.random.normal((B, Hkv, L, D))
    v = mx.random.normal((B, Hkv, L, D))
    do = mx.random.normal((B, H, L, D))
    scale = D ** -0.5
    seg = _segments(B, L, 1) if packed else None
    blocks = Blocks(seg) if packed else None
    vis = _dense_visible(L, L, window, seg)

    o, lse = flash.reference_forward(q, k, v, scale, window, blocks, bk=cfg["fwd_bk"],
                                     bq=cfg["fwd_bq"])
    want_o, want_lse = _dense(q, k, v, scale, vis)
    tol = 4 * L * EPS
    assert mx.abs(o - want_o).max().item() <= tol * mx.abs(v).max().item()
    assert mx.abs(lse - want_lse).max().item() <= tol * mx.abs(want_lse).max().item()

    got = flash.reference_backward(q, k, v, o, lse, do, scale, window, blocks, bkv=cfg["bkv"],
                                   bq=cfg["dkdv_bq"], dq_tiles=(cfg["dq_bq"], cfg["dq_bk"]))
    _, want = mx.vjp(lambda q, k, v: _dense(q, k, v, scale, vis)[0], [q, k, v], [do])
    for g, w in zip(got, want):
        assert mx.abs(g - w).max().item() <= 4 * tol * mx.abs(w).max().item()


def test_v2_layout_fits_the_device():
    """Every v2 kernel's shared memory fits Hopper's 227 KB per block, its warps cover its
    rows (forward / dQ: BQ / 16 row groups x WN column groups), and the 16-byte copies tile
    each block evenly (what the header's static_asserts demand)."""
    for D in flash.HEAD_DIMS:
        cfg = flash._tiles_v2(D)
        for kind in ("forward_v2", "dq_v2", "dkdv_v2"):
            assert flash.smem_v2(kind, D) <= 227 * 1024
            threads = flash.threads_v2(kind, D)
            assert threads == 256
            step = threads // (D // 8)
            rows = {"forward_v2": (cfg["fwd_bq"], cfg["fwd_bk"]),
                    "dq_v2": (cfg["dq_bq"], cfg["dq_bk"]),
                    "dkdv_v2": (cfg["bkv"], cfg["dkdv_bq"])}[kind]
            assert all(r % step == 0 for r in rows)
        assert (cfg["fwd_bk"] // cfg["fwd_wn"]) % 16 == 0
        assert (cfg["dq_bk"] // cfg["dq_wn"]) % 16 == 0
