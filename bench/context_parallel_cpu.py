"""Context parallelism on the CPU: one sequence over R local ranks (mlx.launch, ring backend)
against one process on the whole sequence, and the load balance of the two shard orders.

Three measurements, one JSON line each:

- `one`: one process runs `segback.engine.value_and_grad` on the whole L tokens (all cores for
  BLAS): seconds per step, peak memory.
- `ring`: R ranks (`mlx.launch -n R --backend ring`, cores / R BLAS threads each) run
  `segback.engine.context.value_and_grad` on their shards and sum the shares, as
  `segback train --context-parallel R` does: each rank's seconds per step and peak memory, and
  the planner's prediction of that peak (`RingCostModel`) beside it.
- `balance`: each rank's work alone, one after another in one process with every core, the
  exchanges replaced by keeping the block in hand (`LocalRing`: the same chunks and key ranges
  are scored, only the values differ), so no rank waits for another and none shares the cores:
  the busiest rank's seconds over the mean, for zig-zag and contiguous shards. (On a CPU the
  ranks of a real run share the cores and a waiting rank spins, so their own step times cannot
  show it.)

    python bench/context_parallel_cpu.py                      # dense-256, L 4096, R 2 and 4
    python bench/context_parallel_cpu.py --seq 2048 --ranks 2 --out bench/data/runs.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from distributed_cpu import environment, free_port  # noqa: E402

GB = 1024**3


def inputs(model_name: str, seq: int, lora_rank: int):
    """(model with LoRA on every linear, batch [1, seq + 1], lengths): every token trained."""
    import mlx.core as mx
    from mlx_lm.tuner.utils import linear_to_lora_layers

    from segback.models.random_init import build_model, geometry_config

    config = geometry_config(model_name)
    model = build_model(config, dtype=mx.float32)
    model.freeze()
    linear_to_lora_layers(model, len(model.layers), {"rank": lora_rank, "scale": 2.0,
                                                     "dropout": 0.0})
    mx.random.seed(0)
    batch = mx.random.randint(0, int(config["vocab_size"]), (1, seq + 1))
    lengths = mx.array([[1, seq]])
    mx.eval(model.parameters(), batch)
    return model, batch, lengths


def engine_options(args: argparse.Namespace) -> dict:
    return {"tile": args.tile, "offload": True} if args.offload else \
        ({"tile": args.tile} if args.tile else {})


def timed_steps(step, steps: int) -> tuple[list[float], float]:
    """(seconds of each step after the first, the largest peak GB of those steps)."""
    import mlx.core as mx

    seconds, peak = [], 0.0
    for i in range(steps + 1):
        mx.reset_peak_memory()
        tic = time.perf_counter()
        step()
        if i:  # the first step builds and warms
            seconds.append(time.perf_counter() - tic)
            peak = max(peak, mx.get_peak_memory() / GB)
    return seconds, peak


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def one_process(args: argparse.Namespace) -> dict:
    import mlx.core as mx

    from segback.engine import value_and_grad

    model, batch, lengths = inputs(args.model, args.seq, args.lora_rank)

    def step():
        (loss, _), grads = value_and_grad(model, batch, lengths, args.plan,
                                          **engine_options(args))
        mx.eval(loss, grads)

    seconds, peak = timed_steps(step, args.steps)
    return {"bench": "context_parallel_cpu", "measure": "one", "model": args.model,
            "seq": args.seq, "plan": args.plan, "tile": args.tile, "offload": args.offload,
            "blas_threads": args.cores, "seconds_per_step": median(seconds),
            "peak_gb": peak}


def ring_worker(args: argparse.Namespace) -> None:
    """One rank of a `mlx.launch` run; rank 0 prints the ranks' numbers."""
    from dataclasses import replace

    import mlx.core as mx
    import numpy as np

    from segback.engine.context import value_and_grad
    from segback.trainer import distributed

    world = distributed.init()
    cw = distributed.context_world(world, world.size, args.order, vars(args))
    ring = replace(cw.ring, stream=mx.new_stream(mx.cpu)) if args.exchange_stream else cw.ring
    model, batch, lengths = inputs(args.model, args.seq, args.lora_rank)

    def step():
        (loss, n), grads = value_and_grad(model, batch, lengths, ring, args.plan,
                                          **engine_options(args))
        mx.eval(cw.context_sum_tree({"loss": loss, "grads": grads}))

    seconds, peak = timed_steps(step, args.steps)
    mine = mx.array([median(seconds), peak, float(np.sum(seconds))])
    every = np.array(world.all_gather(mine[None])).reshape(world.size, -1)
    if world.main:
        print(json.dumps({"bench": "context_parallel_cpu", "measure": "ring",
                          "model": args.model, "seq": args.seq, "ranks": world.size,
                          "order": args.order, "plan": args.plan, "tile": args.tile,
                          "offload": args.offload, "exchange_stream": args.exchange_stream,
                          "blas_threads_per_rank": int(os.environ.get("OPENBLAS_NUM_THREADS",
                                                                      "0")),
                          "seconds_per_step": float(every[:, 0].max()),
                          "rank_seconds_per_step": every[:, 0].round(4).tolist(),
                          "rank_peak_gb": every[:, 1].round(4).tolist(),
                          "predicted_peak_gb": predicted_peak(args, world.size)}),
              flush=True)


