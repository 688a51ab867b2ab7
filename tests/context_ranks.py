"""Run under `mlx.launch -n R`: one context-parallel group of all R ranks computes loss and
LoRA gradients of tiny models on whole rows split over the ring (`segback.engine.context`) and
takes the optimizer steps of `context_cases.RUNS`, for tests/test_context_parallel.py to compare
with one process. Rank 0 writes OUT/CASE.ORDER.npz per run (the first step's loss and grads,
the last adapter); every rank writes what it was told on bad input (OUT/NAME.RANK.txt).

    mlx.launch -n 2 --backend ring -- python tests/context_ranks.py OUT
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).parent))
from context_cases import RUNS, case_inputs, optimizer  # noqa: E402

from segback.engine.context import value_and_grad  # noqa: E402
from segback.engine.ring_attention import Ring  # noqa: E402
from segback.trainer import distributed  # noqa: E402


def refusal(out: Path, name: str, rank: int, fn) -> None:
    """Write the DistributedError `fn` raises on this rank (empty if none)."""
    try:
        fn()
        said = ""
    except distributed.DistributedError as e:
        said = str(e)
    (out / f"{name}.{rank}.txt").write_text(said)


def bad_input(world: distributed.World, out: Path) -> None:
    R, r = world.size, world.rank
    # ranks that disagree on the options all stop, none waits
    refusal(out, "refused", r, lambda: distributed.context_world(
        world, R, "zigzag", {"rank_differs": r == R - 1}))
    refusal(out, "indivisible", r, lambda: distributed.context_world(world, R + 1, "zigzag", {}))
    if R == 4:  # a ring 0 -> 2 -> 1 -> 3 -> 0: the ring backend cannot send 0 -> 2 or 1 -> 3
        order = [0, 2, 1, 3]
        c = order.index(r)
        ring = Ring(world.group, c, R, order[(c - 1) % R], order[(c + 1) % R])
        refusal(out, "neighbours", r, lambda: distributed.probe(ring, world))


def main(out: Path) -> None:
    world = distributed.init()
    bad_input(world, out)
    for name, order, steps in RUNS:
        cw = distributed.context_world(world, world.size, order, {"same": True})
        model, batch, lengths, plan, engine = case_inputs(name)
        opt = optimizer(name)
        for step in range(steps):
            (loss, n), grads = value_and_grad(model, batch, lengths, cw.ring, plan, **engine)
            summed = cw.context_sum_tree({"loss": loss, "n": mx.array(float(n)),
                                          "grads": grads})
            mx.eval(summed)
            if step == 0:
                first = summed, n
            opt.update(model, summed["grads"])
            mx.eval(model.parameters(), opt.state)
        if world.main:
            summed, n = first
            flat = {f"grad.{k}": np.array(v) for k, v in tree_flatten(summed["grads"])}
            flat |= {f"adapter.{k}": np.array(v)
                     for k, v in tree_flatten(model.trainable_parameters())}
            np.savez(out / f"{name}.{order}.npz", loss=np.array(summed["loss"]),
                     n=np.array(summed["n"]), local_n=np.array(n), steps=steps, **flat)

if __name__ == "__main__":
    main(Path(sys.argv[1]))
