"""Segmented backward: exact LoRA loss and gradients with one segment's activations alive.

1. Forward over layer ranges, keeping only the evaluated (hence detached) hidden state at each
   segment's input, and the K/V of Gemma-4 donor layers that a later segment reads.
2. Loss head on the final hidden state, chunked over the counted tokens only: loss, ntoks, dh.
3. Reverse over segments: `mx.vjp` of each segment's forward, fed the cotangent of its output
   boundary (and of the donor K/V it produced, summed over every sharer segment), returning the
   cotangent of its input boundary and its parameter gradients.

This is reverse-mode AD done in pieces, so grads equal one big backward up to float summation
order. Recompute costs one extra forward in total, independent of the number of segments.
"""

from __future__ import annotations

from typing import Any
from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_map_with_path, tree_unflatten

from segback.engine.head import DEFAULT_MAX_ELEMENTS, head_vjp
from segback.models.stack import Stack, get_stack

Segments = Sequence[tuple[int, int]]


def resolve_segments(segments: Any, num_layers: int) -> list[tuple[int, int]]:
    """Accept (start, stop) ranges, a plan (dict/object with `segments`) or layers-per-segment."""
    if segments is None:
        segments = num_layers
    if isinstance(segments, dict):
        segments = segments["segments"]
    elif hasattr(segments, "segments"):
        segments = segments.segments
    if isinstance(segments, int):
        if segments < 1:
            raise ValueError("layers per segment must be >= 1")
        segments = [(s, min(s + segments, num_layers)) for s in range(0, num_layers, segments)]
    out = [(int(a), int(b)) for a, b in segments]
    pos = 0
    for a, b in out:
        if a != pos or b <= a:
            raise ValueError(
                f"segments must cover layers 0..{num_layers} in order without gaps; got {out}"
            )
        pos = b
    if pos != num_layers:
        raise ValueError(f"segments end at layer {pos} but the model has {num_layers} layers")
    return out


def plan_attention(plan: Any, default: str = "fused") -> str:
    """The attention kind a plan dict was made for (its own key or its `inputs`), else default."""
    return plan_option(plan, "attention", default)


def tiling_options(tile: Any, offload: Any) -> tuple[int | str | None, bool | str]:
    """`tile` and `offload` as the CLI, YAML or Python give them ("512", "auto", "true", 512,
    True...) as (tokens | "auto" | None, True | False | "auto"); a clear error otherwise."""
    if isinstance(tile, str):
        low = tile.strip().lower()
        tile = None if low in ("", "none", "null") else int(low) if low.isdigit() else low
    if tile not in (None, "auto") and not (type(tile) is int and tile >= 1):
        raise ValueError(f"tile must be a positive number of tokens, 'auto' or None, not {tile!r}")
    if isinstance(offload, str) and offload.strip().lower() in ("true", "false"):
        offload = offload.strip().lower() == "true"
    if offload not in (True, False, "auto"):
        raise ValueError(f"offload must be true, false or 'auto', not {offload!r}")
    return tile, offload


def check_tiling_extras(tile: Any, offload: Any, light_tile: Any, offload_keep: Any) -> None:
    """`light_tile` and `offload_keep` make sense with this `tile` and `offload`
    (`offload_keep` may be "auto" for the planner); a clear error otherwise."""
    if light_tile is not None and not tile:
        raise ValueError("light_tile needs a tile size (tile=...): it is part of the tiled engine")
    if light_tile is not None and not (type(light_tile) is int and light_tile >= 1):
        raise ValueError(f"light_tile must be a positive number of tokens, not {light_tile!r}")
    if offload_keep != "auto" and not (type(offload_keep) is int and offload_keep >= 0):
        raise ValueError(f"offload_keep must be a number of segments >= 0 or 'auto', "
                         f"not {offload_keep!r}")
    if offload_keep not in (0, "auto") and not offload:
        raise ValueError(f"offload_keep={offload_keep}: the number of last segments whose "
                         "boundaries stay on the device needs offload=True")


