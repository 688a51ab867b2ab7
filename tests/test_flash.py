"""The flash kernels' algorithm (segback.engine.flash), run with MLX ops on the CPU: block ranges
cover every visible pair, and the blocked forward (output, LSE) and backward (dQ, dK, dV) equal
a dense float32 attention and its autodiff for causal, sliding-window, GQA and packed masks."""

import mlx.core as mx
import numpy as np
import pytest

from segback.engine import flash
from segback.engine.flash_reference import reference_backward, reference_forward
from segback.engine.masks import Blocks
from segback.engine.attention import fused_kernel

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


def _inputs(seed, B, H, Hkv, L, D, window, packed):
    """Random Q, K, V, dO of one case, its scale, packing and dense visibility."""
    mx.random.seed(seed)
    q = mx.random.normal((B, H, L, D))
    k = mx.random.normal((B, Hkv, L, D))
    v = mx.random.normal((B, Hkv, L, D))
    do = mx.random.normal((B, H, L, D))
    seg = _segments(B, L, 1) if packed else None
    blocks = Blocks(seg) if packed else None
    return q, k, v, do, D ** -0.5, seg, blocks, _dense_visible(L, L, window, seg)


@pytest.mark.parametrize("B,H,Hkv,L,D,window,packed", CASES)
def test_blocked_algorithm_equals_dense_attention(B, H, Hkv, L, D, window, packed):
    q, k, v, do, scale, seg, blocks, vis = _inputs(0, B, H, Hkv, L, D, window, packed)

    o, lse = reference_forward(q, k, v, scale, window, blocks, bk=32)
    want_o, want_lse = _dense(q, k, v, scale, vis)
    # float32 sums of up to L terms, each rounded: a bound of a few L * eps relative to |V|.
    tol = 4 * L * EPS
    assert mx.abs(o - want_o).max().item() <= tol * mx.abs(v).max().item()
    assert mx.abs(lse - want_lse).max().item() <= tol * mx.abs(want_lse).max().item()

    got = reference_backward(q, k, v, o, lse, do, scale, window, blocks, bkv=32, bq=64)
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


def test_fast_kernel_follows_mlx_fused_length():
    """MLX's kernel up to MLX_FUSED_MAX_LEN keys (counted padded to its tile), segback's flash
    kernel past it; windows, float32 and unsupported head dims as before."""
    from segback.engine.attention import MLX_FUSED_MAX_LEN, fast_kernel_for

    assert fast_kernel_for(128, True, False, MLX_FUSED_MAX_LEN) == "mlx"
    assert fast_kernel_for(128, True, False, MLX_FUSED_MAX_LEN - 5) == "mlx"
    assert fast_kernel_for(128, True, False, MLX_FUSED_MAX_LEN + 1) == "flash"
    assert fast_kernel_for(128, True, False, 4 * MLX_FUSED_MAX_LEN) == "flash"
    assert fast_kernel_for(128, True, True, 1024) == "flash"
    assert fast_kernel_for(96, True, False, 4 * MLX_FUSED_MAX_LEN) is None
    assert fast_kernel_for(128, False, False, 1024) is None


