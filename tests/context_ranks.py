"""Run under `mlx.launch -n R`: one context-parallel group of all R ranks computes loss and
LoRA gradients of tiny models on whole rows split over the ring (`segback.engine.context`), for
tests/test_context_parallel.py to compare with one process. Rank 0 writes OUT/CASE.npz per case.

    mlx.launch -n 2 --backend ring -- python tests/context_ranks.py OUT
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).parent))
from context_cases import CASES, case_inputs  # noqa: E402

from segback.engine.context import value_and_grad  # noqa: E402
from segback.trainer import distributed  # noqa: E402


def main(out: Path) -> None:
    world = distributed.init()
    R = world.size
    # ranks that disagree on the options all stop, none waits
    try:
        distributed.context_world(world, R, "zigzag", {"rank_differs": world.rank == R - 1})
        refused = ""
    except distributed.DistributedError as e:
        refused = str(e)
    if world.main:
        (out / "refused.txt").write_text(refused)
    for name in CASES:
        for order in ("zigzag", "contiguous"):
            cw = distributed.context_world(world, R, order, {"same": True})
            model, batch, lengths, plan = case_inputs(name)
            (loss, n), grads = value_and_grad(model, batch, lengths, cw.ring, plan)
            summed = cw.context_sum_tree({"loss": loss, "n": mx.array(float(n)),
                                          "grads": grads})
            mx.eval(summed)
            if world.main:
                flat = {f"grad.{k}": np.array(v) for k, v in tree_flatten(summed["grads"])}
                np.savez(out / f"{name}.{order}.npz", loss=np.array(summed["loss"]),
                         n=np.array(summed["n"]), local_n=np.array(n), **flat)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
