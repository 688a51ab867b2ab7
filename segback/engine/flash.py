"""Flash attention on CUDA for the cases MLX's fused kernel leaves out.

MLX's `mx.fast.scaled_dot_product_attention` runs forward and backward fused (cuDNN) on CUDA only
for head dims up to 128 and a causal or no mask; for Gemma's head dims (256, 512), sliding
windows and packed examples its backward scores every key into [L, L] arrays. This module adds
a flash kernel for those (`flash_attention_cuh`, compiled by MLX's `mx.fast.cuda_kernel`):
online softmax with the row log-sum-exp saved, probabilities recomputed block by block in the
backward, masks described (causal, window, example ids), never materialized.

`segback.engine.flash_reference` runs the same blocked algorithm with MLX ops in float32 (the
same block ranges, the same online softmax and LSE), so the CPU tests check the algorithm the
kernel implements against the chunked path and MLX's autodiff.
"""

from __future__ import annotations

import functools
import warnings
from importlib.resources import files

import mlx.core as mx
import numpy as np

from segback.engine.cuda_build import cached_cubin

HEAD_DIMS = (64, 128, 256, 512)
BQ = 64  # query rows a forward / dQ block holds
LN2 = float(np.log(2.0))


VARIANTS = ("v1", "v2")


@functools.cache
def _source(kind: str = "forward") -> str:
    """The kernel header a kind needs: v1's, and for a v2 kind v1's followed by v2's (which
    reuses v1's helpers); v1's text is unchanged, so its cached binaries stay valid."""
    v1 = (files("segback.engine") / "flash_attention.cuh").read_text()
    if not kind.endswith("_v2"):
        return v1
    return v1 + "\n" + (files("segback.engine") / "flash_attention_v2.cuh").read_text()


def _tiles(D: int) -> dict[str, int]:
    """Block sizes per head dim: each warp's accumulator (16 rows x its columns) must fit the
    registers, and every block must fit shared memory (227 KB on Hopper)."""
    return dict(
        fwd_split=2 if D > 256 else 1,  # V columns per CTA: D / split
        fwd_bk=32 if D > 256 else 64,
        dq_split=2 if D > 256 else 1,
        dq_bk=32 if D >= 256 else 64,
        bkv=16384 // D if D >= 128 else 128,  # keys per dK/dV CTA
        dkdv_bq=32 if D > 256 else 64,
    )


def _tiles_v2(D: int) -> dict[str, int]:
    """v2's block sizes (the register and shared-memory arithmetic is in the report of the
    commit that added them): 128 query rows of 8 warps for D <= 256, and for D = 512 64 rows
    with the output columns split over two warps per 16 rows (WN = 2), all within 227 KB."""
    wide = D > 256
    return dict(
        fwd_bq=64 if wide else 128, fwd_bk=64, fwd_wn=2 if wide else 1,
        dq_bq=64 if wide else 128, dq_bk=32 if D >= 256 else 64, dq_wn=2 if wide else 1,
        bkv=16384 // D if D >= 128 else 128,
        dkdv_bq=32 if wide else 64,
    )


def smem_v2(kind: str, D: int, item: int = 2) -> int:
    """Dynamic shared memory (bytes) of one v2 kernel: the layout its header carves."""
    cfg, sq = _tiles_v2(D), D + 8
    if kind == "forward_v2":
        bq, bk, wn = cfg["fwd_bq"], cfg["fwd_bk"], cfg["fwd_wn"]
        extra = (bq * (bk + 8) * item + wn * bq * 4) if wn > 1 else 0
        return (bq + 2 * bk) * sq * item + extra
    if kind == "dq_v2":
        bq, bk, wn = cfg["dq_bq"], cfg["dq_bk"], cfg["dq_wn"]
        extra = bq * (bk + 8) * item if wn > 1 else 0
        return (2 * bq + 2 * bk) * sq * item + extra
    bkv, bq = cfg["bkv"], cfg["dkdv_bq"]
    return (2 * bkv * sq + 4 * bq * sq + 2 * bkv * (bq + 8)) * item + 4 * bq * 4


def consts_v2(kind: str, D: int, seg: int) -> dict[str, int]:
    """Template constants of one v2 kernel."""
    cfg = _tiles_v2(D)
    if kind == "forward_v2":
        return dict(D=D, BQ=cfg["fwd_bq"], BK=cfg["fwd_bk"], WN=cfg["fwd_wn"], SEG=seg)
    if kind == "dq_v2":
        return dict(D=D, BQ=cfg["dq_bq"], BK=cfg["dq_bk"], WN=cfg["dq_wn"], SEG=seg)
    return dict(D=D, BKV=cfg["bkv"], BQB=cfg["dkdv_bq"], SEG=seg)


