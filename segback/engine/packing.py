"""Packed batches: several examples in one row, kept apart by a block-diagonal causal mask.

A packed batch passes a `Packed` where `lengths` goes (`value_and_grad(model, batch, packed)`):
per token the example it belongs to, per target whether the loss counts it. The loss is the mean
CE over all counted targets of the batch, so it and the LoRA gradients equal those of mlx-lm's
`default_loss` on the same examples laid out one per row (a token-weighted mean over them).

- Attention: each layer gets an explicit boolean mask, causal AND same-example (AND the window on
  sliding layers), instead of "causal". Padding after the last example is a block of its own, so
  no softmax row is empty (an empty row would put NaNs into the backward).
- Loss: a target that crosses into the next example is never counted, nor a prompt token.
- RoPE: mlx-lm rotates by the position in the row, not in the example. A score between a query
  at m and a key at n depends only on m - n, and the mask keeps a token inside its own example,
  so every score equals the unpacked one up to float rounding (the angles are float32): on
  tiny-gemma3 the grads differ ~1e-5 relative, as far as mlx-lm's own float32 grads are from
  float64 ones (tests/test_packing.py).
- Cost: with fused attention the masks are [B, 1, L, L] arrays that mlx-lm's attention runs
  (O(L^2) work and memory); with `attention="chunked"` they stay descriptors
  (`attention.Blocks`) and a query chunk reads only keys from its earliest example on, so the
  work is ~ tokens x example length (CPU, tiny-llama, 16 x 256 tokens in a row of 4096: 8x the
  tokens/s of one 4096-token example). The tiled engine does not take packed batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import create_causal_mask


@dataclass(frozen=True)
class Packed:
    """Where `lengths` goes for a packed batch of width T.

    `segments` int32 [B, T]: 1, 2, ... for the examples of a row in order, 0 for padding.
    `targets` bool [B, T-1]: target j (token j + 1 predicted at j) counts in the loss.
    """

    segments: np.ndarray
    targets: np.ndarray

    def __post_init__(self) -> None:
        B, T = self.segments.shape
        if self.targets.shape != (B, T - 1):
            raise ValueError(f"packed targets must be [{B}, {T - 1}], not "
                             f"{list(self.targets.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return self.segments.shape

    def tokens_per_row(self) -> np.ndarray:
        """Tokens of the examples in each row (padding excluded)."""
        return (self.segments > 0).sum(axis=1)

    def rows(self, lo: int, hi: int, width: int | None = None) -> Packed:
        """Rows [lo, hi), cut to `width` tokens (a rank's share of a global batch)."""
        width = width or self.segments.shape[1]
        return Packed(self.segments[lo:hi, :width], self.targets[lo:hi, :width - 1])


def is_packed(lengths: Any) -> bool:
    return isinstance(lengths, Packed)


def input_tokens(lengths: Any) -> int:
    """Real tokens of a batch: each row's up to its last real token (`collate`'s lengths[:, 1])."""
    if is_packed(lengths):
        return int(lengths.tokens_per_row().sum())
    return int(mx.sum(lengths[:, 1] + 1).item())


def attention_mask(segments: mx.array, window: int | None = None) -> mx.array:
    """Boolean [B, 1, L, L] mask of a packed row: causal, within one example, within `window`
    keys (mlx-lm's `create_causal_mask` semantics) on sliding layers."""
    same = segments[:, :, None] == segments[:, None, :]
    return (same & create_causal_mask(segments.shape[1], window_size=window))[:, None]
