"""MLX's CPU elementwise kernels against a multiply: why a CPU training step sits far below the
matmul rate.

Times each op on one [tokens, width] float32 array (a Gemma-3 270M MLP activation at the default
experiment's mean case by default), eager and under mx.compile, and the gradient of GELU (tanh
approximation, as Gemma's MLP uses it), and segback.models.fast_gelu's replacement for it.
One JSON line per op: milliseconds per call and
nanoseconds per element; the last line sets them beside a matmul of the same layer.

    python bench/cpu_kernels.py                     # 1088 x 2048, float32
    python bench/cpu_kernels.py --tokens 4096 --width 2048 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable


def time_ms(fn: Callable, *args, repeats: int) -> float:
    import mlx.core as mx

    mx.eval(fn(*args))  # warm-up (and compilation)
    tic = time.perf_counter()
    for _ in range(repeats):
        mx.eval(fn(*args))
    return (time.perf_counter() - tic) / repeats * 1e3


def main() -> None:
    import mlx.core as mx
    import mlx.nn as nn

    from segback.models.fast_gelu import gelu_approx as fast_gelu

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1088)
    parser.add_argument("--width", type=int, default=2048, help="MLP width (Gemma-3 270M: 2048)")
    parser.add_argument("--hidden", type=int, default=640, help="model width of the matmul")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()

    x = mx.random.normal((args.tokens, args.width))
    h = mx.random.normal((args.tokens, args.hidden))
    w = mx.random.normal((args.hidden, args.width)) * 0.02
    mx.eval(x, h, w)
    c = math.sqrt(2 / math.pi)
    ops: dict[str, Callable] = {
        "multiply": lambda a: a * a,
        "exp": mx.exp,
        "tanh": mx.tanh,
        "sigmoid": mx.sigmoid,
        "gelu_approx": nn.gelu_approx,
        "gelu_approx (x * sigmoid form)": lambda a: a * mx.sigmoid(2 * c * (a + 0.044715 * a**3)),
        "softmax (last axis)": lambda a: mx.softmax(a, axis=-1),
        "grad gelu_approx": mx.grad(lambda a: nn.gelu_approx(a).sum()),
        "segback fast_gelu": fast_gelu,
        "grad segback fast_gelu": mx.grad(lambda a: fast_gelu(a).sum()),
    }
    n = args.tokens * args.width
    rows = {}
    for name, fn in ops.items():
        for compiled in (False, True):
            ms = time_ms(mx.compile(fn) if compiled else fn, x, repeats=args.repeats)
            rows[(name, compiled)] = ms
            print(json.dumps({"op": name, "compiled": compiled, "ms": round(ms, 3),
                              "ns_per_element": round(ms * 1e6 / n, 3),
                              "shape": [args.tokens, args.width],
                              "device": str(mx.default_device()), "mlx": mx.__version__}))
    mm = time_ms(lambda a: a @ w, h, repeats=args.repeats)
    gflops = 2 * args.tokens * args.hidden * args.width / (mm * 1e6)
    print(json.dumps({"op": f"matmul [{args.tokens},{args.hidden}]x[{args.hidden},{args.width}]",
                      "ms": round(mm, 3), "gflops": round(gflops, 1),
                      "gelu_over_matmul": round(rows[("gelu_approx", True)] / mm, 2),
                      "fast_gelu_over_matmul": round(rows[("segback fast_gelu", False)] / mm, 2),
                      "exp_over_multiply": round(rows[("exp", False)] / rows[("multiply", False)],
                                                 1)}))


if __name__ == "__main__":
    main()