def engine_options(plan: Any, attention: str = "fused", tile: int | None = None,
                   offload: bool = False, light_tile: int | None = None,
                   offload_keep: int = 0) -> dict[str, Any]:
    """The engine settings (attention, tile, offload, light_tile, offload_keep) a plan was made
    for; the arguments are the defaults for what the plan does not say (a list of ranges or a
    count says nothing)."""
    tile = plan_option(plan, "tile", tile)
    return dict(attention="chunked" if tile else plan_attention(plan, attention), tile=tile,
                offload=bool(plan_option(plan, "offload", offload)),
                light_tile=plan_option(plan, "light_tile", light_tile),
                offload_keep=int(plan_option(plan, "offload_keep", offload_keep)))


def _split_trainable(model: nn.Module, stack: Stack):
    """Flat trainable leaves: per layer {key: array}, and those outside the layers."""
    flat = dict(tree_flatten(model.trainable_parameters()))
    per_layer: list[dict[str, mx.array]] = [{} for _ in stack.layers]
    outer: dict[str, mx.array] = {}
    prefix = stack.layers_path + "."
    for k, v in flat.items():
        if k.startswith(prefix):
            i, rest = k[len(prefix):].split(".", 1)
            per_layer[int(i)][rest] = v
        else:
            outer[k] = v
    return per_layer, outer


def _binder(module: nn.Module, keys: list[str]):
    def bind(leaves):
        module.update(tree_unflatten(list(zip(keys, leaves))), strict=False)
    return bind


def plan_option(plan: Any, key: str, default: Any) -> Any:
    """A plan dict's own setting for `key`, else `default`.

    The top level holds what the planner chose (null tile = untiled); a plan made before those
    keys existed only has its `inputs` (the attention it was asked for).
    """
    if not isinstance(plan, dict):
        return default
    if key in plan:
        return default if plan[key] is None else plan[key]
    value = plan.get("inputs", {}).get(key)
    return default if value is None or value == "auto" else value


def compile_by_default() -> bool:
    """Whether tile functions are `mx.compile`d when the caller does not say: on the CPU only."""
    return mx.default_device() == mx.cpu


def value_and_grad(
    model: nn.Module,
    batch: mx.array,
    lengths: mx.array,
    segments: Any = None,
    head_max_elements: int = DEFAULT_MAX_ELEMENTS,
    attention: str = "fused",
    tile: int | None = None,
    offload: bool = False,
    stats: dict | None = None,
    compile: bool | None = None,
    light_tile: int | None = None,
    offload_keep: int = 0,
) -> tuple[tuple[mx.array, mx.array], dict]:
    """Drop-in for `nn.value_and_grad(model, default_loss)(model, batch, lengths)`.

    Returns ((loss, ntoks), grads) with grads shaped like `model.trainable_parameters()`.
    `attention="chunked"` runs mlx-lm's layers with `chunked_sdpa` (O(L) attention backward,
    masks as descriptors); "fused" keeps mx.fast's kernel. `tile` (tokens) runs each layer's
    token-wise parts a tile at a time, forward and backward (implies chunked attention);
    `offload` parks boundaries and per-layer inputs in host memory (with `tile`), except the
    boundaries of the last `offload_keep` segments, which stay on the device (they are the first
    the backward needs: no copy either way); on its first call it also moves a frozen Gemma-4
    per-layer embedding table to host memory for good (segback.engine.host_table).
    `light_tile` (default `tile`) is the tile of the passes that hold no MLP cotangents
    (segback.engine.tiled). A plan's own "attention", "tile",
    "offload", "light_tile" and "offload_keep" win. `stats`, if given, receives "host_gb". `compile`
    traces each tiled layer's tile functions once (`mx.compile`; skipped with LoRA dropout);
    None compiles on the CPU only: on CUDA the first compiled step JIT-builds every trace's
    kernels (measured on the H200, e4b at 8K: over 150 s, against 32 s eager), after which it
    is 13% faster (4.89 against 5.60 s a step).
    """
    if compile is None:
        compile = compile_by_default()
    opts = engine_options(segments, attention, tile, offload, light_tile, offload_keep)
    attention, tile, offload = opts["attention"], opts["tile"], opts["offload"]
    light_tile, offload_keep = opts["light_tile"], opts["offload_keep"]
    if attention not in ("fused", "chunked"):
        raise ValueError(f"attention must be 'fused' or 'chunked', not {attention!r}")
    if offload and not tile:
        raise ValueError("offload needs a tile size (tile=...): it is part of the tiled engine")
    check_tiling_extras(tile, offload, light_tile, offload_keep)
    stack = get_stack(model)
    if attention == "chunked" or tile:
        from segback.engine.attention import use_chunked_attention

        with use_chunked_attention([stack.module]):
            if tile:
                return _value_and_grad_tiled(model, stack, batch, lengths, segments,
                                             head_max_elements, int(tile), offload, stats,
                                             compile, light_tile, offload_keep)
            return _value_and_grad(model, stack, batch, lengths, segments, head_max_elements,
                                   chunked=True)
    return _value_and_grad(model, stack, batch, lengths, segments, head_max_elements)