def predicted_peak(args: argparse.Namespace, ranks: int) -> float:
    """The planner's per-rank peak for this run (float32 activations, the CPU's constants)."""
    from segback.planner import plan_segments

    plan = plan_segments(args.model, args.seq, lora_rank=args.lora_rank, dtype="float32",
                         segments=args.plan, tile=args.tile,
                         offload=bool(args.offload), context_parallel=ranks,
                         context_order=args.order)
    return round(plan.predicted_peak_gb, 4)


def launch_ring(args: argparse.Namespace, ranks: int, order: str, stream: bool) -> dict:
    cmd = [str(Path(sys.executable).parent / "mlx.launch"), "-n", str(ranks), "--backend",
           "ring", "-p", str(free_port(ranks)), "--", sys.executable, __file__, "--worker",
           "--model", args.model, "--seq", str(args.seq), "--plan", str(args.plan),
           "--steps", str(args.steps), "--order", order, "--lora-rank", str(args.lora_rank)]
    cmd += ["--tile", str(args.tile)] if args.tile else []
    cmd += ["--offload"] if args.offload else []
    cmd += ["--exchange-stream"] if stream else []
    p = subprocess.run(cmd, cwd=ROOT, env=environment(max(1, args.cores // ranks)),
                       stdin=subprocess.DEVNULL, capture_output=True, text=True)
    rows = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    if "Node with rank" in p.stderr or not rows:
        sys.exit(f"{' '.join(cmd)} failed:\n{p.stdout}\n{p.stderr}")
    return rows[0]


def balance(args: argparse.Namespace, ranks: int, order: str) -> dict:
    """Each rank's step alone (`LocalRing`), one after another in this process."""
    import mlx.core as mx

    from segback.engine.context import value_and_grad
    from segback.engine.ring_attention import Ring

    class LocalRing(Ring):
        """Rank `rank` of `size` with the block in hand kept at every exchange: the same
        chunks, key ranges and FLOPs as the real ring, no messages, no waiting."""

        def rotate(self, x):
            return x

    model, batch, lengths = inputs(args.model, args.seq, args.lora_rank)
    seconds = []
    for r in range(ranks):
        ring = LocalRing(None, r, ranks, r, r, order)

        def step(ring=ring):
            (loss, _), grads = value_and_grad(model, batch, lengths, ring, args.plan,
                                              **engine_options(args))
            mx.eval(loss, grads)

        seconds.append(median(timed_steps(step, args.steps)[0]))
    mean = sum(seconds) / ranks
    return {"bench": "context_parallel_cpu", "measure": "balance", "model": args.model,
            "seq": args.seq, "ranks": ranks, "order": order, "plan": args.plan,
            "tile": args.tile, "blas_threads": args.cores,
            "rank_seconds_per_step": [round(s, 4) for s in seconds],
            "busiest_over_mean": max(seconds) / mean}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="dense-256", help="geometry (random weights, float32)")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--orders", nargs="+", default=["zigzag", "contiguous"])
    p.add_argument("--steps", type=int, default=2, help="timed steps (after one warm-up)")
    p.add_argument("--plan", type=int, default=4, help="layers per segment")
    p.add_argument("--tile", type=int, default=None, help="tiled engine on each rank")
    p.add_argument("--offload", action="store_true", help="with --tile: boundaries on host")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--cores", type=int, default=os.cpu_count() or 1,
                   help="cores the ranks share (BLAS threads: cores / ranks each)")
    p.add_argument("--exchange-stream", action="store_true",
                   help="also run each ring with its exchanges on their own CPU stream")
    p.add_argument("--measures", nargs="+", default=["one", "ring", "balance"],
                   choices=["one", "ring", "balance"], help="which measurements to run")
    p.add_argument("--out", default=None, help="append the rows to this JSON-lines file")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--order", default="zigzag", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        ring_worker(args)
        return
    os.environ.update(environment(args.cores))
    rows = []
    streams = [False, True] if args.exchange_stream else [False]
    todo = {"one": [lambda: one_process(args)],
            "ring": [lambda r=r, o=o, s=s: launch_ring(args, r, o, s) for r in args.ranks
                     for o in args.orders for s in streams],
            "balance": [lambda r=r, o=o: balance(args, r, o) for r in args.ranks
                        for o in args.orders]}
    for make in [m for name in args.measures for m in todo[name]]:
        row = make()
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out:
        from segback.benchmark.provenance import append_rows, with_provenance

        append_rows(args.out, [with_provenance(r, "context-parallel-cpu") for r in rows])


if __name__ == "__main__":
    main()
