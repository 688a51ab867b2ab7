"""Sequence packing: several short examples in one row of at most `max_seq_length` tokens.

Short examples padded to a long-context width waste the engine on padding; packed, a row of
8192 tokens trains 16 examples of 512 at once. Rows are filled best-fit decreasing (longest
example first, into the open row it fills most; ties by file order), so the packing is a pure
function of the example lengths and `capacity`. A packed batch is `(batch, Packed)`
(`segback.engine.packing`): its loss and gradients equal mlx-lm's `default_loss` over the same
examples one per row, because attention never crosses examples and no target crosses them.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from segback.data.dataset import PAD_TO, TokenDataset
from segback.engine.packing import Packed

Example = tuple[list[int], int]  # (ids, offset): the loss counts ids[max(offset, 1):]


def pack_rows(sizes: Sequence[int], capacity: int) -> list[list[int]]:
    """Example indices per row, no row over `capacity` tokens: best-fit decreasing.

    Each row lists its examples in input order; rows are in order of their first example.
    """
    if too_long := [i for i, n in enumerate(sizes) if n > capacity]:
        raise ValueError(f"example {too_long[0]} has {sizes[too_long[0]]} tokens, more than a "
                         f"packed row's {capacity}")
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row), sorted: best fit by bisection
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        k = bisect.bisect_left(free, (sizes[i], -1))
        if k < len(free):
            room, r = free.pop(k)
        else:
            room, r = capacity, len(rows)
            rows.append([])
        rows[r].append(i)
        if room - sizes[i] > 0:
            bisect.insort(free, (room - sizes[i], r))
    return sorted(sorted(r) for r in rows)


def collate_packed(rows: Sequence[Sequence[Example]], max_len: int, pad_to: int = PAD_TO
                   ) -> tuple[mx.array, Packed]:
    """Pad packed rows to [B, T] (T as `segback.data.collate` pads) and describe them.

    Target j of an example (token j + 1) counts where offset <= j + 1 <= len(ids) - 1, as
    `collate`'s lengths make `default_loss` count it; the target from an example's last token
    into the next example is never counted.
    """
    longest = max(sum(len(ids) for ids, _ in row) for row in rows)
    if longest > max_len:
        raise ValueError(f"a packed row holds {longest} tokens, more than {max_len}")
    width = min(1 + pad_to * -(-(longest - 1) // pad_to), max_len)
    arr = np.zeros((len(rows), width), np.int32)
    segments = np.zeros((len(rows), width), np.int32)
    targets = np.zeros((len(rows), width - 1), bool)
    for r, row in enumerate(rows):
        pos = 0
        for k, (ids, offset) in enumerate(row, 1):
            n = len(ids)
            arr[r, pos:pos + n] = ids
            segments[r, pos:pos + n] = k
            targets[r, pos + max(offset, 1) - 1:pos + n - 1] = True
            pos += n
    return mx.array(arr), Packed(segments, targets)


@dataclass
class PackedDataset(TokenDataset):
    """A TokenDataset whose items are packed rows: `examples[i]` is row i's ids run together
    (offset 0; for length sorting and the data fingerprint), `parts[i]` its examples."""

    parts: list[list[Example]] = field(default_factory=list)
    capacity: int = 0

    @property
    def loss_tokens(self) -> int:
        return sum(len(ids) - max(off, 1) for row in self.parts for ids, off in row)

    @property
    def num_examples(self) -> int:
        return sum(len(row) for row in self.parts)

    def batch(self, indices: Sequence[int], max_len: int) -> tuple[mx.array, Packed]:
        return collate_packed([self.parts[i] for i in indices], max_len)


def pack_dataset(dataset: TokenDataset, capacity: int) -> PackedDataset:
    """`dataset`'s examples packed into rows of at most `capacity` tokens."""
    rows = pack_rows([len(ids) for ids, _ in dataset.examples], capacity)
    parts = [[dataset[i] for i in row] for row in rows]
    examples = [([t for ids, _ in row for t in ids], 0) for row in parts]
    return PackedDataset(examples, name=dataset.name, dropped=dataset.dropped,
                         truncated=dataset.truncated, parts=parts, capacity=capacity)


def describe(dataset: PackedDataset) -> str:
    """One line: how many examples went into how many rows, and how full the rows are."""
    tokens = sum(len(ids) for ids, _ in dataset.examples)
    fill = tokens / max(len(dataset) * dataset.capacity, 1)
    return (f"{dataset.name}: packed {dataset.num_examples} examples into {len(dataset)} rows "
            f"of at most {dataset.capacity} tokens ({fill:.0%} full)")