def _value_and_grad(model, stack, batch, lengths, segments, head_max_elements, chunked=False):
    segs = resolve_segments(segments, stack.num_layers)
    per_layer, outer = _split_trainable(model, stack)
    lengths_np = np.array(lengths).reshape(-1, 2)
    inputs = batch[:, :-1]
    need_input_grad = bool(outer)  # embedding-side params are trainable: thread dh back

    # Dropout in LoRA layers draws random masks: replay the same stream in each recompute.
    seed = int(mx.random.randint(0, 2**31 - 1, ()).item())

    outer_keys = list(outer)
    bind_outer = _binder(model, outer_keys)
    outer_vals = [outer[k] for k in outer_keys]

    # 1. Forward, keeping evaluated boundaries (eval detaches them from the graph).
    h, per_layer_in = stack.embed(inputs)
    masks = stack.masks(h, descriptors=chunked)
    mx.eval(h, per_layer_in, [m for m in masks.values() if isinstance(m, mx.array)])
    kv_saved: dict[int, tuple[mx.array, mx.array]] = {}
    readers = [stack.donors_read_by(a, b) for a, b in segs]
    needed_later = set().union(*readers) if readers else set()
    produced = [tuple(d for d in range(a, b) if d in needed_later) for a, b in segs]
    boundaries = []
    for k, (a, b) in enumerate(segs):
        boundaries.append(h)
        mx.random.seed(seed + k)
        h, kv = stack.run(a, b, h, masks, per_layer_in,
                          {d: kv_saved[d] for d in readers[k]}, produced[k])
        kv = {d: (mx.contiguous(x), mx.contiguous(y)) for d, (x, y) in kv.items()}
        mx.eval(h, kv)
        kv_saved.update(kv)

    # 2. Loss head on the final hidden state.
    loss, ntoks, dh, d_outer = head_vjp(
        stack.head, h, batch, lengths_np, getattr(model.args, "vocab_size", 1 << 15),
        outer_vals, bind_outer,
        head_max_elements,
    )
    del h
    bind_outer(outer_vals)
    grads_flat: dict[str, mx.array] = dict(zip(outer_keys, d_outer))
    d_kv = {d: [mx.zeros_like(kv_saved[d][0]), mx.zeros_like(kv_saved[d][1])]
            for d in needed_later}
    d_pli = mx.zeros_like(per_layer_in) if need_input_grad and per_layer_in is not None else None

    # 3. Reverse over segments.
    for k in reversed(range(len(segs))):
        a, b = segs[k]
        keys = [(i, key) for i in range(a, b) for key in per_layer[i]]
        params = [per_layer[i][key] for i, key in keys]
        reads, makes = readers[k], produced[k]
        # Gradient flows below this segment only if something below is trainable.
        upstream = need_input_grad or any(per_layer[i] for i in range(a))
        if not upstream and not params:
            break  # frozen from here down: no backward needed (mlx-lm's --num-layers case)
        with_h = upstream
        with_pli = d_pli is not None
        const_kv = {} if upstream else {d: kv_saved[d] for d in reads}
        reads = reads if upstream else []

        def seg_fn(*primals, a=a, b=b, k=k, keys=keys, reads=reads, makes=makes,
                   with_h=with_h, with_pli=with_pli, const_kv=const_kv):
            it = iter(primals)
            h_in = next(it) if with_h else boundaries[k]
            pli = next(it) if with_pli else per_layer_in
            kv_in = {d: (next(it), next(it)) for d in reads} | const_kv
            leaves = list(it)
            for i in range(a, b):
                own = [(key, v) for (j, key), v in zip(keys, leaves) if j == i]
                if own:
                    stack.layers[i].update(tree_unflatten(own), strict=False)
            mx.random.seed(seed + k)
            h_out, kv_out = stack.run(a, b, h_in, masks, pli, kv_in, makes)
            return [h_out, *[t for d in makes for t in kv_out[d]]]

        primals = ([boundaries[k]] if with_h else []) + ([per_layer_in] if with_pli else [])
        for d in reads:
            primals += list(kv_saved[d])
        primals += params
        cotangents = [dh, *[t for d in makes for t in d_kv[d]]]
        _, vjps = mx.vjp(seg_fn, primals, cotangents)
        it = iter(vjps)
        if with_h:
            dh = next(it)
        if with_pli:
            d_pli = d_pli + next(it)
        for d in reads:
            d_kv[d][0] = d_kv[d][0] + next(it)
            d_kv[d][1] = d_kv[d][1] + next(it)
        for (i, key), g in zip(keys, it):
            grads_flat[f"{stack.layers_path}.{i}.{key}"] = g
        for i in range(a, b):  # put the untraced leaves back
            if per_layer[i]:
                stack.layers[i].update(tree_unflatten(list(per_layer[i].items())), strict=False)
        boundaries[k] = None
        for d in makes:
            d_kv.pop(d)
        mx.eval(dh, d_pli, d_kv, [grads_flat[f"{stack.layers_path}.{i}.{key}"]
                                  for i, key in keys])

    if need_input_grad:  # embedding-side parameters
        def embed_fn(*leaves):
            bind_outer(leaves)
            h0, pli = stack.embed(inputs)
            return [h0] if pli is None else [h0, pli]

        cot = [dh] if per_layer_in is None else [dh, d_pli]
        _, d_emb = mx.vjp(embed_fn, outer_vals, cot)
        for key, g in zip(outer_keys, d_emb):
            grads_flat[key] = grads_flat[key] + g
        bind_outer(outer_vals)
    mx.random.seed(seed)

    grads = tree_map_with_path(lambda path, _: grads_flat[path], model.trainable_parameters())
    return (loss, ntoks), grads



