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
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NoReturn

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map_with_path

from segback.data.dataset import PAD_TO, TokenDataset
from segback.data.dataset import batch_at as _batch_at
from segback.engine import context
from segback.engine.packing import Packed
from segback.engine.plan_file import step_inputs
from segback.engine.ring_attention import Ring
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


# ---- context parallelism ---------------------------------------------------------------------
#
# With --context-parallel R the world's W ranks are D = W / R data ranks of R context ranks each:
# world rank w is context rank w % R of data rank w // R. A data rank's R context ranks read the
# same rows and split each sequence (`segback.engine.context`); their loss and gradient shares
# are summed in a fixed order, so all R hold the same data-rank gradient. Data-parallel code
# then runs unchanged on a `ContextWorld`: the data ranks' view, whose collectives count only
# context rank 0 of each data rank (the others hold copies of its values).

AGREE_SECONDS = 120.0  # how long the first exchange waits for the other ranks


@dataclass(frozen=True)
class ContextWorld(World):
    """The data ranks' view of a world of data x context ranks (`rank`, `size`: the data
    rank and their number); `full` is the whole world, `ring` this rank's context ring."""

    full: World = SINGLE
    ring: Any = None
    context: int = 1  # ranks per sequence (R)

    @property
    def main(self) -> bool:
        return self.full.main

    @property
    def first(self) -> bool:
        """Context rank 0: the one whose copies the data-level collectives count."""
        return self.ring.rank == 0

    def all_sum(self, x: mx.array) -> mx.array:
        if self.full.size == 1:
            return x
        # zeros that depend on x: every rank's graph orders its collectives the same way
        return self.full.all_sum(x if self.first else mx.depends(mx.zeros_like(x), x))

    def all_gather(self, x: mx.array) -> mx.array:
        if self.full.size == 1:
            return x
        every = self.full.all_gather(x[None])
        return every[::self.context].reshape(-1, *x.shape[1:])

    def context_sum_tree(self, tree: Any) -> Any:
        """Every float leaf summed over this data rank's context ranks, in context-rank order
        (so every one of them holds the same sums)."""
        flat = [(k, v) for k, v in tree_flatten(tree) if isinstance(v, mx.array)]
        if not flat:
            return tree
        vec = mx.concatenate([v.astype(mx.float32).reshape(-1) for _, v in flat])
        if self.size == 1:  # the ring is the world: the ring all-sum gives every rank one sum
            total = self.full.all_sum(vec)
        else:
            rows = self.full.all_gather(vec[None])
            first = self.rank * self.context
            total = rows[first:first + self.context].sum(axis=0)
        cuts = np.cumsum([v.size for _, v in flat])[:-1].tolist()
        out = {k: part.reshape(v.shape).astype(v.dtype)
               for (k, v), part in zip(flat, mx.split(total, cuts))}
        return tree_map_with_path(lambda k, v: out.get(k, v), tree)


def context_world(world: World, ranks: int, order: str, config: Any,
                  seconds: float = AGREE_SECONDS) -> ContextWorld:
    """The data x context view of `world` for --context-parallel `ranks`, after checking, on
    every rank, that the ranks agree on `config` and can send to each other."""
    if ranks < 1 or world.size % ranks:
        raise DistributedError(
            f"--context-parallel {ranks} does not divide the {world.size} rank(s) mlx.launch "
            f"started: launch a multiple of {ranks} ranks (data x context), or change "
            "--context-parallel")
    with deadline(seconds, world, "to agree on the options"):
        check_same(world, config, "options (--context-parallel and the rest)")
    data, c = divmod(world.rank, ranks)
    base = data * ranks
    ring = Ring(world.group, c, ranks, base + (c - 1) % ranks, base + (c + 1) % ranks, order)
    if ranks > 1:
        with deadline(seconds, world, "to answer a first message (send/recv)"):
            probe(ring, world)
    return ContextWorld(world.group, data, world.size // ranks, full=world, ring=ring,
                        context=ranks)


def probe(ring: Any, world: World) -> None:
    """One small message around the ring, then every rank's outcome shared with all of them
    (an all-gather, which every backend has): a backend or a pair of ranks that cannot send
    fails here, on every rank, with what to do. Each rank sends, then receives, each tried
    alone: a message this small leaves without waiting for its receiver, and a receive whose
    sender could not send fails too (the pair is the same), so no rank waits for a message
    that never comes, and none is left unread to confuse the collectives after."""
    kw = {"group": ring.group}
    problems = []
    try:
        mx.eval(mx.distributed.send(mx.array([ring.rank], mx.int32), ring.next, **kw))
    except RuntimeError as e:
        problems.append(str(e).strip())
    try:  # also when the send failed: a message from the previous rank is received
        got = int(mx.distributed.recv_like(mx.array([0], mx.int32), ring.prev, **kw).item())
        if got != (ring.rank - 1) % ring.size:
            problems.append(f"its first message came from context rank {got}")
    except RuntimeError as e:
        problems.append(str(e).strip())
    problem = "; ".join(problems)
    failed = np.array(world.all_gather(mx.array([int(bool(problem))], mx.int32))).reshape(-1)
    if failed.any():
        bad = ", ".join(str(r) for r in np.flatnonzero(failed))
        raise DistributedError(
            f"rank(s) {bad} could not send to or receive from their context ring's neighbours"
            + (f" ({problem})" if problem else "") + ": --context-parallel needs send/recv "
            "between the ranks of a ring: launch with --backend ring or mpi (the ring backend "
            "sends only to neighbouring ranks: with data x context ranks use "
            "--context-parallel 2, or as many as there are ranks)")


@contextmanager
def deadline(seconds: float, world: World, what: str) -> Iterator[None]:
    """Leave the process (status 4) with a message if the block takes longer than `seconds`:
    mx.distributed's collectives wait forever for a rank that never comes."""
    def expire() -> None:
        print(f"segback train: error: {who(world)}no answer from the other ranks in "
              f"{seconds:.0f} s {what}; check that every rank runs the same command "
              "(and --context-parallel)", file=sys.__stderr__, flush=True)
        os._exit(4)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def context_grad_fn(plan: Any, world: ContextWorld, options: Any = None) -> Any:
    """The grad_fn of one context rank: its shard's loss and gradient shares
    (`segback.engine.context`), summed over its context ranks, so every one of them returns
    its data rank's ((loss, tokens), grads), as `loop.segmented_grad_fn` would on the whole
    rows. A `Plan` is checked where it is made, as there."""
    segments, options = step_inputs(plan, options)

    def grad_fn(model, batch, lengths):
        (loss, n), grads = context.value_and_grad(model, batch, lengths, world.ring, segments,
                                                  options)
        summed = world.context_sum_tree({"loss": loss.astype(mx.float32),
                                         "n": mx.array(float(n)), "grads": grads})
        mx.eval(summed)  # this collective done before the loop's next one is built
        ntoks = summed["n"].astype(mx.int32)
        return (summed["loss"], ntoks), summed["grads"]

    grad_fn.plan = plan
    return grad_fn
