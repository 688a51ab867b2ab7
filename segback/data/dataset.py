"""A tokenized dataset and its resumable batch order.

Batch order differs from `mlx_lm.tuner.trainer.iterate_batches` in one way: it is a pure function
of (seed, index), so resuming at step k needs no RNG state. Like mlx-lm, examples are sorted by
length into fixed batches (less padding) and each epoch visits those batches in a permutation drawn
from `numpy.random.default_rng([seed, epoch])`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

PAD_TO = 32  # batch widths are 1 + a multiple of this, as in mlx-lm


class DataError(ValueError):
    """A data source is missing or empty, or a row is malformed; the message says what to do."""


def one_line(e: Exception) -> str:
    """An exception as one line, to quote inside a one-paragraph DataError."""
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


@dataclass
class TokenDataset:
    """Tokenized examples: `examples[i] = (ids, offset)`; loss counts ids[offset:]."""

    examples: list[tuple[list[int], int]]
    name: str = "data"
    dropped: int = 0  # examples with no loss token left after truncation
    truncated: int = 0  # kept examples cut to max_len
    _order: list[list[int]] | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> tuple[list[int], int]:
        return self.examples[i]

    @property
    def loss_tokens(self) -> int:
        return sum(len(ids) - max(off, 1) for ids, off in self.examples)

    def batch(self, indices: Sequence[int], max_len: int) -> tuple[mx.array, Any]:
        """The batch of these examples: `collate` (a packed dataset makes packed rows)."""
        return collate([self.examples[i] for i in indices], max_len)


def batch_groups(dataset: TokenDataset, batch_size: int, drop_last: bool = True
                 ) -> list[list[int]]:
    """Example indices per batch, length-sorted so a batch pads little (ties keep file order)."""
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    if drop_last and len(dataset) < batch_size:
        raise DataError(f"{dataset.name} has {len(dataset)} usable examples, fewer than "
                        f"batch_size={batch_size}: add examples or lower the batch size.")
    order = sorted(range(len(dataset)), key=lambda i: (len(dataset[i][0]), i))
    stop = len(order) - len(order) % batch_size if drop_last else len(order)
    return [order[i:i + batch_size] for i in range(0, stop, batch_size)]


def epoch_permutation(n_batches: int, seed: int, epoch: int) -> np.ndarray:
    """The batch visiting order of one epoch: a pure function of (seed, epoch)."""
    return np.random.default_rng([int(seed), int(epoch)]).permutation(n_batches)


def collate(examples: Sequence[tuple[list[int], int]], max_len: int, pad_to: int = PAD_TO
            ) -> tuple[mx.array, mx.array]:
    """Pad to [B, T] and build `lengths` [B, 2] for `mlx_lm.tuner.trainer.default_loss`.

    default_loss counts target j (token j+1) where offset <= j+1 <= lengths[:, 1]; so the second
    column is the index of the last real token, len(ids) - 1. (mlx-lm's own iterate_batches puts
    len(ids) there, which also counts the first padding token as a target.)
    """
    longest = max(len(ids) for ids, _ in examples)
    width = min(1 + pad_to * -(-(longest - 1) // pad_to), max_len)
    arr = np.zeros((len(examples), width), np.int32)
    lengths = np.zeros((len(examples), 2), np.int32)
    for j, (ids, offset) in enumerate(examples):
        ids = ids[:width]
        arr[j, :len(ids)] = ids
        lengths[j] = (offset, len(ids) - 1)
    return mx.array(arr), mx.array(lengths)


def batch_at(dataset: TokenDataset, index: int, batch_size: int, seed: int, max_len: int
             ) -> tuple[mx.array, mx.array]:
    """The `index`-th (0-based) training batch: epochs of permuted length-sorted batches."""
    if dataset._order is None or len(dataset._order[0]) != batch_size:
        dataset._order = batch_groups(dataset, batch_size)
    groups = dataset._order
    epoch, pos = divmod(int(index), len(groups))
    group = groups[epoch_permutation(len(groups), seed, epoch)[pos]]
    return dataset.batch(group, max_len)


def validation_batches(dataset: TokenDataset, batch_size: int, num_batches: int, seed: int,
                       max_len: int) -> Iterator[tuple[mx.array, mx.array]]:
    """The same validation batches every time (all of them when num_batches is -1)."""
    groups = batch_groups(dataset, min(batch_size, len(dataset)), drop_last=False)
    order = epoch_permutation(len(groups), seed, 0)
    if num_batches >= 0:
        order = order[:num_batches]
    for g in order:
        yield dataset.batch(groups[g], max_len)
