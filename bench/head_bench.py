"""Time the loss head alone, fused against autodiff (segback.engine.head.head_vjp).

    python bench/head_bench.py --model dense-256 --seq 2048 --runs 5
    python bench/head_bench.py --model e4b-slice --seq 2048 --runs 5

Random hidden states stand in for the last layer's output; only the head's weights are built
(the model is left lazy, so the layers never materialize). Both paths run in one process,
alternating, after a warm-up each (compile); wall and CPU seconds (`time.process_time`, all
threads: steadier than wall time where other processes share the cores) are medians of
`--runs`, peak the largest `mx.get_peak_memory()` above the resting memory over the runs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
import numpy as np

from segback.benchmark.provenance import append_rows, with_provenance
from segback.engine.head import DEFAULT_MAX_ELEMENTS, head_vjp
from segback.engine.stack import get_stack
from segback.models.random_init import build_model

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="dense-256", help="a segback.models.random_init name")
    p.add_argument("--seq", type=int, default=2048, help="tokens in the row (T)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=0,
                   help="targets before this step do not count (B=1: rows stay one range)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--bits", type=int, default=None, help="quantize the LM head / embedding")
    p.add_argument("--max-elements", type=int, default=DEFAULT_MAX_ELEMENTS)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--out", default=None, help="append one row per path to this JSON lines file")
    p.add_argument("--config-name", default=None, help="row key \"config\"")
    p.add_argument("--run", default=None, help="row key \"run\"")
    return p.parse_args(argv)


def timed(fn) -> tuple[float, float, float]:
    """Wall seconds, CPU seconds and peak GB (2^30 bytes, above what was active before) of
    one call."""
    mx.synchronize()
    rest = mx.get_active_memory()
    mx.reset_peak_memory()
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    mx.eval(out)
    mx.synchronize()
    return (time.perf_counter() - t0, time.process_time() - c0,
            (mx.get_peak_memory() - rest) / 2**30)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    dtype = DTYPES[args.dtype]
    model = build_model(args.model, dtype=dtype, quantize_bits=args.bits, materialize=False)
    stack = get_stack(model)
    head = stack.head
    V = model.args.vocab_size
    B, T = args.batch, args.seq + 1
    mx.random.seed(0)
    h = mx.random.normal((B, T - 1, model.args.hidden_size)).astype(dtype)
    batch = mx.random.randint(0, V, (B, T))
    lengths = np.array([[args.prompt, T]] * B)
    xs = h[0, :1]
    mx.eval(h, batch, head(xs))  # materializes the head's weights only

    def run(fused: bool):
        return lambda: head_vjp(head, h, batch, lengths, V, max_elements=args.max_elements,
                                fused=fused)[::2]

    paths = {"autodiff": run(False), "fused": run(True)}
    results: dict[str, list[tuple[float, float, float]]] = {k: [] for k in paths}
    losses = {k: float(f()[0]) for k, f in paths.items()}  # warm-up (compile)
    for _ in range(args.runs):
        for k, f in paths.items():
            results[k].append(timed(f))
    print(f"model={args.model} vocab={V} hidden={model.args.hidden_size} dtype={args.dtype} "
          f"bits={args.bits} B={B} tokens={args.seq} prompt={args.prompt} "
          f"softcap={head.softcap} runs={args.runs}")
    base = [statistics.median(r[i] for r in results["autodiff"]) for i in (0, 1)]
    out = []
    for k, rows in results.items():
        wall, cpu = (statistics.median(r[i] for r in rows) for i in (0, 1))
        peak = max(r[2] for r in rows)
        print(f"  {k:9s} wall {wall:6.2f} s ({', '.join(f'{r[0]:.2f}' for r in rows)})  "
              f"cpu {cpu:6.2f} s  peak +{peak:.3f} GB  loss {losses[k]:.6f}  "
              f"speed-up wall {base[0] / wall:.2f}x cpu {base[1] / cpu:.2f}x")
        out.append(dict(script="bench/head_bench.py", path=k, model=args.model, seq=args.seq,
                        batch=B, dtype=args.dtype, bits=args.bits, vocab=V, seconds=wall,
                        cpu_seconds=cpu, peak_gb=round(peak, 3), loss=losses[k],
                        speedup=round(base[0] / wall, 3), device=str(mx.default_device())))
    if args.out:
        append_rows(args.out, [with_provenance(r, args.config_name, args.run) for r in out])


if __name__ == "__main__":
    main()