def _value_and_grad_tiled(model, stack, batch, lengths, segments, head_max_elements, tile,
                          offload, stats, compile, light_tile=None, offload_keep=0):
    """The segmented backward with sequence-tiled layers (see `segback.engine.tiled`).

    A segment [a, b) keeps only its input boundary; its backward recomputes the boundaries
    inside it, then walks its layers in reverse, each layer's VJP tile by tile.
    """
    from segback.engine.host_table import park_tables, parked_bytes
    from segback.engine.offload import HostStore
    from segback.engine.tiled import LayerCall, layer_forward, layer_vjp
    from segback.engine.tiled import tiles as token_tiles

    if offload:  # once per model: later calls find the table parked already
        park_tables(model)
    segs = resolve_segments(segments, stack.num_layers)
    per_layer, outer = _split_trainable(model, stack)
    lengths_np = np.array(lengths).reshape(-1, 2)
    inputs = batch[:, :-1]
    L = inputs.shape[1]
    need_input_grad = bool(outer)
    seed = int(mx.random.randint(0, 2**31 - 1, ()).item())
    store = HostStore(offload)
    outer_keys = list(outer)
    bind_outer = _binder(model, outer_keys)
    outer_vals = [outer[k] for k in outer_keys]
    spans = token_tiles(L, light_tile or tile)

    # Embedding, a tile at a time (Gemma-4's per-layer inputs are [L, layers, 256]).
    hs, plis = [], []
    for t0, t1 in spans:
        h0, pli = stack.embed(inputs[:, t0:t1])
        mx.eval(h0, pli)
        hs.append(h0)
        plis.append(pli)
    h = hs[0] if len(hs) == 1 else mx.concatenate(hs, axis=1)
    del hs
    pli_store = [None] * stack.num_layers
    if plis[0] is not None:
        for i in range(stack.num_layers):
            pli_store[i] = store.put(mx.concatenate([p[:, :, i, :] for p in plis], axis=1))
    del plis
    masks = stack.masks(h, descriptors=True)
    sources = stack.kv_source
    donors = {src for i, src in enumerate(sources) if src != i}

    def call(i: int, kv: dict, then: int | None = None) -> LayerCall:
        """Layer i's call; `then` is the layer after it in this pass, whose per-layer input
        starts coming back from the host now."""
        src = sources[i]
        pli = store.get(pli_store[i]) if pli_store[i] is not None else None
        if then is not None and 0 <= then < stack.num_layers and pli_store[then] is not None:
            store.prefetch(pli_store[then])
        return LayerCall(stack, i, masks[stack.layer_types[i]], tile, list(per_layer[i]), pli,
                         kv[src] if src != i else None, need_input_grad, compile,
                         seed=seed + 100_003 * i, light_tile=light_tile)

    def leaves(i: int) -> list[mx.array]:
        return list(per_layer[i].values())

    # 1. Forward.
    kv_saved: dict[int, tuple[mx.array, mx.array]] = {}
    boundaries = []
    kept = len(segs) - offload_keep  # segments from here on keep their boundary on the device
    for k, (a, b) in enumerate(segs):
        boundaries.append(store.put(h, keep=k >= kept))
        for i in range(a, b):
            h, kv = layer_forward(call(i, kv_saved, i + 1), h, leaves(i))
            if i in donors:
                kv_saved[i] = kv

    # 2. Loss head.
    loss, ntoks, dh, d_outer = head_vjp(
        stack.head, h, batch, lengths_np, getattr(model.args, "vocab_size", 1 << 15),
        outer_vals, bind_outer, head_max_elements,
    )
    del h
    bind_outer(outer_vals)
    grads_flat: dict[str, mx.array] = dict(zip(outer_keys, d_outer))
    d_kv: dict[int, list[mx.array]] = {}
    d_pli: list[mx.array | None] = [None] * stack.num_layers

    # 3. Reverse over segments, and over the layers of each.
    done = False
    for k in reversed(range(len(segs))):
        a, b = segs[k]
        x = store.get(boundaries[k])
        store.drop(boundaries[k])
        boundaries[k] = None
        if k > 0:  # the next segment's boundary starts coming back while this one runs
            store.prefetch(boundaries[k - 1])
        inner = [x]
        for i in range(a, b - 1):  # recompute the boundaries inside the segment
            inner.append(layer_forward(call(i, kv_saved, i + 1), inner[-1], leaves(i))[0])
        for i in reversed(range(a, b)):
            upstream = need_input_grad or any(per_layer[j] for j in range(i))
            if not upstream and not per_layer[i]:
                done = True  # frozen from here down
                break
            keys = list(per_layer[i])
            then = i - 1 if i > a else (segs[k - 1][0] if k > 0 else None)
            dh, dpli, d_shared, grads = layer_vjp(
                call(i, kv_saved, then), inner.pop(), dh, leaves(i), d_kv.pop(i, None)
            )
            if per_layer[i]:
                stack.layers[i].update(tree_unflatten(list(per_layer[i].items())), strict=False)
            for key, g in zip(keys, grads):
                grads_flat[f"{stack.layers_path}.{i}.{key}"] = g
            if d_shared is not None:
                src = sources[i]
                prev = d_kv.get(src)
                d_kv[src] = list(d_shared) if prev is None else [prev[0] + d_shared[0],
                                                                 prev[1] + d_shared[1]]
            if dpli is not None:
                d_pli[i] = dpli
            mx.eval(dh, d_kv, grads)
        if done:
            break

    if need_input_grad:  # embedding-side parameters, a tile at a time
        for t0, t1 in spans:
            def embed_fn(*leaves, t0=t0, t1=t1):
                bind_outer(leaves)
                h0, pli = stack.embed(inputs[:, t0:t1])
                return [h0] if pli is None else [h0, pli]

            cot = [dh[:, t0:t1]]
            if pli_store[0] is not None:
                parts = []
                for i in range(stack.num_layers):
                    if d_pli[i] is None:  # a layer below the first trainable one
                        parts.append(mx.zeros_like(store.get(pli_store[i])[:, t0:t1]))
                    else:
                        parts.append(d_pli[i][:, t0:t1])
                cot.append(mx.stack(parts, axis=2))
            _, d_emb = mx.vjp(embed_fn, outer_vals, cot)
            for key, g in zip(outer_keys, d_emb):
                grads_flat[key] = grads_flat[key] + g
            mx.eval([grads_flat[key] for key in outer_keys])
        bind_outer(outer_vals)
    mx.random.seed(seed)
    if stats is not None:
        stats["host_gb"] = (store.peak_host_bytes + parked_bytes(model)) / 1024**3

    grads = tree_map_with_path(lambda path, _: grads_flat[path], model.trainable_parameters())
    return (loss, ntoks), grads
