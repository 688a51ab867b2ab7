"""Where one segback training step's time goes, for the plan `segback train --plan auto` runs.

The step (value and gradients, evaluated; no optimizer update) is split into its phases, the
forward over the segments, the loss head and the reverse walk, and each phase into the time
spent inside `mx.eval` / `mx.async_eval` (the device's work and MLX's encoding of it) and the
time outside (Python building the graph, which the device waits for: the engine evaluates each
segment before building the next). Each evaluation also records the peak device memory since
the one before it and the memory still active after it, beside the plan's predicted peak per
segment, so a misprediction can be placed (a segment, the head, what stays alive between).
Per-kernel rates come from `bench/qmm_bench.py` (linears) and
`bench/attention_bench.py` (attention). One JSON line per run:

    python bench/step_profile.py --model e4b --quant-bits 4 --seq 4096 --target-gb 8

Quantized models run with dequantized matmuls and CUDA with segback's ops-per-buffer default,
as `segback train` does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import mlx.core as mx

from segback.benchmark.provenance import append_rows, with_provenance
from segback.engine import options as engine_options
from segback.engine.memory import GB
from segback.backend.ops_per_buffer import limit_ops_per_buffer
from segback.planner.cli import SEARCHED
from segback.planner.measure import parse_measure

PHASES = ("forward", "head", "backward")


def _segments(value: str) -> str | int:
    """--segments: "auto" or a number of layers a segment."""
    if value == "auto" or value.isdigit():
        return value if value == "auto" else int(value)
    raise argparse.ArgumentTypeError(f"auto or a number of layers, not {value!r}")


class Clock:
    """Wall time and time inside MLX's evaluation, per phase of one step.

    With `progress` (seconds), a line to stderr at most that often: a long step (128K tokens
    takes minutes) shows how far it got, even if it is cut off.
    """

    def __init__(self, progress: float | None = None) -> None:
        self.phase = "forward"
        self.trace: list[list] = []  # [phase, peak GB since the last evaluation, active GB]
        self.wall = dict.fromkeys(PHASES, 0.0)
        self.inside = dict.fromkeys(PHASES, 0.0)
        self.evals = dict.fromkeys(PHASES, 0)
        self.mark = self.start = self.said = time.perf_counter()
        self.progress = progress

    def enter(self, phase: str) -> None:
        now = time.perf_counter()
        self.wall[self.phase] += now - self.mark
        self.phase, self.mark = phase, now

    def timed(self, fn):
        def wrapper(*args, **kwargs):
            tic = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                now = time.perf_counter()
                self.inside[self.phase] += now - tic
                self.evals[self.phase] += 1
                self.trace.append([self.phase, round(mx.get_peak_memory() / GB, 3),
                                   round(mx.get_active_memory() / GB, 3)])
                mx.reset_peak_memory()
                if self.progress is not None and now - self.said >= self.progress:
                    self.said = now
                    print(f"step_profile: {now - self.start:.1f} s, {self.phase}, "
                          f"{self.evals[self.phase]} evaluations, peak "
                          f"{max(t[1] for t in self.trace):.2f} GB", file=sys.stderr,
                          flush=True)
        return wrapper


def profile_step(model, batch, lengths, plan, progress: float | None = None) -> dict:
    """Seconds per phase of one step, inside and outside evaluation (the step evaluated)."""
    from segback.engine import segmented, value_and_grad

    clock = Clock(progress)
    head_vjp = segmented.head_vjp

    def timed_head(*args, **kwargs):
        clock.enter("head")
        try:
            return head_vjp(*args, **kwargs)
        finally:
            clock.enter("backward")

    saved = (mx.eval, mx.async_eval)
    mx.eval, mx.async_eval = clock.timed(mx.eval), clock.timed(mx.async_eval)
    segmented.head_vjp = timed_head
    try:
        (loss, ntoks), grads = value_and_grad(model, batch, lengths, plan)
        mx.eval(loss, ntoks, grads)
        mx.synchronize()
        clock.enter("backward")
    finally:
        mx.eval, mx.async_eval = saved
        segmented.head_vjp = head_vjp
    row = {"step_s": round(sum(clock.wall.values()), 4), "loss": round(float(loss), 6),
           "peak_gb": max(t[1] for t in clock.trace), "memory_trace": clock.trace}
    for p in PHASES:
        row[f"{p}_peak_gb"] = max((t[1] for t in clock.trace if t[0] == p), default=0.0)
        row[f"{p}_s"] = round(clock.wall[p], 4)
        row[f"{p}_in_eval_s"] = round(clock.inside[p], 4)
        row[f"{p}_outside_s"] = round(clock.wall[p] - clock.inside[p], 4)
        row[f"{p}_evals"] = clock.evals[p]
    row["outside_s"] = round(sum(row[f"{p}_outside_s"] for p in PHASES), 4)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-e4b", help="geometry name (random weights)")
    p.add_argument("--quant-bits", type=int, default=None)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--target-gb", type=float, default=None)
    p.add_argument("--tile", default="auto", help="as `segback plan --tile` (default: auto)")
    p.add_argument("--offload", default="auto", help="as `segback plan --offload`")
    p.add_argument("--segments", type=_segments, default="auto",
                   help="auto (the planner's cut) or N layers per segment, as `segback bench "
                   "--segments` (then --tile and --offload must be given, not auto)")
    p.add_argument("--measure", type=parse_measure, default=0, metavar="N",
                   help="as `segback plan --measure-plan` (default 0: the cost model's pick)")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed steps after one warm-up step; 0 reports the warm-up step itself "
                   "(kernels built on the way: the first step a user waits for)")
    p.add_argument("--progress", type=float, default=10.0, metavar="SECONDS",
                   help="a progress line to stderr at most this often (default 10)")
    p.add_argument("--out", default=None, help="also append the row to this JSON lines file")
    p.add_argument("--config-name", default=None, help="row key \"config\"")
    p.add_argument("--run", default=None, help="row key \"run\"")
    engine = p.add_argument_group("engine options (segback.engine.EngineOptions)")
    engine_options.add_arguments(engine, skip=SEARCHED)
    args = p.parse_args(argv)
    limit_ops_per_buffer()  # before anything is evaluated, as the CLI does

    from mlx_lm.tuner.utils import linear_to_lora_layers

    from segback.engine import reset_peak
    from segback.models.dequant_linear import use_dequantized_matmul
    from segback.models.random_init import build_model
    from segback.planner import plan_segments

    gpu = mx.default_device() == mx.gpu
    model = build_model(args.model, dtype=mx.bfloat16 if gpu else mx.float32,
                        quantize_bits=args.quant_bits)
    model.freeze()
    linear_to_lora_layers(model, len(model.layers), {"rank": 8, "scale": 20.0, "dropout": 0.0})
    if args.quant_bits:
        use_dequantized_matmul(model)
    plan = plan_segments(model, args.seq, target_gb=args.target_gb, tile=args.tile,
                         offload=args.offload,
                         options=engine_options.from_args(args, skip=SEARCHED),
                         measure=args.measure,
                         segments=None if args.segments == "auto" else args.segments)
    mx.random.seed(0)
    batch = mx.random.randint(0, model.args.vocab_size, (1, args.seq + 1))
    lengths = [[0, args.seq]]
    mx.eval(model.parameters(), batch)

    reset_peak()
    first = profile_step(model, batch, lengths, plan, args.progress)  # kernels built, caches filled
    if args.repeats:
        reset_peak()
    rows = [profile_step(model, batch, lengths, plan, args.progress)
            for _ in range(args.repeats)] or [first]
    row = sorted(rows, key=lambda r: r["step_s"])[len(rows) // 2]
    row["peak_gb"] = max(r["peak_gb"] for r in rows)
    opts = plan.engine.resolved()
    row = {"script": "bench/step_profile.py", "model": args.model, "seq": args.seq,
           "device": str(mx.default_device()), "target_gb": args.target_gb,
           "segments": len(plan.segments), **opts.to_dict(),
           "predicted_peak_gb": plan.predicted_peak_gb, "peak_at": plan.peak_at,
           "predicted_breakdown_gb": {k: round(v, 3) for k, v in plan.breakdown.items()},
           "predicted_segment_gb": [round(x, 3) for x in plan.segment_gb],
           "step_s_all": [r["step_s"] for r in rows],
           "step_s_spread": round(statistics.pstdev(r["step_s"] for r in rows), 4),
           "warm": bool(args.repeats), **row}
    print(json.dumps(row), flush=True)
    if args.out:
        append_rows(args.out, [with_provenance(row, args.config_name, args.run)])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
