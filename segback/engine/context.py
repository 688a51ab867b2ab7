"""Context parallelism: one rank's part of a sequence split over a ring of ranks, exact.

Every rank of a context-parallel group gets the same whole rows and keeps its shard of them
(`ring_attention.Shards`): its input tokens, their targets and their loss mask. It runs the
segmented engine unchanged on that shard (untiled, or tiled with or without offload), with
three stand-ins:

- attention: every layer's mask is a `RingMask`, which attends the shard's queries to the keys
  of the whole sequence around the ring (the untiled engine reaches it through mlx-lm's
  attention call, `ring_sdpa`; the tiled one calls it per layer);
- positions: RoPE rotates at the shard's global positions (untiled: `ShardRope`; tiled: each
  tile's offset is its global position, and no tile crosses two runs of the shard);
- loss: the head's cotangent is scaled from this shard's mean to the whole rows' mean (tokens
  here / tokens of the rows), so the cotangents that cross ranks inside attention carry one
  normalisation everywhere.

Summed over the group, the returned losses and gradients are those of
`segmented.value_and_grad` (and mlx-lm's `default_loss`) on the whole rows.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from segback.engine.attention import use_attention
from segback.engine.head import loss_mask
from segback.engine.host_table import park_tables, parked_bytes
from segback.engine.options import EngineOptions
from segback.engine.packing import is_packed
from segback.engine.ring_attention import (
    Ring,
    RingError,
    RingMask,
    Shards,
    use_ring_attention,
    use_shard_positions,
)
from segback.engine.segmented import _value_and_grad, _value_and_grad_tiled, resolve
from segback.engine.stack import Head, Stack, get_stack


def scale_cotangent(x: mx.array, factor: float) -> mx.array:
    """x, whose cotangent is multiplied by `factor` on the way back."""

    @mx.custom_function
    def f(x):
        return x

    @f.vjp
    def f_vjp(primals, cotangent, output):
        return cotangent * factor

    return f(x)


def local_rows(batch: mx.array, lengths: np.ndarray, shards: Shards, rank: int
               ) -> tuple[mx.array, mx.array, np.ndarray, int, int]:
    """This shard's (inputs [B, n], a batch whose targets [:, 1:] are the shard's, its
    `lengths`, tokens counted here, tokens counted in the whole rows).

    The whole rows' loss mask is an interval per row, and a shard's pieces are in position
    order, so the shard's mask is one interval of its local targets too: `lengths` as
    mlx-lm's default_loss reads them (steps start..stop, 1-based)."""
    T = batch.shape[1]
    mask = loss_mask(lengths, T)
    pos = shards.positions[rank]
    idx = mx.array(pos.astype(np.int32))
    inputs = batch[:, :-1][:, idx]
    targets = batch[:, 1:][:, idx]
    local = mask[:, pos]
    rows = []
    for row in local:
        on = np.flatnonzero(row)
        if on.size and on[-1] - on[0] + 1 != on.size:
            raise RingError("a row's loss mask is not one interval of the shard")
        rows.append([on[0] + 1, on[-1] + 1] if on.size else [1, 0])
    shard_batch = mx.concatenate([inputs[:, :1], targets], axis=1)
    return inputs, shard_batch, np.array(rows, np.int64), int(local.sum()), int(mask.sum())


def shard_stack(stack: Stack, ring: Ring, shards: Shards, share: float) -> Stack:
    """`stack` on one shard: ring masks, and the head's cotangent times `share`."""
    head = stack.head
    if isinstance(head, Head):  # kept apart, so the loss head still fuses its chunks
        scaled = replace(head, norm=lambda x: head.norm(scale_cotangent(x, share)))
    else:
        def scaled(x):
            return head(scale_cotangent(x, share))
    masks = {"full_attention": RingMask("causal", None, ring, shards)}
    if "sliding_attention" in stack.layer_types:
        masks["sliding_attention"] = RingMask("sliding", stack.window, ring, shards)
    out = replace(stack, head=scaled)
    out.masks = lambda h, descriptors=False, segments=None: masks
    return out


def value_and_grad(
    model: nn.Module,
    batch: mx.array,
    lengths: mx.array,
    ring: Ring,
    plan: Any = None,
    options: EngineOptions | None = None,
    *,
    stats: dict | None = None,
    **overrides: Any,
) -> tuple[tuple[mx.array, int], dict]:
    """This rank's ((loss share, tokens counted here), gradient share) of the whole rows.

    `batch` and `lengths` are the whole rows, the same on every rank of the ring. Summed over
    the ring, loss shares and gradient shares are `engine.value_and_grad`'s loss and grads on
    them. `plan` (segments or a `Plan` made for the shard's length), `options` and `stats` as
    there: the untiled engine, or the tiled one (with offload) on the shard.
    """
    if is_packed(lengths):
        raise RingError("context parallelism takes unpacked batches: drop --pack")
    stack = get_stack(model)
    L = batch.shape[1] - 1
    shards = ring.shards(L)
    inputs, local, local_lengths, n, total = local_rows(
        batch, np.array(lengths).reshape(-1, 2), shards, ring.rank)
    segs, opts = resolve(stack, local, plan, options, overrides)
    if opts.host_table:
        park_tables(model)
    share = n / max(total, 1)
    sharded = shard_stack(stack, ring, shards, share)
    runs = shards.runs(ring.rank)
    if opts.tile:
        with use_attention([stack.module]):
            (loss, _), grads = _value_and_grad_tiled(
                model, sharded, local, mx.array(local_lengths), segs, opts, stats,
                inputs=inputs, runs=tuple(runs))
    else:
        if stats is not None:
            stats["host_gb"] = parked_bytes(model) / 1024**3
        with use_ring_attention([stack.module]), use_shard_positions(stack.layers, runs):
            (loss, _), grads = _value_and_grad(model, sharded, local, mx.array(local_lengths),
                                               segs, opts, chunked=True, inputs=inputs)
    loss = loss * share if n else mx.array(0.0, mx.float32)
    return (loss, n), grads
