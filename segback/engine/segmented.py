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
from mlx.utils import tree_flatten, tree_map_with_path

from segback.engine.attention import fused_routed, use_attention
from segback.engine.head import head_vjp
from segback.engine.host_table import park_tables, parked_bytes
from segback.engine.mlp_chunks import use_mlp_chunks
from segback.engine.offload import HostStore
from segback.engine.options import EngineOptions
from segback.engine.packing import Packed, is_packed
from segback.engine.plan_file import Plan, segments_of
from segback.engine.stack import Stack, binder, get_stack, has_dropout
from segback.engine.tiled import LayerCall, layer_forward, layer_vjp
from segback.engine.tiled import tiles as token_tiles


def resolve(model_stack: Stack, batch: mx.array, plan: Any, options: EngineOptions | None,
            overrides: dict[str, Any]) -> tuple[list[tuple[int, int]], EngineOptions]:
    """(segments, options) for this step: a `Plan` (or its dict) brings both and is checked
    against the model and batch; ranges or a count bring segments only. `options` replaces the
    plan's, and keyword overrides go on top; None values are the device's defaults."""
    if isinstance(plan, dict):
        plan = Plan.from_dict(plan)
    if isinstance(plan, Plan):
        segs = plan.check(model_stack.num_layers, model_stack.layer_types,
                          seq_len=batch.shape[1] - 1, batch_size=batch.shape[0])
        base = plan.engine
    else:
        segs = segments_of(plan, model_stack.num_layers)
        base = EngineOptions()
    base = options or base
    if overrides:
        base = EngineOptions.from_dict(base.to_dict() | overrides, "value_and_grad")
    return segs, base.resolved()


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


def value_and_grad(
    model: nn.Module,
    batch: mx.array,
    lengths: mx.array | Packed,
    plan: Plan | dict | Sequence[tuple[int, int]] | int | None = None,
    options: EngineOptions | None = None,
    *,
    stats: dict | None = None,
    **overrides: Any,
) -> tuple[tuple[mx.array, mx.array], dict]:
    """Drop-in for `nn.value_and_grad(model, default_loss)(model, batch, lengths)`.

    Returns ((loss, ntoks), grads) with grads shaped like `model.trainable_parameters()`.
    `plan` is a `Plan` (segments and engine options; refused if made for another model or a
    shorter sequence), (start, stop) layer ranges, layers per segment, or None (one segment).
    `options` (`EngineOptions`) or keyword overrides (`tile=1024`, `offload=True`, ...) say how
    to run it when the plan does not. `stats`, if given, receives "host_gb". `lengths` may be a
    `Packed` (several examples per row, `segback.engine.packing`; untiled engine only).
    """
    stack = get_stack(model)
    segs, opts = resolve(stack, batch, plan, options, overrides)
    if opts.host_table:  # once per model: later calls find the table parked already
        park_tables(model)
    if is_packed(lengths) and opts.tile:
        raise ValueError("a packed batch (several examples per row) needs the untiled engine: "
                         "the tiled engine builds no block-diagonal masks; run it without "
                         "tile (a plan without tiles), or without packing")
    if opts.tile:
        with use_attention([stack.module]):
            return _value_and_grad_tiled(model, stack, batch, lengths, segs, opts, stats)
    if stats is not None:
        stats["host_gb"] = parked_bytes(model) / 1024**3
    # Routed calls get mask descriptors (no [L, L] arrays): chunked attention, and fused
    # attention where segback picks the kernel per layer (CUDA).
    routed = opts.attention == "chunked" or fused_routed()
    with use_attention([stack.module] if routed else [], opts.attention):
        return _value_and_grad(model, stack, batch, lengths, segs, opts, chunked=routed)


def _value_and_grad(model, stack, batch, lengths, segs, opts: EngineOptions, chunked=False,
                    inputs=None):
    """`inputs`: the token ids the layers run on, when not `batch[:, :-1]` (a context-parallel
    shard's, whose targets are not its next inputs)."""
    # Dropout in LoRA layers draws random masks: replay the same stream in each recompute.
    seed = int(mx.random.randint(0, 2**31 - 1, ()).item())
    with use_mlp_chunks(stack.layers, opts.mlp_chunk, seed):
        return _segments_backward(model, stack, batch, lengths, segs, opts, chunked, seed,
                                  inputs)


