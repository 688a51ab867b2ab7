"""Data-parallel training: one process per device (or host), launched by `mlx.launch`.

`segback train` is the same program on every rank; MLX's distributed environment (set by
`mlx.launch`, `mpirun` or any launcher that exports MLX_RANK/MLX_HOSTFILE, ...) says which rank
it is. `init()` calls `mx.distributed.init()` once and caches the `World`; without such an
environment it is one rank and nothing below communicates.

- Data: --batch-size B is the global batch, as in mlx_lm.lora: each of N ranks takes
  b = B // N rows (B must be a multiple of N). The global batch of step k, micro-batch j is the
  one a single process with --batch-size B would read; rank r takes rows [r*b, (r+1)*b) of it
  (`batch_at`), padded only to its own longest row. N ranks therefore see exactly the examples
  of one process of the same --batch-size, step for step, in the same order.
- Gradients: each rank's grad_fn returns the mean over its own trained tokens. A micro-batch's
  gradient is sum_r grad_r * ntoks_r / sum_r ntoks_r (the token count is all-summed per
  micro-batch, the weighted gradients once per step), which is the mean over the global batch's
  tokens: what one process computes. The loss is combined the same way.
- Rank 0 is the run's only writer (checkpoints, log, adapter, summary, progress bar); the other
  ranks hold a `Replica` that makes the same decisions without touching files. At the start,
  rank 0 resumes (or refuses to) and sends its step, its trainable weights and, when resuming,
  its optimizer state to every rank, so the ranks start identical even when only rank 0's
  machine holds the checkpoints.
- Every rank must read the same model, data and options: `check_same` compares their
  fingerprints before the first step.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NoReturn

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map_with_path

from segback.data import PAD_TO, TokenDataset
from segback.engine.packing import Packed
from segback.data import batch_at as _batch_at
from segback.trainer.checkpoints import TrainingDiverged, identity, trainable_weights

BUCKET_BYTES = 32 << 20  # arrays all-summed together, as nn.average_gradients


class DistributedError(ValueError):
    """The ranks disagree (model, data, options), or another rank stopped the run."""


@dataclass(frozen=True)
class World:
    """This process's place among the ranks; `group` is None for a single process."""

    group: Any
    rank: int = 0
    size: int = 1

    @property
    def main(self) -> bool:
        """Rank 0: the one that writes and reports."""
        return self.rank == 0

    def all_sum(self, x: mx.array) -> mx.array:
        return x if self.size == 1 else mx.distributed.all_sum(x, group=self.group)

    def all_gather(self, x: mx.array) -> mx.array:
        return x if self.size == 1 else mx.distributed.all_gather(x, group=self.group)

    def all_sum_tree(self, tree: Any) -> Any:
        """Every array leaf summed over the ranks: leaves of one dtype travel together in
        buckets of about BUCKET_BYTES (one all_sum each); other leaves are kept."""
        if self.size == 1:
            return tree
        flat = [(k, v) for k, v in tree_flatten(tree) if isinstance(v, mx.array)]
        out: dict[str, mx.array] = {}
        by_dtype: dict[Any, list[tuple[str, mx.array]]] = {}
        for k, v in flat:
            by_dtype.setdefault(v.dtype, []).append((k, v))
        for items in by_dtype.values():
            bucket: list[tuple[str, mx.array]] = []
            size = 0
            for k, v in items:
                bucket.append((k, v))
                size += v.nbytes
                if size >= BUCKET_BYTES:
                    out.update(self._sum_bucket(bucket))
                    bucket, size = [], 0
            if bucket:
                out.update(self._sum_bucket(bucket))
        return tree_map_with_path(lambda k, v: out.get(k, v), tree)

    def _sum_bucket(self, bucket: list[tuple[str, mx.array]]) -> dict[str, mx.array]:
        if len(bucket) == 1:
            k, v = bucket[0]
            return {k: self.all_sum(v)}
        flat = self.all_sum(mx.concatenate([v.reshape(-1) for _, v in bucket]))
        cuts = np.cumsum([v.size for _, v in bucket])[:-1].tolist()
        return {k: part.reshape(v.shape)
                for (k, v), part in zip(bucket, mx.split(flat, cuts))}

    def broadcast_tree(self, tree: Any) -> Any:
        """Rank 0's arrays on every rank (a sum where the other ranks add zeros: exact)."""
        if self.size == 1:
            return tree
        if not self.main:
            tree = tree_map_with_path(
                lambda _, v: mx.zeros_like(v) if isinstance(v, mx.array) else v, tree)
        return self.all_sum_tree(tree)

    def broadcast_int(self, value: int) -> int:
        x = mx.array([value if self.main else 0], mx.int32)
        return int(self.all_sum(x).item())


