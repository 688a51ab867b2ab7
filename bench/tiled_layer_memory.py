"""Peak memory of one tiled layer's VJP above its inputs, per length: how much of it grows with
L (the whole-sequence arrays the planner's `CostModel._tiled_layer` counts) and how much is one
tile's or one attention chunk's. One JSON line per length, with the planner's whole-sequence
bytes per token for the same layer, and what is alive when the layer's attention backward starts
and its peak during it.

    python bench/tiled_layer_memory.py --model e4b-slice --layer 3 --seq 8192 16384

The layer runs with `EngineOptions` from the flags (tile 1024 unless `--tile`; the device's
defaults otherwise).
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx
from mlx_lm.tuner.utils import linear_to_lora_layers

from segback.benchmark.provenance import append_rows, with_provenance
from segback.engine import EngineOptions, tiled
from segback.engine import options as engine_options
from segback.engine.attention import use_attention
from segback.engine.segmented import _split_trainable
from segback.engine.stack import get_stack
from segback.models.random_init import build_model
from segback.planner import CostModel, read_geometry

# What a single layer's VJP does not use: the whole step's options.
NOT_A_LAYER = ("attention", "offload", "boundaries_on_device", "prefetch", "head_chunk")


def probe_attention_backward(record: list) -> None:
    """Wrap the tiled engine's attention backward: what is alive when it starts (the layer's
    whole-sequence arrays so far) and the peak during it, both in MB above the caller's base."""
    inner = tiled.core_backward

    def wrapped(q, k, v, saved, do, delta, *args, **kw):
        pieces = [x for r in (do, delta) for x in getattr(r, "pieces", [])]
        mx.eval(q, k, v, pieces)
        before, start = mx.get_peak_memory(), mx.get_active_memory()
        mx.reset_peak_memory()
        dq, dk, dv = inner(q, k, v, saved, do, delta, *args, **kw)
        mx.eval(getattr(dq, "pieces", dq), dk, dv)
        record.append((before, start, mx.get_peak_memory(), mx.get_active_memory()))
        return dq, dk, dv

    tiled.core_backward = wrapped


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="e4b-slice")
    p.add_argument("--layer", type=int, default=3, help="layer index (3: a global donor)")
    p.add_argument("--seq", type=int, nargs="+", default=[8192, 16384])
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="default: bfloat16 on the GPU, float32 on the CPU")
    p.add_argument("--out", default=None,
                   help="also append the rows, with their provenance, to this JSON lines file "
                   "(e.g. bench/data/runs.jsonl)")
    p.add_argument("--config-name", default=None, help="row key \"config\"")
    p.add_argument("--run", default=None, help="row key \"run\"")
    engine = p.add_argument_group("engine options (segback.engine.EngineOptions)")
    engine_options.add_arguments(engine, skip=NOT_A_LAYER)
    args = p.parse_args()
    opts = engine_options.from_args(args, EngineOptions(tile=1024), skip=NOT_A_LAYER).resolved()
    record: list = []
    probe_attention_backward(record)

    gpu = mx.default_device() == mx.gpu
    dtype = getattr(mx, args.dtype or ("bfloat16" if gpu else "float32"))
    model = build_model(args.model, dtype=dtype)
    model.freeze()
    linear_to_lora_layers(model, len(model.layers), {"rank": 8, "scale": 20.0, "dropout": 0.0})
    stack = get_stack(model)
    per_layer, _ = _split_trainable(model, stack)
    geom = read_geometry(model)
    i, kind = args.layer, stack.layer_types[args.layer]
    leaves, keys = list(per_layer[i].values()), list(per_layer[i])
    width = model.args.hidden_size
    pli_width = getattr(model.args, "hidden_size_per_layer_input", 0)
    mx.random.seed(0)
    for L in args.seq:
        h = (mx.random.normal((1, L, width)) * 0.5).astype(dtype)
        dh = (mx.random.normal((1, L, width)) * 1e-3).astype(dtype)
        pli = (mx.random.normal((1, L, pli_width)) * 0.1).astype(dtype) if pli_width else None
        mx.eval(model.parameters(), h, dh, pli)
        with use_attention([stack.module]):
            call = tiled.LayerCall(stack, i, stack.masks(h, True)[kind], opts.tile, keys, pli,
                                   None, True, opts.compile, light_tile=opts.light_tile,
                                   share_traces=opts.share_traces,
                                   in_flight=opts.tiles_in_flight)
            mx.clear_cache()
            mx.reset_peak_memory()
            base = mx.get_active_memory()
            tic = time.perf_counter()
            dh_in, _, _, grads = tiled.layer_vjp(call, h, dh, leaves)
            mx.eval(dh_in, grads)
            before, *probe = record[-1]
            peak = max(mx.get_peak_memory(), before, probe[1]) - base
            a_start, a_peak, a_end = (round((x - base) / 2**20, 1) for x in probe)
        whole = CostModel(geom, L, 1, "chunked", tile=opts.tile,
                          light_tile=opts.light_tile).whole_sequence_bytes(geom.layers[i])
        row = {"model": args.model, "layer": i, "kind": kind, "seq": L, "tile": opts.tile,
               "light_tile": opts.light_tile, "compile": opts.compile,
               "share_traces": opts.share_traces, "tiles_in_flight": opts.tiles_in_flight,
               "dtype": str(dtype), "device": str(mx.default_device()),
               "peak_above_inputs_mb": round(peak / 2**20, 1),
               "attention_bwd_start_mb": a_start, "attention_bwd_peak_mb": a_peak,
               "attention_bwd_end_mb": a_end,
               "planner_whole_kb_per_token": round(whole / L / 1024, 1),
               "s": round(time.perf_counter() - tic, 1)}
        print(json.dumps(row), flush=True)
        if args.out:
            append_rows(args.out, [with_provenance(
                row | {"script": "bench/tiled_layer_memory.py"}, args.config_name, args.run)])
        del h, dh, pli, dh_in, grads


if __name__ == "__main__":
    main()
