"""The engine's loss and LoRA gradients with the fused attention kernels against the chunked ones.

Builds a random geometry (4-bit, LoRA rank 8 on every linear of every layer, bf16), then runs one
`segback.engine.value_and_grad` per attention option on the same batch, untiled and tiled, and
prints one JSON row per (model, engine, attention): the loss, the kernels that ran, the step's
time and peak, and against the chunked run the loss difference and the largest relative
gradient error over the LoRA leaves (||g - g_chunked|| / ||g_chunked||).

    python bench/fast_path_check.py --models llama-3.1-8b e4b --seq 8192 --out rows.jsonl
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map
from mlx_lm.tuner.utils import linear_to_lora_layers

from segback.benchmark.provenance import append_rows, with_provenance
from segback.benchmark.worker import bench_batch
from segback.engine import EngineOptions, memory_stats, reset_peak, value_and_grad
from segback.models.dequant_linear import use_dequantized_matmul
from segback.models.random_init import build_model
from segback.planner.cost import CostModel
from segback.planner.geometry import read_geometry


def run(model, batch, lengths, segments, opts) -> tuple[dict, float, float, float]:
    reset_peak()
    tic = time.perf_counter()
    (loss, _), grads = value_and_grad(model, batch, lengths, segments, opts)
    mx.eval(loss, grads)
    seconds = time.perf_counter() - tic
    flat = dict(tree_flatten(grads))
    return flat, float(loss), seconds, memory_stats()["peak_gb"]


def check(name: str, seq: int, per_segment: int, tile: int, args) -> list[dict]:
    dtype = mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
    model = build_model(name, dtype=dtype, quantize_bits=args.quant_bits)
    use_dequantized_matmul(model)
    model.freeze()
    linear_to_lora_layers(model, len(model.layers), {"rank": 8, "scale": 20.0, "dropout": 0.0})
    mx.random.seed(1)  # LoRA's B is zero at init: give every factor values
    model.update(tree_map(lambda p: (mx.random.normal(p.shape) * 0.02).astype(p.dtype),
                          model.trainable_parameters()))
    mx.eval(model.parameters())
    batch, lengths = bench_batch(1, seq, model.args.vocab_size, 0.0, None, True)
    geom = read_geometry(model, 8, None, str(dtype).split(".")[-1], name)
    rows = []
    ref = None  # the untiled chunked run: every other row is compared with it
    for engine, t in (("untiled", None), ("tiled", tile)):
        for attention in ("chunked", "fused"):
            opts = EngineOptions(attention=attention, tile=t)
            grads, loss, seconds, peak = run(model, batch, lengths, per_segment, opts)
            # the second run of a pair: warm kernels
            grads, loss, seconds, peak = run(model, batch, lengths, per_segment, opts)
            cost = CostModel(geom, seq, 1, attention, tile=t)
            row = dict(model=name, seq=seq, engine=engine, tile=t, attention=attention,
                       kernels=dict(Counter(cost.kernel(g) for g in geom.layers)),
                       loss=loss, seconds=round(seconds, 3), peak_gb=round(peak, 3),
                       layers_per_segment=per_segment)
            if ref is None:
                ref = (grads, loss)
            else:
                errs = []
                for k, g in grads.items():
                    want = ref[0][k].astype(mx.float32)
                    denom = mx.linalg.norm(want).item()
                    if denom > 0:
                        errs.append(mx.linalg.norm(g.astype(mx.float32) - want).item() / denom)
                row |= dict(loss_diff=abs(loss - ref[1]), max_grad_rel_err=max(errs),
                            median_grad_rel_err=sorted(errs)[len(errs) // 2])
            print(json.dumps(row), flush=True)
            rows.append(row)
            del grads
            mx.clear_cache()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["llama-3.1-8b", "e4b"])
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--layers-per-segment", type=int, default=4)
    ap.add_argument("--tile", type=int, default=2048)
    ap.add_argument("--quant-bits", type=int, default=4)
    ap.add_argument("--out", default=None)
    ap.add_argument("--config-name", default="fast-path-check")
    ap.add_argument("--run", default=None)
    args = ap.parse_args()
    for name in args.models:
        rows = check(name, args.seq, args.layers_per_segment, args.tile, args)
        if args.out:
            append_rows(args.out, [with_provenance(r | {"script": "bench/fast_path_check.py"},
                                                   args.config_name, args.run) for r in rows])


if __name__ == "__main__":
    main()
