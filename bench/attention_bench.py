"""Attention forward+backward per kernel: time, peak memory, FLOP rate and errors.

One JSON line per (L, mask, path). Paths:
  fused    what the engine runs with attention="fused" (`segback.engine.attention.fused_sdpa`:
           MLX's fused kernel where it covers the call, else segback's flash kernel on CUDA,
           else mlx-lm's own path); the row's `kernel` says which ran
  mlx      mx.fast.scaled_dot_product_attention with the mask mlx-lm passes ("causal", or a
           boolean window mask): whether MLX itself runs the case fused shows in its peak
  flash    segback's flash kernel (CUDA only), once per `--flash-variant` (v1: the measured
           kernels, v2: cp.async-pipelined; the row's `variant`); flash-plain: v1 with its B
           operands through 16-bit shared loads instead of ldmatrix
  chunked  segback's chunked kernel of MLX ops
Peak is measured above the resting inputs. FLOPs: the causal (or windowed) forward's
4·H·D·keys·L·B, times 3.5 for forward + backward (dQ, dK, dV, dP); `hw_fraction` is the rate
over the device's measured bf16 matmul rate. With `--check-max-len`, rows up to that length also
carry each output's and gradient's error against a float32 reference (the chunked kernel on the
inputs upcast): `err_*` = max |x - ref| / max |ref|.

    python bench/attention_bench.py --device gpu --dtype bfloat16 --heads 8 --kv-heads 2 \
        --head-dim 256 --windows 0 512 --lengths 8192 32768 --paths fused chunked

    # v1 against v2 of the flash kernels, time and exactness, one process:
    python bench/attention_bench.py --device gpu --dtype bfloat16 --heads 8 --kv-heads 2 \
        --head-dim 256 --windows 0 512 --lengths 8192 32768 --paths flash chunked \
        --flash-variant v1 v2 --check-max-len 8192
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask

from segback.benchmark.provenance import append_rows, with_provenance
from segback.engine import flash
from segback.engine.masks import Blocks, MaskSpec
from segback.engine.chunked import chunked_sdpa, default_chunk_size
from segback.engine.attention import fused_kernel, fused_sdpa
from segback.planner.flops import matmul_peak, mean_keys


def _packed_ids(B: int, L: int, example: int):
    import numpy as np

    return np.broadcast_to(np.arange(L) // example, (B, L)).astype(np.int32)


def attention_fn(path: str, scale: float, window: int | None, blocks, chunk: int | None,
                 variant: str = "v1"):
    def fn(q, k, v):
        if path == "fused":
            spec = MaskSpec("causal" if window is None else "sliding", window, blocks=blocks)
            return fused_sdpa(q, k, v, scale, spec)
        if path in ("flash", "flash-plain"):
            return flash.flash_attention(q, k, v, scale, window, blocks,
                                         ldsm=path == "flash", variant=variant)
        if path == "mlx":
            if blocks is not None:
                mask = blocks.dense(window)
            elif window is None:
                mask = "causal"
            else:
                mask = create_causal_mask(q.shape[2], window_size=window)
            return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
        return chunked_sdpa(q, k, v, scale, window=window, chunk_size=chunk, blocks=blocks)
    return fn


def _errors(fn, q, k, v, ct, scale, window, blocks) -> dict:
    ref = attention_fn("chunked", scale, window, blocks, None)
    f32 = [x.astype(mx.float32) for x in (q, k, v, ct)]
    want_o, want_g = mx.vjp(ref, f32[:3], [f32[3]])
    got_o, got_g = mx.vjp(fn, [q, k, v], [ct])
    out = {}
    for name, g, w in zip(("o", "dq", "dk", "dv"), [got_o[0], *got_g], [want_o[0], *want_g]):
        err = mx.abs(g.astype(mx.float32) - w).max() / mx.abs(w).max()
        out[f"err_{name}"] = float(f"{err.item():.3g}")
    return out


def measure(path: str, L: int, window: int | None, args, variant: str = "v1") -> dict:
    B, H, Hkv, D = args.batch, args.heads, args.kv_heads, args.head_dim
    dtype = getattr(mx, args.dtype)
    mx.random.seed(0)
    q, k, v, ct = (
        mx.random.normal(shape).astype(dtype)
        for shape in ((B, H, L, D), (B, Hkv, L, D), (B, Hkv, L, D), (B, H, L, D))
    )
    mx.eval(q, k, v, ct)
    scale = D**-0.5
    blocks = Blocks(_packed_ids(B, L, args.packed)) if args.packed else None
    chunk = args.chunk or default_chunk_size(B, H, L, L, window)
    fn = attention_fn(path, scale, window, blocks, chunk, variant)
    kernel = {"fused": fused_kernel(q, k, window, blocks), "flash": "flash", "mlx": "mlx",
              "flash-plain": "flash", "chunked": "chunked"}[path]

    row = dict(path=path, kernel=kernel, L=L, mask="causal" if window is None else
               f"window={window}", packed=args.packed, B=B, H=H, Hkv=Hkv, D=D,
               dtype=args.dtype, device=str(mx.default_device()),
               chunk=chunk if kernel == "chunked" else None,
               variant=variant if path == "flash" else None)
    try:
        times, peak = [], 0
        for _ in range(args.repeats):
            mx.clear_cache()
            base = mx.get_active_memory()
            mx.reset_peak_memory()
            tic = time.perf_counter()
            out, grads = mx.vjp(fn, [q, k, v], [ct])
            mx.eval(out, grads)
            times.append(time.perf_counter() - tic)
            peak = max(peak, mx.get_peak_memory() - base)
            del out, grads
    except Exception as e:  # a kernel that fails or does not fit: the row says so
        return row | {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    keys = mean_keys(L, window)
    flops = 3.5 * 4 * B * H * D * keys * L
    seconds = min(times)
    row |= dict(peak_mb=round(peak / 2**20, 1), seconds=round(seconds, 5),
                first_s=round(times[0], 4), flops=flops,
                tflops=round(flops / seconds / 1e12, 2))
    if mx.default_device() == mx.gpu:
        row["hw_fraction"] = round(flops / seconds / matmul_peak(dtype), 3)
    if args.check_max_len and L <= args.check_max_len:
        row |= _errors(fn, q, k, v, ct, scale, window, blocks)
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--windows", type=int, nargs="+", default=[0, 256], help="0 = causal")
    p.add_argument("--paths", nargs="+", default=["fused", "chunked"],
                   choices=["fused", "mlx", "flash", "flash-plain", "chunked"])
    p.add_argument("--flash-variant", nargs="+", default=["v1"], choices=list(flash.VARIANTS),
                   help="the flash path's kernels: one row per variant")
    p.add_argument("--packed", type=int, default=0,
                   help="packed rows: examples of this many tokens each (0 = one sequence)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--chunk", type=int, default=None, help="default: default_chunk_size")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--check-max-len", type=int, default=0,
                   help="rows up to this length carry errors against a float32 reference")
    p.add_argument("--device", choices=["cpu", "gpu"], default=None)
    p.add_argument("--out", default=None,
                   help="also append the rows, with their provenance, to this JSON lines file "
                   "(e.g. bench/data/runs.jsonl)")
    p.add_argument("--config-name", default=None, help="row key \"config\"")
    p.add_argument("--run", default=None, help="row key \"run\"")
    args = p.parse_args()
    if args.device:
        mx.set_default_device(getattr(mx, args.device))
    for L in args.lengths:
        for w in args.windows:
            for path in args.paths:
                for variant in args.flash_variant if path == "flash" else ["v1"]:
                    row = measure(path, L, w or None, args, variant)
                    print(json.dumps(row), flush=True)
                    if args.out:
                        append_rows(args.out, [with_provenance(
                            row | {"script": "bench/attention_bench.py"}, args.config_name,
                            args.run)])


if __name__ == "__main__":
    main()