def test_cost_model_charges_the_fast_kernels():
    """Planning for CUDA (fast_kernels): causal head-dim-128 layers run MLX's kernel, Gemma's
    head dims and windows the flash kernel, and neither keeps [L, L] scores: an untiled plan's
    peak grows about linearly in L, and fused attention is predicted faster than chunked."""
    from segback.planner.cost import Coefficients, CostModel
    from segback.planner.search import best_by_count

    llama, e4b = _geometry("llama-3.1-8b"), _geometry("e4b")
    cuda = dict(fast_kernels=True, coef=Coefficients(activation=1.6))
    assert {CostModel(llama, 8192, 1, **cuda).kernel(g) for g in llama.layers} == {"mlx"}
    # past MLX's fused length its backward scores every key: the flash kernel takes over
    assert {CostModel(llama, 32768 + 1, 1, **cuda).kernel(g) for g in llama.layers} == {"flash"}
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
    q, k, v, do, scale, seg, blocks, vis = _inputs(1, B, H, Hkv, L, D, window, packed)

    o, lse = reference_forward(q, k, v, scale, window, blocks, bk=cfg["fwd_bk"],
                                     bq=cfg["fwd_bq"])
    want_o, want_lse = _dense(q, k, v, scale, vis)
    tol = 4 * L * EPS
    assert mx.abs(o - want_o).max().item() <= tol * mx.abs(v).max().item()
    assert mx.abs(lse - want_lse).max().item() <= tol * mx.abs(want_lse).max().item()

    got = reference_backward(q, k, v, o, lse, do, scale, window, blocks, bkv=cfg["bkv"],
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


# --- the CUDA kernels' block loops, simulated index by index --------------------------------
# A model of each kernel's grid and loops (flash_attention.cuh = v1, flash_attention_v2.cuh =
# v2) as the launch in flash.py sets them up: the host's block ranges, the kernel's start
# (C division, truncating toward zero), every row its guarded loads read, every (query, key)
# pair its mask lets through and every tile it treats as wholly visible (v2's mask skip).
# Checked: every read index lies in [0, Lq) / [0, Lk), every visible pair is taken exactly
# once by each kernel and no invisible one ever, every output row is written exactly once.


def _ctrunc(a: int, b: int) -> int:
    """C's a / b * b for ints (toward zero)."""
    return (abs(a) // b) * b * (1 if a >= 0 else -1)


class _Sim:
    def __init__(self, Lq, Lk, W, seg):
        self.Lq, self.Lk, self.W, self.off = Lq, Lk, W, Lk - Lq
        self.vis = _dense_visible(Lq, Lk, W, seg)  # [B or 1, Lq, Lk]
        self.seg = seg
        self.taken = np.zeros(self.vis.shape, np.int32)

    def read(self, what, r0, rows, n):
        """A guarded tile load (load_tile / async_tile / the lse loads): rows r0 + r < n."""
        idx = r0 + np.arange(rows)
        idx = idx[idx < n]
        assert (idx >= 0).all(), f"{what} reads row {idx.min()} (tile at {r0})"

    def take(self, i0, ni, j0, nj):
        """The mask (`visible`) over rows i0.. x keys j0..: what it lets through is taken."""
        assert i0 >= 0 and j0 >= 0, f"mask at row {i0}, key {j0}"
        i1, j1 = min(i0 + ni, self.Lq), min(j0 + nj, self.Lk)
        if i1 > i0 and j1 > j0:
            self.taken[:, i0:i1, j0:j1] += self.vis[:, i0:i1, j0:j1]

    def full(self, i0, ni, j0, nj):
        """v2's all_visible(i0, ni, j0, nj): where true the mask is skipped (SEG = 0 only)."""
        Lq, Lk, off, W = self.Lq, self.Lk, self.off, self.W or 0
        ok = (i0 + ni <= Lq and j0 + nj <= Lk and j0 + nj - 1 <= i0 + off
              and (W == 0 or j0 > i0 + ni - 1 + off - W))
        if ok and self.seg is None:
            assert self.vis[0, i0:i0 + ni, j0:j0 + nj].all(), (i0, ni, j0, nj)
        return ok

    def done(self, name):
        bad = np.argwhere(self.taken != self.vis)
        assert not len(bad), (f"{name}: pair (b, i, j) {tuple(bad[0])} taken "
                              f"{self.taken[tuple(bad[0])]} times, visible "
                              f"{self.vis[tuple(bad[0])]}")


def _ranges(sim, bq, bk, blocks):
    """The host's ranges; each must lie in [0, Lk] / [0, Lq] with lo <= hi by itself (the
    kernels clamp them as well, below, so a host slip alone would not show as a bad read)."""
    first, last = (None, None) if blocks is None else (blocks.first, blocks.last)
    kr, qr = flash.block_ranges(sim.Lq, sim.Lk, sim.W, bq, bk, first, last)
    for r, n in ((kr, sim.Lk), (qr, sim.Lq)):
        assert ((0 <= r[:, 0]) & (r[:, 0] <= r[:, 1]) & (r[:, 1] <= n)).all(), r
    return kr, qr


def _clamp(r, b, n):
    """The kernels' `max(r[2 b], 0), min(r[2 b + 1], n)`."""
    return max(int(r[b, 0]), 0), min(int(r[b, 1]), n)


def _rows_written(n, blocks_of, grid):
    assert grid == -(-n // blocks_of)  # every output row by exactly one CTA


def _sim_forward_v1(sim, D, blocks, kind="forward"):
    cfg, BQ = flash._tiles(D), flash.BQ
    BK = cfg["fwd_bk"] if kind == "forward" else cfg["dq_bk"]
    kr, _ = _ranges(sim, BQ, BK, blocks)
    grid = -(-sim.Lq // BQ)  # (nqb * 128, B * H, split) / 128 threads
    _rows_written(sim.Lq, BQ, grid)
    assert len(kr) == grid
    for qb in range(grid):
        q0 = qb * BQ
        sim.read("Q", q0, BQ, sim.Lq)
        if kind == "dq":
            sim.read("dO", q0, BQ, sim.Lq)
        kstart, kend = _clamp(kr, qb, sim.Lk)
        for k0 in range(_ctrunc(kstart, BK), kend, BK):
            sim.read("K", k0, BK, sim.Lk)
            sim.read("V", k0, BK, sim.Lk)
            sim.take(q0, BQ, k0, BK)
    sim.done(f"v1 {kind} D={D}")


def _sim_dkdv_v1(sim, D, blocks):
    cfg = flash._tiles(D)
    BKV, BQ = cfg["bkv"], cfg["dkdv_bq"]
    _, qr = _ranges(sim, BQ, BKV, blocks)
    grid = -(-sim.Lk // BKV)
    _rows_written(sim.Lk, BKV, grid)
    assert len(qr) == grid
    for kb in range(grid):
        k0 = kb * BKV
        sim.read("K", k0, BKV, sim.Lk)
        sim.read("V", k0, BKV, sim.Lk)
        qstart, qend = _clamp(qr, kb, sim.Lq)
        q0 = _ctrunc(qstart, BQ)
        while q0 < qend:
            for what in ("Q", "dO", "lse", "delta"):
                sim.read(what, q0, BQ, sim.Lq)
            sim.take(q0, BQ, k0, BKV)
            q0 += BQ
    sim.done(f"v1 dkdv D={D}")


def _sim_forward_v2(sim, D, blocks, kind="forward_v2"):
    cfg = flash._tiles_v2(D)
    pre = "fwd" if kind == "forward_v2" else "dq"
    BQ, BK, WN = cfg[pre + "_bq"], cfg[pre + "_bk"], cfg[pre + "_wn"]
    KW = BK // WN
    kr, _ = _ranges(sim, BQ, BK, blocks)
    grid = len(kr)
    _rows_written(sim.Lq, BQ, grid)
    for bx in range(grid):
        qb = grid - 1 - bx  # heaviest first
        q0 = qb * BQ
        kstart, kend = _clamp(kr, qb, sim.Lk)
        kfirst = _ctrunc(kstart, BK)
        sim.read("Q", q0, BQ, sim.Lq)
        sim.read("K", kfirst, BK, sim.Lk)  # issued before the loop, whether it runs or not
        if kind == "dq_v2":
            sim.read("dO", q0, BQ, sim.Lq)
            sim.read("V", kfirst, BK, sim.Lk)
            assert q0 >= 0  # its lse / delta loads: rows q0.. guarded by r < Lq
        k0 = kfirst
        while k0 < kend:
            if kind == "forward_v2":
                sim.read("V", k0, BK, sim.Lk)
            if k0 + BK < kend:
                sim.read("K", k0 + BK, BK, sim.Lk)
                if kind == "dq_v2":
                    sim.read("V", k0 + BK, BK, sim.Lk)
            for wm in range(BQ // 16):
                for wn in range(WN):
                    rw, c0 = q0 + wm * 16, k0 + wn * KW
                    sim.full(rw, 16, c0, KW)  # skipping the mask: only where all visible
                    sim.take(rw, 16, c0, KW)
            k0 += BK
    sim.done(f"v2 {kind} D={D}")


def _sim_dkdv_v2(sim, D, blocks):
    cfg = flash._tiles_v2(D)
    BKV, BQ = cfg["bkv"], cfg["dkdv_bq"]
    NKG = BKV // 16
    NCG = 8 // NKG
    NT = (BQ // 8) // NCG
    _, qr = _ranges(sim, BQ, BKV, blocks)
    grid = len(qr)
    _rows_written(sim.Lk, BKV, grid)
    for kb in range(grid):
        k0 = kb * BKV
        qstart, qend = _clamp(qr, kb, sim.Lq)
        qfirst = _ctrunc(qstart, BQ)
        nqb = (qend - qfirst + BQ - 1) // BQ if qend > qfirst else 0
        sim.read("K", k0, BKV, sim.Lk)
        sim.read("V", k0, BKV, sim.Lk)
        for it in range(nqb):  # one head of the group (the others repeat the same tiles)
            q0 = qfirst + it * BQ
            for what in ("Q", "dO"):
                sim.read(what, q0, BQ, sim.Lq)
            i = np.arange(BQ)
            at = np.where(q0 + i < sim.Lq, q0 + i, 0)  # cp_async4's clamped lse / delta index
            assert (at >= 0).all() and (at < sim.Lq).all(), f"lse at {at.min()}"
            for kg in range(NKG):
                for cg in range(NCG):
                    sim.full(q0 + cg * NT * 8, NT * 8, k0 + kg * 16, 16)
            sim.take(q0, BQ, k0, BKV)
    sim.done(f"v2 dkdv D={D}")


def _simulate_all(B, Lq, Lk, window, packed, seed=0):
    W = flash.effective_window(window, Lk)
    seg = _segments(B, Lk, seed) if packed else None
    blocks = Blocks(seg) if packed else None
    for D in flash.HEAD_DIMS:
        for run in (lambda s: _sim_forward_v1(s, D, blocks),
                    lambda s: _sim_forward_v1(s, D, blocks, "dq"),
                    lambda s: _sim_dkdv_v1(s, D, blocks),
                    lambda s: _sim_forward_v2(s, D, blocks),
                    lambda s: _sim_forward_v2(s, D, blocks, "dq_v2"),
                    lambda s: _sim_dkdv_v2(s, D, blocks)):
            run(_Sim(Lq, Lk, W, seg))


def test_kernel_loops_on_the_h100_crash_case():
    """130 queries (the last of 4096 keys) with a 200-token window: the case that hit an
    illegal memory access in both variants. Key blocks no query sees must run no query block."""
    _simulate_all(1, 130, 4096, 200, False)


# (B, Lq, Lk, window, packed): Lq < Lk with windows from 1 key to more than Lk, ragged
# lengths, key blocks no query sees, packed examples that end before the queries start.
LOOP_CASES = [
    (1, 1, 1, None, False), (1, 1, 1, 1, False), (1, 1, 700, 1, False),
    (1, 1, 700, None, False), (1, 5, 1000, 3, False), (1, 64, 64, 64, False),
    (1, 65, 1029, 64, False), (1, 127, 1000, 128, False), (1, 128, 1025, 129, False),
    (1, 300, 700, None, False), (1, 300, 700, 37, False), (1, 200, 1100, 600, False),
    (1, 200, 1100, 1099, False), (1, 200, 1100, 5000, False), (1, 513, 520, 511, False),
    (1, 600, 600, 90, False), (1, 333, 333, 1, False), (1, 250, 1300, 1023, False),
    (2, 98, 900, 17, True), (2, 112, 787, None, True), (2, 300, 800, 200, True),
    (2, 450, 450, 90, True), (2, 20, 500, None, True),
]


@pytest.mark.parametrize("B,Lq,Lk,window,packed", LOOP_CASES)
def test_kernel_loops_stay_in_range_and_cover_each_pair_once(B, Lq, Lk, window, packed):
    """Every kernel of both variants at every head dim's tiling: reads within [0, Lq) /
    [0, Lk), each visible pair taken once, no invisible one, mask skipped only where all is
    visible, every output row written once."""
    _simulate_all(B, Lq, Lk, window, packed)


def test_block_ranges_with_fewer_queries_than_keys():
    """The crash case's ranges, as values: the 29 key blocks of 128 left of every window get
    the empty range [0, 0]; the last query block's keys start at its window."""
    kr, qr = flash.block_ranges(130, 4096, 200, 64, 128)
    assert kr.tolist() == [[3767, 4030], [3831, 4094], [3895, 4096]]
    assert (qr[:29] == 0).all()
    assert qr[29:].tolist() == [[0, 73], [0, 130], [2, 130]]


@pytest.mark.parametrize("tiles", ["v1", "v2-256", "v2-512"])
@pytest.mark.parametrize("B,Lq,Lk,window,packed", [
    (1, 40, 700, 50, False), (1, 130, 600, 200, False), (2, 60, 500, 30, True),
    (2, 70, 400, None, True)])
def test_blocked_algorithm_with_fewer_queries_than_keys(B, Lq, Lk, window, packed, tiles):
    """The blocked forward and backward (the kernels' ranges and loops) equal dense attention
    when queries are the last Lq of Lk keys, with a window or packed examples; keys no query
    sees get dK = dV = 0."""
    mx.random.seed(2)
    D = 8
    q = mx.random.normal((B, 2, Lq, D))
    k = mx.random.normal((B, 1, Lk, D))
    v = mx.random.normal((B, 1, Lk, D))
    do = mx.random.normal((B, 2, Lq, D))
    scale = D ** -0.5
    seg = _segments(B, Lk, 3) if packed else None
    blocks = Blocks(seg) if packed else None
    vis = _dense_visible(Lq, Lk, window, seg)
    if tiles == "v1":
        fwd, bwd = dict(bk=32), dict(bkv=128, bq=64)
    else:
        cfg = V2_TILES[int(tiles[3:])]
        fwd = dict(bk=cfg["fwd_bk"], bq=cfg["fwd_bq"])
        bwd = dict(bkv=cfg["bkv"], bq=cfg["dkdv_bq"], dq_tiles=(cfg["dq_bq"], cfg["dq_bk"]))

    o, lse = reference_forward(q, k, v, scale, window, blocks, **fwd)
    want_o, want_lse = _dense(q, k, v, scale, vis)
    tol = 4 * Lk * EPS
    assert mx.abs(o - want_o).max().item() <= tol * mx.abs(v).max().item()
    assert mx.abs(lse - want_lse).max().item() <= tol * mx.abs(want_lse).max().item()

    got = reference_backward(q, k, v, o, lse, do, scale, window, blocks, **bwd)
    _, want = mx.vjp(lambda q, k, v: _dense(q, k, v, scale, vis)[0], [q, k, v], [do])
    for g, w in zip(got, want):
        assert g.shape == w.shape
        assert mx.abs(g - w).max().item() <= 4 * tol * mx.abs(w).max().item()
    unseen = ~vis.any(axis=(0, 1))
    assert unseen.any()
    for g in got[1:]:
        assert (np.array(g)[:, :, unseen] == 0).all()
