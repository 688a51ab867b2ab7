"""Where one tiled layer's time goes: per phase, per tile size, one or two tiles in flight,
against the same layer's mlx-lm forward + VJP at full length (what a checkpointed step does for
each layer). One JSON line per (layer, tile, in-flight) and one per reference layer.

    python bench/tiled_profile.py --model e4b --quant-bits 4 --seq 8192 --tiles 1024 2048

Phases are timed by wrapping the tiled engine's building blocks with a synchronizing timer, so
"post" (the tiles of the post pass and its VJP) is the layer's time minus the others.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.tuner.utils import linear_to_lora_layers

from segback.engine import offload, tiled
from segback.engine.attention import use_chunked_attention
from segback.engine.segmented import _split_trainable
from segback.models.geometry import build_model
from segback.models.stack import get_stack

TIMES: dict[str, float] = defaultdict(float)


def timed(name, fn):
    def wrapper(*args, **kwargs):
        mx.synchronize()
        tic = time.perf_counter()
        out = fn(*args, **kwargs)
        mx.eval([x for _, x in tree_flatten(out) if isinstance(x, mx.array)])
        mx.synchronize()
        TIMES[name] += time.perf_counter() - tic
        return out
    return wrapper


def clock(fn, repeats):
    """Median seconds of fn() (evaluated), after one warm-up call; and the phase split."""
    mx.eval(fn())
    secs, splits = [], []
    for _ in range(repeats):
        TIMES.clear()
        mx.synchronize()
        tic = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        secs.append(time.perf_counter() - tic)
        splits.append(dict(TIMES))
    i = sorted(range(repeats), key=secs.__getitem__)[repeats // 2]
    return secs[i], splits[i]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny-e4b")
    p.add_argument("--quant-bits", type=int, default=None)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--tiles", type=int, nargs="+", default=[512, 1024])
    p.add_argument("--in-flight", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-reference", action="store_true")
    p.add_argument("--step", action="store_true",
                   help="instead: split whole training steps (one-layer segments, offload)")
    p.add_argument("--head-elements", type=int, nargs="+", default=[1 << 26],
                   help="with --step: logits per loss-head chunk")
    args = p.parse_args()

    gpu = mx.default_device() == mx.gpu
    dtype = mx.bfloat16 if gpu else mx.float32
    model = build_model(args.model, dtype=dtype, quantize_bits=args.quant_bits)
    model.freeze()
    linear_to_lora_layers(model, len(model.layers), {"rank": 8, "scale": 20.0, "dropout": 0.0})
    stack = get_stack(model)
    per_layer, _ = _split_trainable(model, stack)
    mx.random.seed(0)
    L, width = args.seq, model.args.hidden_size
    h = (mx.random.normal((1, L, width)) * 0.5).astype(dtype)
    dh = (mx.random.normal((1, L, width)) * 1e-3).astype(dtype)
    pli_width = getattr(model.args, "hidden_size_per_layer_input", 0)
    pli = (mx.random.normal((1, L, pli_width)) * 0.1).astype(dtype) if pli_width else None
    mx.eval(model.parameters(), h, dh, pli)
    if args.step:
        return step_parts(model, args, {"model": args.model, "seq": L})
    # One owning layer of each attention type (sharers differ only in skipping K/V).
    picks = {}
    for i, kind in enumerate(stack.layer_types):
        if stack.kv_source[i] == i:
            picks.setdefault(kind, i)
    meta = {"model": args.model, "seq": L, "mlx": mx.__version__,
            "device": str(mx.default_device())}

    for kind, i in picks.items():
        leaves = list(per_layer[i].values())
        keys = list(per_layer[i])
        if not args.no_reference:  # mlx-lm's layer at full length, fused attention
            mask = stack.masks(h)[kind]

            def f(x, *lv, i=i, keys=keys, mask=mask):
                tiled.bind_layer(stack.layers[i], keys)(list(lv))
                return [stack.layer(i, x, mask, pli)[0]]

            fwd, _ = clock(lambda: f(h, *leaves), args.repeats)
            vjp, _ = clock(lambda: mx.vjp(f, [h, *leaves], [dh])[1], args.repeats)
            tiled.bind_layer(stack.layers[i], keys)(leaves)
            print(json.dumps({**meta, "layer": i, "kind": kind, "path": "mlx-lm",
                              "forward_ms": round(1e3 * fwd, 2), "vjp_ms": round(1e3 * vjp, 2),
                              "layer_ms": round(1e3 * (fwd + vjp), 2)}), flush=True)
        with use_chunked_attention([stack.module]):
            saved = (tiled._pre, tiled.attention_forward, tiled.attention_backward,
                     tiled.IN_FLIGHT)
            tiled._pre = timed("pre", tiled._pre)
            tiled.attention_forward = timed("attn_fwd", tiled.attention_forward)
            tiled.attention_backward = timed("attn_bwd", tiled.attention_backward)
            try:
                for tile in args.tiles:
                    for depth in args.in_flight:
                        tiled.IN_FLIGHT = depth
                        call = tiled.LayerCall(stack, i, stack.masks(h, True)[kind], tile, keys,
                                               pli, None, True, False)
                        fwd, fsplit = clock(lambda: tiled.layer_forward(call, h, leaves)[0],
                                            args.repeats)
                        vjp, vsplit = clock(lambda: tiled.layer_vjp(call, h, dh, leaves)[::3],
                                            args.repeats)
                        split = {f"fwd_{k}": round(1e3 * v, 2) for k, v in fsplit.items()}
                        split.update({f"vjp_{k}": round(1e3 * v, 2) for k, v in vsplit.items()})
                        split["fwd_post"] = round(1e3 * (fwd - sum(fsplit.values())), 2)
                        split["vjp_post"] = round(1e3 * (vjp - sum(vsplit.values())), 2)
                        print(json.dumps({**meta, "layer": i, "kind": kind, "path": "tiled",
                                          "tile": tile, "in_flight": depth,
                                          "forward_ms": round(1e3 * fwd, 2),
                                          "vjp_ms": round(1e3 * vjp, 2),
                                          "layer_ms": round(1e3 * (fwd + vjp), 2),
                                          **split}), flush=True)
            finally:
                (tiled._pre, tiled.attention_forward, tiled.attention_backward,
                 tiled.IN_FLIGHT) = saved


def step_parts(model, args, meta) -> None:
    """Seconds per part of one tiled training step (after a warm-up step), and its peak."""
    from segback.engine import memory_stats, reset_peak, segmented, value_and_grad

    vocab = model.args.vocab_size
    L = args.seq
    batch = mx.random.randint(0, vocab, (1, L + 1))
    lengths = mx.array([[0, L]])
    segments = [[i, i + 1] for i in range(len(model.layers))]
    saved = (tiled.layer_forward, tiled.layer_vjp, segmented.head_vjp, offload.HostStore.put,
             offload.HostStore.get)
    tiled.layer_forward = timed("layer_forward", tiled.layer_forward)
    tiled.layer_vjp = timed("layer_vjp", tiled.layer_vjp)
    segmented.head_vjp = timed("head", segmented.head_vjp)
    offload.HostStore.put = timed("offload_put", offload.HostStore.put)
    offload.HostStore.get = timed("offload_get", offload.HostStore.get)
    try:
        for tile in args.tiles:
            for head in args.head_elements:
                def step():
                    (loss, _), grads = value_and_grad(model, batch, lengths, segments,
                                                      head_max_elements=head, tile=tile,
                                                      offload=True)
                    return loss, grads

                mx.eval(step())
                reset_peak()
                TIMES.clear()
                mx.synchronize()
                tic = time.perf_counter()
                mx.eval(step())
                mx.synchronize()
                total = time.perf_counter() - tic
                parts = {k: round(v, 3) for k, v in TIMES.items()}
                parts["other"] = round(total - sum(TIMES.values()), 3)
                print(json.dumps({**meta, "path": "step", "tile": tile, "head_elements": head,
                                  "in_flight": tiled.IN_FLIGHT, "step_s": round(total, 3),
                                  "peak_gb": round(memory_stats()["peak_gb"], 3), **parts}),
                      flush=True)
    finally:
        (tiled.layer_forward, tiled.layer_vjp, segmented.head_vjp, offload.HostStore.put,
         offload.HostStore.get) = saved


if __name__ == "__main__":
    main()
