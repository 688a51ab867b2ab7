"""Peak memory and time of attention forward+backward: mx.fast (fused) vs segback's chunked_sdpa.

Prints one JSON line per (L, mask, path). Peak is measured above the resting inputs.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \
        .venv/bin/python bench/attention_bench.py --lengths 1024 2048 4096

e4b-like on a GPU: --device gpu --dtype bfloat16 --heads 8 --kv-heads 2 --head-dim 256
--windows 0 512 (with MLX_MAX_OPS_PER_BUFFER=4 in the environment to bound CUDA's in-flight work).
`--fused-forward` / `--no-fused-forward` is `chunked_sdpa(..., fused_forward=)`: the causal
forward through mx.fast (default: on Metal only); the rows record what ran.
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask

from segback.bench import append_rows, with_provenance
from segback.engine.attention import chunked_sdpa, default_chunk_size


def fused(q, k, v, scale, window):
    mask = "causal" if window is None else create_causal_mask(q.shape[2], window_size=window)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def measure(path, L, window, args) -> dict:
    B, H, Hkv, D = args.batch, args.heads, args.kv_heads, args.head_dim
    dtype = getattr(mx, args.dtype)
    mx.random.seed(0)
    q, k, v, ct = (
        mx.random.normal(shape).astype(dtype)
        for shape in ((B, H, L, D), (B, Hkv, L, D), (B, Hkv, L, D), (B, H, L, D))
    )
    mx.eval(q, k, v, ct)
    scale = D**-0.5
    chunk = args.chunk or default_chunk_size(B, H, L, L, window)

    def fn(q, k, v):
        if path == "fused":
            return fused(q, k, v, scale, window)
        return chunked_sdpa(q, k, v, scale, window=window, chunk_size=chunk,
                            fused_forward=args.fused_forward)

    # What chunked_sdpa runs: its forward goes through mx.fast when asked (default: Metal) for
    # causal attention on the GPU.
    asked = mx.metal.is_available() if args.fused_forward is None else args.fused_forward
    fused_forward = asked and window is None and mx.default_device() == mx.gpu

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
    return dict(
        path=path, L=L, mask="causal" if window is None else f"window={window}",
        chunk=None if path == "fused" else chunk,
        fused_forward=None if path == "fused" else fused_forward,
        B=B, H=H, Hkv=Hkv, D=D, dtype=args.dtype,
        device=str(mx.default_device()), peak_mb=round(peak / 2**20, 1),
        seconds=round(min(times), 4),
    )


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--windows", type=int, nargs="+", default=[0, 256], help="0 = causal")
    p.add_argument("--paths", nargs="+", default=["fused", "chunked"], choices=["fused", "chunked"])
    p.add_argument("--fused-forward", action=argparse.BooleanOptionalAction, default=None,
                   help="chunked: causal forward through mx.fast (default: on Metal only)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--chunk", type=int, default=None, help="default: default_chunk_size")
    p.add_argument("--repeats", type=int, default=2)
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
                row = measure(path, L, w or None, args)
                print(json.dumps(row), flush=True)
                if args.out:
                    append_rows(args.out, [with_provenance(
                        row | {"script": "bench/attention_bench.py"}, args.config_name,
                        args.run)])


if __name__ == "__main__":
    main()
