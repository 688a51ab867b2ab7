"""Loss head that only builds logits where the loss mask counts, a bounded chunk at a time.

mlx-lm's `default_loss` builds [B, T, vocab] logits; at e4b's 262144 vocab that is 2^31 elements
at 8192 tokens, which MLX-CUDA cannot launch. Here rows are gathered by the mask and pushed
through (final norm, LM head, softcap, cross-entropy) in chunks of at most `max_elements` logits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from segback.engine.packing import Packed

DEFAULT_MAX_ELEMENTS = 1 << 26  # logits per chunk: 256 MB in float32


def loss_mask(lengths: np.ndarray | Packed, T: int) -> np.ndarray:
    """The [B, T-1] target mask of `mlx_lm.tuner.trainer.default_loss`; a packed batch brings
    its own (per example, no target across examples)."""
    if isinstance(lengths, Packed):
        return lengths.targets
    steps = np.arange(1, T)[None, :]
    return (steps >= lengths[:, 0:1]) & (steps <= lengths[:, 1:2])


def chunk_rows(n_rows: int, vocab: int, max_elements: int = DEFAULT_MAX_ELEMENTS
               ) -> list[tuple[int, int]]:
    """Row ranges such that no chunk's logits exceed `max_elements`."""
    size = max(1, min(n_rows, max_elements // max(vocab, 1)))
    return [(s, min(s + size, n_rows)) for s in range(0, n_rows, size)]


def head_vjp(
    head: Callable[[mx.array], mx.array],
    h_final: mx.array,
    batch: mx.array,
    lengths: np.ndarray | Packed,
    vocab: int,
    params: Sequence[mx.array] = (),
    bind: Callable[[Sequence[mx.array]], None] | None = None,
    max_elements: int = DEFAULT_MAX_ELEMENTS,
) -> tuple[mx.array, mx.array, mx.array, list[mx.array]]:
    """Loss (mean CE over counted tokens), ntoks, dLoss/dh_final and dLoss/d`params`.

    `params` are trainable leaves the head reads (rarely any: LoRA usually sits in the layers);
    `bind` puts traced copies of them into the model.
    """
    B, T = batch.shape
    D = h_final.shape[-1]
    mask = loss_mask(lengths, T)
    ntoks = mx.array(mask).sum()
    rows = np.flatnonzero(mask.reshape(-1)).astype(np.int32)
    flat_h = h_final.reshape(B * (T - 1), D)
    targets = batch[:, 1:].reshape(-1)
    dh = mx.zeros_like(flat_h)
    dparams = [mx.zeros_like(p) for p in params]
    total = mx.array(0.0, mx.float32)
    cot = mx.array(1.0 / max(int(rows.size), 1), mx.float32)

    for s, e in chunk_rows(int(rows.size), vocab, max_elements):
        idx = mx.array(rows[s:e])
        t = targets[idx]

        def chunk_loss(x, *leaves):
            if bind is not None:
                bind(leaves)
            return nn.losses.cross_entropy(head(x), t).astype(mx.float32).sum()

        (part,), (dx, *dp) = mx.vjp(chunk_loss, [flat_h[idx], *params], [cot])
        dh = dh.at[idx].add(dx.astype(dh.dtype))
        dparams = [a + b for a, b in zip(dparams, dp)]
        total = total + part
        mx.eval(total, dh, dparams)
    loss = total / ntoks.astype(mx.float32)
    return loss, ntoks, dh.reshape(B, T - 1, D), dparams
