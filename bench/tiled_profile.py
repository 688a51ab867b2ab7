"""Where one tiled layer's time goes: per phase, per tile size, one or two tiles in flight,
against the same layer's mlx-lm forward + VJP at full length (what a checkpointed step does for
each layer). One JSON line per (layer, tile, tiles in flight) and one per reference layer.

    python bench/tiled_profile.py --model e4b --quant-bits 4 --seq 8192 --tiles 1024 2048
    python bench/tiled_profile.py --model e4b --quant-bits 4 --seq 8192 --step --tiles 2048

Phases are timed by wrapping the tiled engine's building blocks with a synchronizing timer, so
"post" (the tiles of the post pass and its VJP) is the layer's time minus the others. `--step`
splits whole training steps (one-layer segments, offload) into layer forwards, layer VJPs, the
loss head and the copies to and from host memory. The engine runs with `EngineOptions` built
from the flags (the device's defaults otherwise: compiled tile functions on the CPU, eager on
CUDA); `--tiles`, `--tiles-in-flight` and `--head-chunks` are swept.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.tuner.utils import linear_to_lora_layers

from segback.benchmark.provenance import append_rows, with_provenance
from segback.engine import EngineOptions, offload, tiled
from segback.engine import options as engine_options
from segback.engine.attention import use_attention
from segback.engine.segmented import _split_trainable
from segback.engine.stack import binder, get_stack
from segback.models.random_init import build_model

SWEPT = ("attention", "tile", "tiles_in_flight", "head_chunk")

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


def emit(row: dict, args) -> None:
    print(json.dumps(row), flush=True)
    if args.out:
        append_rows(args.out, [with_provenance(row | {"script": "bench/tiled_profile.py"},
                                               args.config_name, args.run)])


def options(args, **swept) -> EngineOptions:
    """The engine options of one measurement: the flags, with the swept values on top."""
    return engine_options.from_args(args, EngineOptions(**swept), skip=SWEPT).resolved()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-e4b")
    p.add_argument("--quant-bits", type=int, default=None)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--tiles", type=int, nargs="+", default=[512, 1024])
    p.add_argument("--tiles-in-flight", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-reference", action="store_true")
    p.add_argument("--step", action="store_true",
                   help="instead: split whole training steps (one-layer segments, offload)")
    p.add_argument("--head-chunks", type=int, nargs="+", default=[EngineOptions.head_chunk],
                   help="with --step: logits per loss-head chunk")
    p.add_argument("--out", default=None,
                   help="also append the rows, with their provenance, to this JSON lines file "
                   "(e.g. bench/data/runs.jsonl)")
    p.add_argument("--config-name", default=None, help="row key \"config\"")
    p.add_argument("--run", default=None, help="row key \"run\"")
    engine = p.add_argument_group("engine options (segback.engine.EngineOptions)")
    engine_options.add_arguments(engine, skip=SWEPT)
    args = p.parse_args()
    if args.offload is None:
        args.offload = "true" if args.step else None  # --step parks boundaries by default

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
        return step_parts(model, args, {"model": args.model, "seq": L,
                                        "device": str(mx.default_device())})
    # One owning layer of each attention type (sharers differ only in skipping K/V).
    picks = {}
    for i, kind in enumerate(stack.layer_types):
        if stack.kv_source[i] == i:
            picks.setdefault(kind, i)
    meta = {"model": args.model, "seq": L, "device": str(mx.default_device())}

    for kind, i in picks.items():
        leaves = list(per_layer[i].values())
        keys = list(per_layer[i])
        if not args.no_reference:  # mlx-lm's layer at full length, fused attention
            mask = stack.masks(h)[kind]

            def f(x, *lv, i=i, keys=keys, mask=mask):
                binder(stack.layers[i], keys)(list(lv))
                return [stack.layer(i, x, mask, pli)[0]]

            fwd, _ = clock(lambda: f(h, *leaves), args.repeats)
            vjp, _ = clock(lambda: mx.vjp(f, [h, *leaves], [dh])[1], args.repeats)
            binder(stack.layers[i], keys)(leaves)
            emit({**meta, "layer": i, "kind": kind, "path": "mlx-lm",
                  "forward_ms": round(1e3 * fwd, 2), "vjp_ms": round(1e3 * vjp, 2),
                  "layer_ms": round(1e3 * (fwd + vjp), 2)}, args)
        with use_attention([stack.module]):
            saved = (tiled._pre, tiled.core_forward, tiled.core_backward)
            tiled._pre = timed("pre", tiled._pre)
            tiled.core_forward = timed("attn_fwd", tiled.core_forward)
            tiled.core_backward = timed("attn_bwd", tiled.core_backward)
            try:
                for tile in args.tiles:
                    for depth in args.tiles_in_flight:
                        opts = options(args, tile=tile, tiles_in_flight=depth)
                        call = tiled.LayerCall(stack, i, stack.masks(h, True)[kind], opts.tile,
                                               keys, pli, None, True, opts.compile,
                                               light_tile=opts.light_tile,
                                               share_traces=opts.share_traces,
                                               in_flight=opts.tiles_in_flight)
                        fwd, fsplit = clock(lambda: tiled.layer_forward(call, h, leaves)[0],
                                            args.repeats)
                        vjp, vsplit = clock(lambda: tiled.layer_vjp(call, h, dh, leaves)[::3],
                                            args.repeats)
                        split = {f"fwd_{k}": round(1e3 * v, 2) for k, v in fsplit.items()}
                        split.update({f"vjp_{k}": round(1e3 * v, 2) for k, v in vsplit.items()})
                        split["fwd_post"] = round(1e3 * (fwd - sum(fsplit.values())), 2)
                        split["vjp_post"] = round(1e3 * (vjp - sum(vsplit.values())), 2)
                        emit({**meta, "layer": i, "kind": kind, "path": "tiled",
                              **engine_fields(opts), "forward_ms": round(1e3 * fwd, 2),
                              "vjp_ms": round(1e3 * vjp, 2),
                              "layer_ms": round(1e3 * (fwd + vjp), 2), **split}, args)
            finally:
                tiled._pre, tiled.core_forward, tiled.core_backward = saved


def engine_fields(opts: EngineOptions) -> dict:
    """The options a tiled layer runs with (what the rows of one sweep differ in)."""
    keys = ("tile", "light_tile", "tiles_in_flight", "compile", "share_traces")
    return {k: getattr(opts, k) for k in keys}


def step_parts(model, args, meta) -> None:
    """Seconds per part of one tiled training step (after a warm-up step), and its peak; one
    segment per layer."""
    from segback.engine import memory_stats, reset_peak, segmented, value_and_grad

    vocab = model.args.vocab_size
    L = args.seq
    batch = mx.random.randint(0, vocab, (1, L + 1))
    lengths = mx.array([[0, L]])
    segments = [(i, i + 1) for i in range(len(model.layers))]
    # The step's building blocks as `segmented` calls them (imported there by name).
    saved = (segmented.layer_forward, segmented.layer_vjp, segmented.head_vjp,
             offload.HostStore.put, offload.HostStore.get)
    segmented.layer_forward = timed("layer_forward", segmented.layer_forward)
    segmented.layer_vjp = timed("layer_vjp", segmented.layer_vjp)
    segmented.head_vjp = timed("head", segmented.head_vjp)
    offload.HostStore.put = timed("offload_put", offload.HostStore.put)
    offload.HostStore.get = timed("offload_get", offload.HostStore.get)
    try:
        for tile, depth, head in ((t, d, c) for t in args.tiles for d in args.tiles_in_flight
                                  for c in args.head_chunks):
            opts = options(args, tile=tile, tiles_in_flight=depth, head_chunk=head)

            def step(opts=opts):
                (loss, _), grads = value_and_grad(model, batch, lengths, segments, opts)
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
            emit({**meta, "path": "step", **opts.to_dict(), "step_s": round(total, 3),
                  "peak_gb": round(memory_stats()["peak_gb"], 3), **parts}, args)
    finally:
        (segmented.layer_forward, segmented.layer_vjp, segmented.head_vjp,
         offload.HostStore.put, offload.HostStore.get) = saved


if __name__ == "__main__":
    main()
