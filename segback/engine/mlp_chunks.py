"""The untiled engine's MLPs, checkpointed and recomputed a chunk of tokens at a time.

In an untiled segment's backward every layer keeps its MLP's activations over the whole
sequence (gate, up, the activation's intermediates, their product, LoRA's inputs) until its
VJP: on e4b's double-wide layers that is most of what a layer holds. `use_mlp_chunks` routes
each layer's `mlp` call through a custom function that keeps only its input and output; its VJP
recomputes the MLP `chunk` tokens at a time and evaluates each chunk's gradients before the
next, so the MLP's transient is one chunk's. The price is one more MLP forward in the backward.
MLPs are token-wise, so the chunks' gradients are the whole sequence's (summed in float32
order per chunk). LoRA dropout draws its masks per chunk from a seed fixed by the step, the
layer and the chunk, the same in the forward and in the recompute.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import cache

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from segback.engine.stack import binder, has_dropout


def _chunks(length: int, chunk: int) -> list[tuple[int, int]]:
    return [(t0, min(t0 + chunk, length)) for t0 in range(0, length, chunk)]


def checkpointed(mlp: nn.Module, call, x: mx.array, chunk: int, seed: int | None) -> mx.array:
    """`call(mlp, x)` whose backward recomputes it `chunk` tokens at a time (axis 1).

    `seed` (with LoRA dropout) reseeds the random stream before each chunk, in the forward and
    in the recompute alike; None leaves the stream alone and runs the forward whole.
    """
    flat = tree_flatten(mlp.trainable_parameters())
    bind = binder(mlp, [k for k, _ in flat])
    spans = _chunks(x.shape[1], chunk)

    def run(x_part: mx.array, leaves: Sequence[mx.array], t: int | None) -> mx.array:
        bind(leaves)
        if seed is not None and t is not None:
            mx.random.seed(seed + t)
        return call(mlp, x_part)

    @mx.custom_function
    def forward(x, *leaves):
        if seed is None:
            return run(x, leaves, None)
        return mx.concatenate([run(x[:, t0:t1], leaves, t)
                               for t, (t0, t1) in enumerate(spans)], axis=1)

    @forward.vjp
    def backward(primals, cotangent, output):
        x, *leaves = primals
        dxs, grads = [], [mx.zeros(p.shape, mx.float32) for p in leaves]
        for t, (t0, t1) in enumerate(spans):
            x_t, c_t = x[:, t0:t1], cotangent[:, t0:t1]
            if dxs:  # chunk t starts once chunk t-1's gradients are done: one alive at a time
                x_t, c_t = mx.depends([x_t, c_t], [dxs[-1], *grads])
            _, (dx, *dl) = mx.vjp(lambda xt, *lv, t=t: run(xt, lv, t), [x_t, *leaves], [c_t])
            grads = [g + d.astype(mx.float32) for g, d in zip(grads, dl)]
            dxs.append(dx)
        bind(leaves)
        dx = dxs[0] if len(dxs) == 1 else mx.concatenate(dxs, axis=1)
        return (dx, *[g.astype(p.dtype) for g, p in zip(grads, leaves)])

    out = forward(x, *[v for _, v in flat])
    bind([v for _, v in flat])  # the forward bound its (traced) leaves: put the caller's back
    return out


@cache
def _chunked_class(base: type) -> type:
    """`base` (an MLP class) whose call runs through `checkpointed` on long inputs."""
    def __call__(self, x: mx.array) -> mx.array:
        spec = self._segback_chunks
        if x.ndim < 3 or x.shape[1] <= spec[0]:
            return base.__call__(self, x)
        return checkpointed(self, base.__call__, x, *spec)

    return type(base.__name__, (base,), {"__call__": __call__, "__module__": __name__})


@contextmanager
def use_mlp_chunks(layers: Sequence[nn.Module], chunk: int | None, seed: int
                   ) -> Iterator[None]:
    """While active, each layer's `mlp` runs through `checkpointed` (nothing if `chunk` is
    None). `seed` is the step's: layer i's chunk t draws dropout masks from seed + 4096 i + t."""
    mlps = [getattr(layer, "mlp", None) for layer in layers] if chunk else []
    swapped = []
    try:
        for i, mlp in enumerate(mlps):
            if not isinstance(mlp, nn.Module):
                continue
            base = type(mlp)
            object.__setattr__(mlp, "_segback_chunks",
                               (chunk, seed + 4096 * i if has_dropout(mlp) else None))
            mlp.__class__ = _chunked_class(base)
            swapped.append((mlp, base))
        yield
    finally:
        for mlp, base in swapped:
            mlp.__class__ = base
            object.__delattr__(mlp, "_segback_chunks")
