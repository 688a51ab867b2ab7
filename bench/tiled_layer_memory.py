"""Peak memory of one tiled layer's VJP above its inputs, per length: how much of it grows with
L (the whole-sequence arrays the planner's `CostModel._tiled_layer` counts) and how much is one
tile's or one attention chunk's. One JSON line per length, with the planner's whole-sequence
bytes per token for the same layer.

    python bench/tiled_layer_memory.py --model e4b-slice --layer 3 --seq 8192 16384
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx
from mlx_lm.tuner.utils import linear_to_lora_layers

from segback.engine import tiled
from segback.engine.attention import use_chunked_attention
from segback.engine.segmented import _split_trainable
from segback.models.geometry import build_model
from segback.models.stack import get_stack
from segback.planner import CostModel, read_geometry


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="e4b-slice")
    p.add_argument("--layer", type=int, default=3, help="layer index (3: a global donor)")
    p.add_argument("--seq", type=int, nargs="+", default=[8192, 16384])
    p.add_argument("--tile", type=int, default=1024)
    args = p.parse_args()

    dtype = mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
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
        with use_chunked_attention([stack.module]):
            call = tiled.LayerCall(stack, i, stack.masks(h, True)[kind], args.tile, keys, pli,
                                   None, True, False)
            mx.clear_cache()
            mx.reset_peak_memory()
            base = mx.get_active_memory()
            tic = time.perf_counter()
            dh_in, _, _, grads = tiled.layer_vjp(call, h, dh, leaves)
            mx.eval(dh_in, grads)
            peak = mx.get_peak_memory() - base
        whole = CostModel(geom, L, 1, "chunked", None, args.tile).whole_sequence_bytes(
            geom.layers[i])
        print(json.dumps({"model": args.model, "layer": i, "kind": kind, "seq": L,
                          "tile": args.tile, "dtype": str(dtype), "mlx": mx.__version__,
                          "device": str(mx.default_device()),
                          "peak_above_inputs_mb": round(peak / 2**20, 1),
                          "planner_whole_kb_per_token": round(whole / L / 1024, 1),
                          "s": round(time.perf_counter() - tic, 1)}), flush=True)
        del h, dh, pli, dh_in, grads


if __name__ == "__main__":
    main()