SINGLE = World(None)
_world: World | None = None


def init() -> World:
    """`mx.distributed.init()`, once per process; a single rank without a launcher."""
    global _world
    if _world is None:
        group = mx.distributed.init()
        _world = World(group, group.rank(), group.size()) if group.size() > 1 else \
            World(group)
    return _world


# ---- data ------------------------------------------------------------------------------------


def shard(batch: mx.array, lengths: mx.array, world: World, batch_size: int
          ) -> tuple[mx.array, mx.array]:
    """Rank `world.rank`'s rows [r*b, (r+1)*b) of a global batch, padded as `collate` would pad
    them alone (1 + a multiple of PAD_TO, at most the global width). May be empty (0 rows) for
    a short last validation batch."""
    if world.size == 1:
        return batch, lengths
    lo = world.rank * batch_size
    rows = batch[lo:lo + batch_size]
    if isinstance(lengths, Packed):  # packed rows (--pack): their example ids and targets
        lens = lengths.rows(lo, lo + batch_size)
        longest = int(lens.tokens_per_row().max()) if rows.shape[0] else 0
    else:
        lens = lengths[lo:lo + batch_size]
        longest = int(mx.max(lens[:, 1]).item()) + 1 if rows.shape[0] else 0
    if rows.shape[0] == 0:
        return rows, lens
    width = min(1 + PAD_TO * -(-(longest - 1) // PAD_TO), batch.shape[1])
    if isinstance(lens, Packed):
        lens = lens.rows(0, rows.shape[0], width)
    return rows[:, :width], lens


def batch_at(dataset: TokenDataset, index: int, batch_size: int, seed: int, max_len: int,
             world: World) -> tuple[mx.array, mx.array]:
    """This rank's part of the `index`-th global training batch of `batch_size` rows."""
    if world.size == 1:
        return _batch_at(dataset, index, batch_size, seed, max_len)
    batch, lengths = _batch_at(dataset, index, batch_size, seed, max_len)
    return shard(batch, lengths, world, rank_batch(batch_size, world))


def rank_batch(batch_size: int, world: World) -> int:
    """Rows of a global batch each rank takes; refuses a batch the ranks cannot share."""
    if batch_size % world.size:
        raise DistributedError(
            f"--batch-size {batch_size} is the global batch, split across {world.size} ranks "
            f"(as in mlx_lm.lora): give a multiple of {world.size}")
    return batch_size // world.size


def rank_seed(seed: int, world: World) -> int:
    """The dropout stream of this rank's part of a micro-batch: rank 0 keeps the single-process
    stream (`seed`), the others get their own, so no two ranks share dropout masks."""
    return seed if world.rank == 0 else (seed + world.rank * 0x9E3779B97F4A7C15) % (1 << 63)


def check_data(dataset: TokenDataset, batch_size: int, world: World) -> None:
    if world.size > 1:
        rank_batch(batch_size, world)
    if world.size > 1 and len(dataset) < batch_size:
        raise DistributedError(
            f"{dataset.name} has {len(dataset)} usable examples, fewer than one global batch "
            f"(--batch-size {batch_size}): add examples or lower the batch size")


# ---- agreement -------------------------------------------------------------------------------


def fingerprint(value: Any) -> bytes:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).digest()


def check_same(world: World, value: Any, what: str) -> None:
    """Refuse to train when a rank's `value` (its model, data and options) differs from
    rank 0's."""
    if world.size == 1:
        return
    mine = mx.array(np.frombuffer(fingerprint(value), np.uint8))
    every = np.array(world.all_gather(mine)).reshape(world.size, -1)
    other = [r for r in range(world.size) if not np.array_equal(every[r], every[0])]
    if other:
        raise DistributedError(
            f"rank(s) {', '.join(map(str, other))} have other {what} than rank 0: every rank "
            "must load the same model and data with the same options (same files on every "
            "host)")


class NullLog:
    def write(self, row: dict) -> None:
        pass


class Replica:
    """`checkpoints.Run` on ranks other than 0: the same checks and outcome, no files."""

    def __init__(self, args: Any, model: nn.Module, train_set: Any, world: World):
        self.args, self.world = args, world
        self.identity = identity(args, model, train_set)
        self.log = NullLog()
        self.last_saved: int | None = None
        self.resumed_from: int | None = None

    def start(self, model: nn.Module, optimizer: optim.Optimizer, stats: dict) -> int:
        return 0  # rank 0 decides (`begin`)

    def save(self, step: int, model: nn.Module, optimizer: optim.Optimizer, stats: dict
             ) -> None:
        if not all(mx.all(mx.isfinite(v)).item() for v in trainable_weights(model).values()):
            self.diverged(step, "non-finite weights")
        self.last_saved = step

    def diverged(self, step: int, what: str) -> NoReturn:
        raise TrainingDiverged(f"training diverged at step {step}: {what} (rank "
                               f"{self.world.rank}; rank 0 reports it)")

    def finish(self, model: nn.Module, summary: dict) -> dict:
        return {**summary, "resumed_from": self.resumed_from, "rank": self.world.rank}


def begin(world: World, run: Any, model: nn.Module, optimizer: optim.Optimizer, stats: dict
          ) -> int:
    """Rank 0's `run.start` (resume or not), then its step, trainable weights and (resuming)
    optimizer state on every rank. A failure on rank 0 stops every rank."""
    if world.size == 1:
        return run.start(model, optimizer, stats)
    check_same(world, run.identity, "model, data or options")
    start, error = 0, None
    if world.main:
        try:
            start = run.start(model, optimizer, stats)
        except Exception as e:  # noqa: BLE001 - told to the other ranks, then raised here
            start, error = -1, e
    start = world.broadcast_int(start)
    if error is not None:
        raise error
    if start < 0:
        raise DistributedError("rank 0 could not start the run (its error is above)")
    weights = world.broadcast_tree(trainable_weights(model))
    model.load_weights(list(weights.items()), strict=False)
    if start > 0:
        if not world.main:
            optimizer.init(model.trainable_parameters())
        optimizer.state = world.broadcast_tree(optimizer.state)
        run.last_saved = run.resumed_from = start
    mx.eval(model.parameters(), optimizer.state)
    return start


# ---- output ----------------------------------------------------------------------------------


@contextmanager
def quiet(world: World) -> Iterator[None]:
    """Ranks other than 0 print nothing inside (stdout and stderr go to /dev/null); errors
    raised out of it are printed as usual."""
    if world.main:
        yield
        return
    saved = sys.stdout, sys.stderr
    with open(os.devnull, "w") as null:
        sys.stdout = sys.stderr = null
        try:
            yield
        finally:
            sys.stdout, sys.stderr = saved


def who(world: World | None) -> str:
    """'' on rank 0, 'rank r: ' elsewhere (prefix of error messages)."""
    return "" if world is None or world.main else f"rank {world.rank}: "
