"""Matmul rates of one e4b layer's linears: 4-bit quantized against bf16, beside the device's peak.

A LoRA step runs each frozen linear three times per token (forward, recompute, the input
gradient `g @ W`), so a step's rate is bounded by these kernels. Prints one JSON line per
(M, shape, kernel) with seconds and TFLOP/s, and the peak of an 8192^3 bf16 matmul:

    python bench/qmm_bench.py --tokens 2048 8192 --out bench/data/runs.jsonl

Kernels: `bf16` x @ W.T; `q4` mx.quantized_matmul(x, Wq, transpose=True) (the forward);
`bf16_t` g @ W and `q4_t` quantized_matmul(g, Wq, transpose=False) (the input gradient);
`dequant` mx.dequantize(Wq) alone (what materializing W in bf16 once costs).
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx

from segback.benchmark.provenance import append_rows, with_provenance

# (name, in_features K, out_features N) of one e4b decoder layer (hidden 2560, 8 x 256 query
# heads, 2 x 256 key/value heads, MLP 10240) and the tied head (vocabulary 262144).
SHAPES = [
    ("q_proj", 2560, 2048),
    ("kv_proj", 2560, 512),
    ("o_proj", 2048, 2560),
    ("gate_up", 2560, 10240),
    ("down", 10240, 2560),
    ("head", 2560, 262144),
]


def timed(fn, repeats: int) -> float:
    """Median seconds of `fn()` evaluated alone (one warm-up first)."""
    mx.eval(fn())
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - tic)
    return sorted(times)[len(times) // 2]


def peak_tflops(n: int = 8192, repeats: int = 10) -> float:
    a = mx.random.normal((n, n)).astype(mx.bfloat16)
    b = mx.random.normal((n, n)).astype(mx.bfloat16)
    mx.eval(a, b)
    return 2 * n**3 / timed(lambda: a @ b, repeats) / 1e12


def measure(M: int, name: str, K: int, N: int, bits: int, group: int, repeats: int) -> list[dict]:
    w = (mx.random.normal((N, K)) * K**-0.5).astype(mx.bfloat16)
    wq, scales, biases = mx.quantize(w, group_size=group, bits=bits)
    x = mx.random.normal((M, K)).astype(mx.bfloat16)
    g = mx.random.normal((M, N)).astype(mx.bfloat16)
    mx.eval(w, wq, scales, biases, x, g)
    q = dict(group_size=group, bits=bits)
    kernels = {
        "bf16": lambda: x @ w.T,
        "q4": lambda: mx.quantized_matmul(x, wq, scales, biases, transpose=True, **q),
        "bf16_t": lambda: g @ w,
        "q4_t": lambda: mx.quantized_matmul(g, wq, scales, biases, transpose=False, **q),
        "dequant": lambda: mx.dequantize(wq, scales, biases, **q),
    }
    rows = []
    for kernel, fn in kernels.items():
        s = timed(fn, repeats)
        flops = 0 if kernel == "dequant" else 2 * M * K * N
        rows.append({"tokens": M, "shape": name, "K": K, "N": N, "kernel": kernel,
                     "bits": bits, "group_size": group, "s": round(s, 7),
                     "tflops": round(flops / s / 1e12, 2) if flops else None})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", help="also append the rows to this JSONL file")
    ap.add_argument("--run", help="label of the rows (row key \"run\")")
    args = ap.parse_args()
    mx.random.seed(0)
    peak = peak_tflops()
    rows = [{"kernel": "peak_bf16_8192", "tflops": round(peak, 1)}]
    print(json.dumps(rows[0]), flush=True)
    for M in args.tokens:
        for name, K, N in SHAPES:
            if M * N >= 2**31:  # mlx-cuda fails to launch kernels on outputs this large
                continue
            rows_now = measure(M, name, K, N, args.bits, args.group_size, args.repeats)
            mx.clear_cache()  # the shape's arrays are gone once measure returns
            for row in rows_now:
                row["peak_fraction"] = (round(row["tflops"] / peak, 3)
                                        if row["tflops"] else None)
                print(json.dumps(row), flush=True)
                rows.append(row)
    if args.out:
        append_rows(args.out, [with_provenance(r | {"script": "qmm_bench"}, run=args.run)
                               for r in rows])


if __name__ == "__main__":
    main()
