"""Loss head that only builds logits where the loss mask counts, a bounded chunk at a time.

mlx-lm's `default_loss` builds [B, T, vocab] logits; at e4b's 262144 vocab that is 2^31 elements
at 8192 tokens, which MLX-CUDA cannot launch. Here rows are gathered by the mask and pushed
through (final norm, LM head, softcap, cross-entropy) in chunks of at most `max_elements` logits.

Where the head comes apart (a `segback.engine.stack.Head`) and has no trainable leaves, each
chunk is fused: logits once, then one compiled float32 pass gives the loss and dlogits =
(softmax - onehot) * softcap' directly, and dX comes from the VJP of the LM head and the norm
alone, instead of autodiff's chain of [chunk, vocab] temporaries.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from segback.engine.options import DEFAULT_HEAD_CHUNK as DEFAULT_MAX_ELEMENTS
from segback.engine.packing import Packed
from segback.engine.stack import Head


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


@partial(mx.compile, shapeless=True)
def _ce_dlogits(z: mx.array, t: mx.array, cols: mx.array, cot: mx.array
                ) -> tuple[mx.array, mx.array]:
    """Summed cross-entropy of logits `z` [n, V] at targets `t` and its gradient times `cot`,
    in float32 (the gradient returned in z's dtype); `cols` is arange(V), passed in so that no
    shape is baked into the trace."""
    dtype = z.dtype
    z = z.astype(mx.float32)
    lse = mx.logsumexp(z, axis=-1, keepdims=True)
    loss = (lse - mx.take_along_axis(z, t[:, None], axis=-1)).sum()
    g = mx.exp(z - lse) - (cols == t[:, None])
    return loss, (g * cot).astype(dtype)


@partial(mx.compile, shapeless=True)
def _capped_ce_dlogits(z: mx.array, t: mx.array, cols: mx.array, cot: mx.array, cap: mx.array
                       ) -> tuple[mx.array, mx.array]:
    """`_ce_dlogits` of the softcapped logits cap * tanh(z / cap), with the gradient taken
    back through the softcap (its derivative 1 - tanh^2)."""
    dtype = z.dtype
    th = mx.tanh(z.astype(mx.float32) / cap)
    c = th * cap
    lse = mx.logsumexp(c, axis=-1, keepdims=True)
    loss = (lse - mx.take_along_axis(c, t[:, None], axis=-1)).sum()
    th = c / cap  # tanh again from c: only c stays alive between the passes
    g = (mx.exp(c - lse) - (cols == t[:, None])) * (1 - th * th)
    return loss, (g * cot).astype(dtype)


def fused_chunk(head: Head, x: mx.array, t: mx.array, cot: mx.array
                ) -> tuple[mx.array, mx.array]:
    """Summed cross-entropy of `head(x)` at targets `t`, and its gradient (times `cot`) in x."""
    xn = head.norm(x)
    z = head.linear(xn)
    cols = mx.arange(z.shape[-1], dtype=t.dtype)
    if head.softcap is None:
        part, dz = _ce_dlogits(z, t, cols, cot)
    else:
        part, dz = _capped_ce_dlogits(z, t, cols, cot, mx.array(head.softcap, mx.float32))
    _, (dxn,) = mx.vjp(head.linear, [xn], [dz])
    _, (dx,) = mx.vjp(head.norm, [x], [dxn])
    return part, dx


def contiguous(rows: np.ndarray) -> bool:
    """Whether sorted, distinct `rows` are one range (then slices replace gather and scatter)."""
    return rows.size > 0 and int(rows[-1]) - int(rows[0]) + 1 == rows.size


def head_vjp(
    head: Callable[[mx.array], mx.array],
    h_final: mx.array,
    batch: mx.array,
    lengths: np.ndarray | Packed,
    vocab: int,
    params: Sequence[mx.array] = (),
    bind: Callable[[Sequence[mx.array]], None] | None = None,
    max_elements: int = DEFAULT_MAX_ELEMENTS,
    fused: bool = True,
) -> tuple[mx.array, mx.array, mx.array, list[mx.array]]:
    """Loss (mean CE over counted tokens), ntoks, dLoss/dh_final and dLoss/d`params`.

    `params` are trainable leaves the head reads (rarely any: LoRA usually sits in the layers);
    `bind` puts traced copies of them into the model. With `fused` the chunks of a `Head`
    without such leaves run `fused_chunk`; any other head runs autodiff of `head`.
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
    use_fused = fused and isinstance(head, Head) and not params
    start = int(rows[0]) if contiguous(rows) else None

    for s, e in chunk_rows(int(rows.size), vocab, max_elements):
        idx = slice(start + s, start + e) if start is not None else mx.array(rows[s:e])
        t = targets[idx]
        if use_fused:
            part, dx = fused_chunk(head, flat_h[idx], t, cot)
            dp = []
        else:
            def chunk_loss(x, *leaves):
                if bind is not None:
                    bind(leaves)
                return nn.losses.cross_entropy(head(x), t).astype(mx.float32).sum()

            (part,), (dx, *dp) = mx.vjp(chunk_loss, [flat_h[idx], *params], [cot])
        if start is not None:
            dh[idx] = dx.astype(dh.dtype)
        else:
            dh = dh.at[idx].add(dx.astype(dh.dtype))
        dparams = [a + b for a, b in zip(dparams, dp)]
        total = total + part
        mx.eval(total, dh, dparams)
    loss = total / ntoks.astype(mx.float32)
    return loss, ntoks, dh.reshape(B, T - 1, D), dparams