def threads_v2(kind: str, D: int) -> int:
    """Threads per CTA of one v2 kernel: 32 per warp, (BQ / 16) x WN warps (dK/dV: 8)."""
    cfg = _tiles_v2(D)
    if kind == "forward_v2":
        return cfg["fwd_bq"] // 16 * cfg["fwd_wn"] * 32
    if kind == "dq_v2":
        return cfg["dq_bq"] // 16 * cfg["dq_wn"] * 32
    return 256


def available() -> bool:
    """Whether the kernel can run here: MLX's CUDA backend, on the default (GPU) device."""
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def supports(queries: mx.array, keys: mx.array) -> bool:
    """Whether this call's shapes and dtype are ones the kernel handles."""
    D = queries.shape[-1]
    return (available() and queries.dtype in (mx.bfloat16, mx.float16)
            and keys.dtype == queries.dtype and D in HEAD_DIMS and keys.shape[-1] == D
            and queries.shape[2] <= keys.shape[2])


def block_ranges(Lq: int, Lk: int, window: int | None, bq: int, bk: int,
                 first: np.ndarray | None = None, last: np.ndarray | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """([query blocks, 2] key ranges, [key blocks, 2] query ranges) that can hold a visible pair.

    Query i sits at key position i + Lk - Lq. `first`/`last` (packed examples): for every key
    position, the first and last position of its example over all rows of the batch. Every
    range is clamped into [0, Lq] / [0, Lk] with lo <= hi: with Lq < Lk a key block that no query
    sees (left of every window, or in an example that ends before the queries start) gets an
    empty range at 0, never a negative start (the kernels round the start down to a block and
    would load query rows before 0).
    """
    off = Lk - Lq
    q0 = np.arange(0, Lq, bq)
    q1 = np.minimum(q0 + bq, Lq)
    k_hi = np.minimum(q1 + off, Lk)
    k_lo = np.zeros_like(q0) if window is None else np.maximum(0, q0 + off - window + 1)
    if first is not None:
        k_lo = np.maximum(k_lo, first[q0 + off])
    k0 = np.arange(0, Lk, bk)
    k1 = np.minimum(k0 + bk, Lk)
    q_lo = np.maximum(0, k0 - off)
    q_hi = np.full_like(k0, Lq) if window is None else np.minimum(Lq, k1 - 1 + window - off)
    if last is not None:
        q_hi = np.minimum(q_hi, last[k1 - 1] + 1 - off)
    q_hi = np.clip(q_hi, 0, Lq)  # < 0: no query sees this key block
    kr = np.stack([k_lo, np.maximum(k_hi, k_lo)], axis=1)
    qr = np.stack([np.minimum(q_lo, q_hi), q_hi], axis=1)
    return kr.astype(np.int32), qr.astype(np.int32)


def effective_window(window: int | None, Lk: int) -> int | None:
    """The window a kernel applies: None where it covers every key."""
    return None if window is None or window >= Lk else int(window)


# kind: (inputs, outputs, the kernel header's function) as (name, type) pairs; "T" is the
# input dtype, "f" float32, "i" int32.
SIGNATURES = {
    "forward": ((("q", "T"), ("k", "T"), ("v", "T"), ("scale", "f"), ("prm", "i"), ("kr", "i"),
                 ("seg", "i")), (("o", "T"), ("lse", "f")), "forward<T, D, DV, BK, SEG, LDSM>"),
    "dkdv": ((("q", "T"), ("k", "T"), ("v", "T"), ("d_o", "T"), ("lse", "f"), ("delta", "f"),
              ("scale", "f"), ("prm", "i"), ("qr", "i"), ("seg", "i")),
             (("dk", "T"), ("dv", "T")), "backward_dkdv<T, D, BKV, BQB, SEG, LDSM>"),
    "dq": ((("q", "T"), ("k", "T"), ("v", "T"), ("d_o", "T"), ("lse", "f"), ("delta", "f"),
            ("scale", "f"), ("prm", "i"), ("kr", "i"), ("seg", "i")),
           (("dq", "T"),), "backward_dq<T, D, DQ, BK, SEG, LDSM>"),
}
SIGNATURES |= {
    "forward_v2": SIGNATURES["forward"][:2] + ("forward_v2<T, D, BQ, BK, WN, SEG>",),
    "dkdv_v2": SIGNATURES["dkdv"][:2] + ("backward_dkdv_v2<T, D, BKV, BQB, SEG>",),
    "dq_v2": SIGNATURES["dq"][:2] + ("backward_dq_v2<T, D, BQ, BK, WN, SEG>",),
}
CUDA_TYPES = {"bfloat16": "__nv_bfloat16", "float16": "__half", "f": "float", "i": "int32_t"}


def _call(kind: str) -> str:
    ins, outs, fn = SIGNATURES[kind]
    return f"::sbflash::{fn}({', '.join(n for n, _ in ins + outs)});"


def kernel_source(kind: str, dtype: str, consts: dict[str, int]) -> tuple[str, str]:
    """(name, source) of one instantiation as a standalone `extern "C"` kernel, with the
    signature `mx.fast.cuda_kernel` would generate (inputs, then outputs)."""
    ins, outs, _ = SIGNATURES[kind]
    T = CUDA_TYPES[dtype]
    name = "segback_flash_" + "_".join([kind, dtype] + [f"{k}{v}" for k, v in consts.items()])

    def ctype(t: str) -> str:
        return T if t == "T" else CUDA_TYPES[t]

    params = [f"const {ctype(t)}* {n}" for n, t in ins] + [f"{ctype(t)}* {n}" for n, t in outs]
    body = "".join(f"  constexpr int {k} = {v};\n" for k, v in consts.items())
    source = ("#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n"
              "typedef unsigned int uint32_t;\ntypedef int int32_t;\n" + _source(kind)
              + f'\nextern "C" __global__ void {name}({", ".join(params)}) {{\n'
              + f"  using T = {T};\n{body}  {_call(kind)}\n}}\n")
    return name, source


@functools.cache
def _precompiled(kind: str, dtype: str, consts: tuple, arch: str) -> tuple[str, bytes] | None:
    """The kernel's name and binary from segback's build (disk-cached), or None to fall back."""
    name, source = kernel_source(kind, dtype, dict(consts))
    try:
        cubin = cached_cubin(source, name, arch)
    except Exception as e:  # noqa: BLE001 - MLX's own JIT path still runs the kernel
        warnings.warn(f"segback: building {name} with NVRTC failed ({e}); compiling it "
                      "through mx.fast.cuda_kernel instead", stacklevel=2)
        return None
    return None if cubin is None else (name, cubin)


@functools.cache
def _jit_kernel(kind: str, smem: int):
    """The same kernel through `mx.fast.cuda_kernel` (MLX compiles it in every process)."""
    ins, outs, _ = SIGNATURES[kind]
    return mx.fast.cuda_kernel(name=f"segback_flash_{kind}", input_names=[n for n, _ in ins],
                               output_names=[n for n, _ in outs], source=_call(kind),
                               header=_source(kind), ensure_row_contiguous=True,
                               shared_memory=smem)


@functools.cache
def _arch() -> str:
    return str(mx.device_info().get("architecture", "sm_90"))


def _launch(kind: str, dtype: mx.Dtype, consts: dict[str, int], inputs: list[mx.array],
            shapes: list, dtypes: list, grid: tuple, threads: int, smem: int) -> list[mx.array]:
    name = str(dtype).split(".")[-1]
    pre = _precompiled(kind, name, tuple(consts.items()), _arch())
    if pre is not None:
        return mx.fast.precompiled_cuda_kernel(
            name=pre[0], compiled_source=pre[1], inputs=inputs, output_shapes=shapes,
            output_dtypes=dtypes, scalars=[], grid=grid, threadgroup=(threads, 1, 1),
            shared_memory=smem, ensure_row_contiguous=True)
    return _jit_kernel(kind, smem)(
        inputs=inputs, output_shapes=shapes, output_dtypes=dtypes, grid=grid,
        threadgroup=(threads, 1, 1), template=[("T", dtype), *consts.items()])


def _masks(B: int, Lq: int, Lk: int, window: int | None, blocks) -> tuple:
    """(window, seg ids [B, Lk] int32 or a placeholder, first, last) for the kernels."""
    if blocks is None:
        return effective_window(window, Lk), mx.zeros((1,), mx.int32), None, None
    return (effective_window(window, Lk), blocks.ids.astype(mx.int32), blocks.first, blocks.last)


def _params(q: mx.array, k: mx.array, window: int | None) -> mx.array:
    B, H, Lq, _ = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    return mx.array([B, H, Hkv, Lq, Lk, Lk - Lq, window or 0], mx.int32)


def flash_forward(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                  window: int | None = None, blocks=None, ldsm: bool = True,
                  variant: str = "v1") -> tuple[mx.array, mx.array]:
    """(output [B, H, Lq, D], row log-sum-exp [B, H, Lq] float32) on CUDA. `ldsm`: B operands
    through ldmatrix (False: plain 16-bit shared loads, for comparison; v1 only). `variant`:
    "v1" (the measured kernels) or "v2" (cp.async-pipelined, 128-row blocks; see
    flash_attention_v2.cuh)."""
    if variant == "v2":
        return _forward_v2(queries, keys, values, scale, window, blocks)
    B, H, Lq, D = queries.shape
    Lk = keys.shape[2]
    window, seg, first, last = _masks(B, Lq, Lk, window, blocks)
    cfg = _tiles(D)
    split, bk = cfg["fwd_split"], cfg["fwd_bk"]
    dv = D // split
    kr, _ = block_ranges(Lq, Lk, window, BQ, bk, first, last)
    item = queries.dtype.size
    smem = (BQ * (D + 8) + bk * (D + 8) + bk * (dv + 8)) * item
    nqb = -(-Lq // BQ)
    o, lse = _launch(
        "forward", queries.dtype,
        dict(D=D, DV=dv, BK=bk, SEG=int(blocks is not None), LDSM=int(ldsm)),
        [queries, keys, values, mx.array([scale], mx.float32), _params(queries, keys, window),
         mx.array(kr), seg],
        [(B, H, Lq, D), (B, H, Lq)], [queries.dtype, mx.float32], (nqb * 128, B * H, split),
        128, smem)
    return o, lse


def _forward_v2(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                window: int | None, blocks) -> tuple[mx.array, mx.array]:
    B, H, Lq, D = queries.shape
    Lk = keys.shape[2]
    window, seg, first, last = _masks(B, Lq, Lk, window, blocks)
    cfg, kind = _tiles_v2(D), "forward_v2"
    kr, _ = block_ranges(Lq, Lk, window, cfg["fwd_bq"], cfg["fwd_bk"], first, last)
    threads = threads_v2(kind, D)
    return tuple(_launch(
        kind, queries.dtype, consts_v2(kind, D, int(blocks is not None)),
        [queries, keys, values, mx.array([scale], mx.float32), _params(queries, keys, window),
         mx.array(kr), seg],
        [(B, H, Lq, D), (B, H, Lq)], [queries.dtype, mx.float32],
        (len(kr) * threads, B * H, 1), threads, smem_v2(kind, D, queries.dtype.size)))


def _delta(output: mx.array | None, d_output: mx.array, delta: mx.array | None,
           shape: tuple[int, int, int]) -> mx.array:
    """rowsum(dO * O) in float32 [B, H, Lq], unless the caller has it already."""
    if delta is None:
        delta = (d_output.astype(mx.float32) * output.astype(mx.float32)).sum(-1)
    return delta.reshape(shape)


def flash_backward(queries: mx.array, keys: mx.array, values: mx.array, output: mx.array | None,
                   lse: mx.array, d_output: mx.array, scale: float, window: int | None = None,
                   blocks=None, delta: mx.array | None = None, ldsm: bool = True,
                   variant: str = "v1") -> tuple[mx.array, mx.array, mx.array]:
    """(dQ, dK, dV) from the forward's LSE; `delta` = rowsum(dO * O) [B, H, Lq] float32 (computed
    from `output` when not given). `variant`: as `flash_forward`'s."""
    if variant == "v2":
        return _backward_v2(queries, keys, values, output, lse, d_output, scale, window,
                            blocks, delta)
    B, H, Lq, D = queries.shape
    Hkv, Lk = keys.shape[1], keys.shape[2]
    window, seg, first, last = _masks(B, Lq, Lk, window, blocks)
    delta = _delta(output, d_output, delta, (B, H, Lq))
    cfg = _tiles(D)
    item = queries.dtype.size
    d_output = d_output.astype(queries.dtype)
    scale_a = mx.array([scale], mx.float32)
    prm = _params(queries, keys, window)

    bkv, bqb = cfg["bkv"], cfg["dkdv_bq"]
    _, qr = block_ranges(Lq, Lk, window, bqb, bkv, first, last)
    smem = (2 * bkv * (D + 8) + 2 * bqb * (D + 8) + 2 * bkv * (bqb + 8)) * item + 2 * bqb * 4
    seg_on = int(blocks is not None)
    dk, dv = _launch(
        "dkdv", queries.dtype, dict(D=D, BKV=bkv, BQB=bqb, SEG=seg_on, LDSM=int(ldsm)),
        [queries, keys, values, d_output, lse, delta, scale_a, prm, mx.array(qr), seg],
        [keys.shape, values.shape], [keys.dtype, values.dtype],
        (-(-Lk // bkv) * 256, B * Hkv, 1), 256, smem)

    split, bk = cfg["dq_split"], cfg["dq_bk"]
    kr, _ = block_ranges(Lq, Lk, window, BQ, bk, first, last)
    smem = (2 * BQ * (D + 8) + 2 * bk * (D + 8)) * item
    (dq,) = _launch(
        "dq", queries.dtype, dict(D=D, DQ=D // split, BK=bk, SEG=seg_on, LDSM=int(ldsm)),
        [queries, keys, values, d_output, lse, delta, scale_a, prm, mx.array(kr), seg],
        [queries.shape], [queries.dtype], (-(-Lq // BQ) * 128, B * H, split), 128, smem)
    return dq, dk, dv


def _backward_v2(queries: mx.array, keys: mx.array, values: mx.array, output: mx.array | None,
                 lse: mx.array, d_output: mx.array, scale: float, window: int | None, blocks,
                 delta: mx.array | None) -> tuple[mx.array, mx.array, mx.array]:
    B, H, Lq, D = queries.shape
    Hkv, Lk = keys.shape[1], keys.shape[2]
    window, seg, first, last = _masks(B, Lq, Lk, window, blocks)
    delta = _delta(output, d_output, delta, (B, H, Lq))
    cfg, item, seg_on = _tiles_v2(D), queries.dtype.size, int(blocks is not None)
    d_output = d_output.astype(queries.dtype)
    common = [mx.array([scale], mx.float32), _params(queries, keys, window)]
    ins = [queries, keys, values, d_output, lse, delta]

    _, qr = block_ranges(Lq, Lk, window, cfg["dkdv_bq"], cfg["bkv"], first, last)
    dk, dv = _launch(
        "dkdv_v2", queries.dtype, consts_v2("dkdv_v2", D, seg_on),
        ins + common + [mx.array(qr), seg], [keys.shape, values.shape],
        [keys.dtype, values.dtype], (len(qr) * 256, B * Hkv, 1), 256,
        smem_v2("dkdv_v2", D, item))

    kr, _ = block_ranges(Lq, Lk, window, cfg["dq_bq"], cfg["dq_bk"], first, last)
    threads = threads_v2("dq_v2", D)
    (dq,) = _launch(
        "dq_v2", queries.dtype, consts_v2("dq_v2", D, seg_on),
        ins + common + [mx.array(kr), seg], [queries.shape], [queries.dtype],
        (len(kr) * threads, B * H, 1), threads, smem_v2("dq_v2", D, item))
    return dq, dk, dv


def _make_flash(scale: float, window: int | None, blocks=None, ldsm: bool = True,
                variant: str = "v1"):
    @mx.custom_function
    def attend(queries, keys, values):
        return flash_forward(queries, keys, values, scale, window, blocks, ldsm, variant)

    @attend.vjp
    def attend_vjp(primals, cotangents, outputs):
        queries, keys, values = primals
        o, lse = outputs
        return flash_backward(queries, keys, values, o, lse, cotangents[0], scale, window,
                              blocks, ldsm=ldsm, variant=variant)

    return attend


@functools.cache
def _cached_flash(scale: float, window: int | None, ldsm: bool, variant: str = "v1"):
    return _make_flash(scale, window, ldsm=ldsm, variant=variant)


def flash_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                    window: int | None = None, blocks=None, ldsm: bool = True,
                    variant: str = "v1") -> mx.array:
    """Causal (optionally sliding-window, optionally packed) attention with the flash kernels'
    forward and backward; layout as `mx.fast.scaled_dot_product_attention`. `variant`: "v1"
    (default, the measured kernels) or "v2"."""
    if variant not in VARIANTS:
        raise ValueError(f"flash variant {variant!r}: one of {VARIANTS}")
    window = effective_window(window, keys.shape[2])
    fn = _make_flash(float(scale), window, blocks, ldsm, variant) if blocks is not None else \
        _cached_flash(float(scale), window, ldsm, variant)
    return fn(queries, keys, values)[0]