def _segments_backward(model, stack, batch, lengths, segs, opts, chunked, seed, inputs=None):
    per_layer, outer = _split_trainable(model, stack)
    binders = [binder(layer, list(per_layer[i])) for i, layer in enumerate(stack.layers)]
    packed = is_packed(lengths)
    lengths_np = lengths if packed else np.array(lengths).reshape(-1, 2)
    inputs = batch[:, :-1] if inputs is None else inputs
    need_input_grad = bool(outer)  # embedding-side params are trainable: thread dh back

    outer_keys = list(outer)
    bind_outer = binder(model, outer_keys)
    outer_vals = [outer[k] for k in outer_keys]

    # 1. Forward, keeping evaluated boundaries (eval detaches them from the graph).
    h, per_layer_in = stack.embed(inputs)
    masks = stack.masks(h, descriptors=chunked,
                        segments=lengths.segments[:, :-1] if packed else None)
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
        outer_vals, bind_outer, opts.head_chunk,
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
                binders[i]([v for (j, _), v in zip(keys, leaves) if j == i])
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
            binders[i](list(per_layer[i].values()))
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



def _value_and_grad_tiled(model, stack, batch, lengths, segs, opts: EngineOptions, stats,
                          inputs=None, runs=None):
    """The segmented backward with sequence-tiled layers (see `segback.engine.tiled`).

    A segment [a, b) keeps only its input boundary; its backward recomputes the boundaries
    inside it, then walks its layers in reverse, each layer's VJP tile by tile. `inputs` as
    `_value_and_grad`'s; `runs`: the rows' positions as `tiled.LayerCall.runs` (None: 0..L-1).
    """
    per_layer, outer = _split_trainable(model, stack)
    binders = [binder(layer, list(per_layer[i])) for i, layer in enumerate(stack.layers)]
    lengths_np = np.array(lengths).reshape(-1, 2)
    inputs = batch[:, :-1] if inputs is None else inputs
    L = inputs.shape[1]
    need_input_grad = bool(outer)
    seed = int(mx.random.randint(0, 2**31 - 1, ()).item())
    store = HostStore(opts.offload, opts.prefetch)
    outer_keys = list(outer)
    bind_outer = binder(model, outer_keys)
    outer_vals = [outer[k] for k in outer_keys]
    spans = token_tiles(L, opts.light_tile or opts.tile)

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
    dropout = [has_dropout(layer) for layer in stack.layers]

    def call(i: int, kv: dict, then: int | None = None) -> LayerCall:
        """Layer i's call; `then` is the layer after it in this pass, whose per-layer input
        starts coming back from the host now."""
        src = sources[i]
        pli = store.get(pli_store[i]) if pli_store[i] is not None else None
        if then is not None and 0 <= then < stack.num_layers and pli_store[then] is not None:
            store.prefetch(pli_store[then])
        return LayerCall(stack, i, masks[stack.layer_types[i]], opts.tile, list(per_layer[i]),
                         pli, kv[src] if src != i else None, need_input_grad, opts.compile,
                         seed=seed + 100_003 * i, light_tile=opts.light_tile,
                         share_traces=opts.share_traces, in_flight=opts.tiles_in_flight,
                         dropout=dropout[i], kind=opts.attention, runs=runs)

    def leaves(i: int) -> list[mx.array]:
        return list(per_layer[i].values())

    # 1. Forward.
    kv_saved: dict[int, tuple[mx.array, mx.array]] = {}
    boundaries = []
    kept = len(segs) - opts.boundaries_on_device  # from here on boundaries stay on the device
    for k, (a, b) in enumerate(segs):
        boundaries.append(store.put(h, keep=k >= kept))
        for i in range(a, b):
            h, kv = layer_forward(call(i, kv_saved, i + 1), h, leaves(i))
            if i in donors:
                kv_saved[i] = kv

    # 2. Loss head.
    loss, ntoks, dh, d_outer = head_vjp(
        stack.head, h, batch, lengths_np, getattr(model.args, "vocab_size", 1 << 15),
        outer_vals, bind_outer, opts.head_chunk,
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
            binders[i](leaves(i))
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
