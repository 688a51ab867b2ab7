"""Masks described instead of materialized: causal or sliding (`MaskSpec`), and the examples of
packed rows (`Blocks`). Every attention kernel reads these, so none builds an [L, L] array."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import mlx.core as mx
import numpy as np
from mlx_lm.models import base as _base


class Blocks:
    """The examples of packed rows (`segback.engine.packing`), for chunked attention: a query
    sees only keys of its own example, so a query chunk reads keys from the first token of its
    earliest example on (block-sparse: work ~ tokens x example length, not tokens^2)."""

    def __init__(self, segments: np.ndarray):
        B, L = segments.shape
        self.ids = mx.array(segments)
        change = np.ones((B, L), bool)
        change[:, 1:] = segments[:, 1:] != segments[:, :-1]
        idx = np.where(change, np.arange(L)[None], 0)
        self.first = np.maximum.accumulate(idx, axis=1).min(axis=0)  # over the rows
        end = np.ones((B, L), bool)
        end[:, :-1] = segments[:, 1:] != segments[:, :-1]
        idx = np.where(end, np.arange(L)[None], L - 1)
        self.last = np.minimum.accumulate(idx[:, ::-1], axis=1)[:, ::-1].max(axis=0)
        self.mean_length = L / max(int(change.sum(axis=1).max()), 1)

    def mask(self, q0: int, q1: int, k0: int, k1: int, window: int | None) -> mx.array:
        """Boolean [B, 1, 1, q1 - q0, k1 - k0]: causal, same example, within the window
        (queries at key positions q0..q1)."""
        qpos = mx.arange(q0, q1)[:, None]
        kpos = mx.arange(k0, k1)[None]
        mask = qpos >= kpos
        if window is not None:
            mask = mask & (qpos < kpos + window)
        same = self.ids[:, q0:q1, None] == self.ids[:, None, k0:k1]
        return (same & mask)[:, None, None]

    def dense(self, window: int | None) -> mx.array:
        """The whole [B, 1, L, L] mask, as mlx-lm's attention takes it."""
        L = self.ids.shape[1]
        return self.mask(0, L, 0, L, window)[:, 0]


@dataclass(frozen=True)
class MaskSpec:
    """A mask described instead of materialized: "causal", or "sliding" over `window` keys;
    with `blocks`, also within one packed example."""

    kind: Literal["causal", "sliding"] = "causal"
    window: int | None = None
    blocks: Blocks | None = field(default=None, compare=False)

    def __post_init__(self):
        if self.kind not in ("causal", "sliding"):
            raise ValueError(f"unknown mask kind {self.kind!r}")
        if self.kind == "sliding" and (self.window is None or self.window < 1):
            raise ValueError("a sliding mask needs a positive window")
        if self.kind == "causal" and self.window is not None:
            raise ValueError("a causal mask has no window (use kind='sliding')")

    def to_mlx(self, q_len: int, k_len: int) -> mx.array | str:
        """The mask mlx-lm would pass: "causal", or a boolean [q_len, k_len] window mask."""
        if self.blocks is not None:
            return self.blocks.dense(self.window)[..., k_len - q_len:, :]
        if self.kind == "causal":
            return "causal"
        return _base.create_causal_mask(q_len, offset=k_len - q_len, window_size=self.window)
