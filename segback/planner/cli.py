"""`segback plan`: the command line over `plan_segments`."""

from __future__ import annotations

import argparse
import math
import sys

from segback.engine import options as engine_options
from segback.engine.options import AUTO, OptionsError
from segback.engine.plan_file import PlanError
from segback.io import atomic_write_json
from segback.planner.geometry import DTYPES
from segback.planner.host import HOST_FRACTION
from segback.planner.measure import parse_measure
from segback.planner.plan import describe, plan_segments
from segback.planner.space import SEARCHED, SearchSpace

# A predicted peak past this is no plan for any machine: said, not silently written.
ABSURD_GB = 1 << 16


def host_gb(value: str) -> float | str | None:
    """--host-gb: GB, auto or none."""
    low = value.strip().lower()
    if low in (AUTO, "none"):
        return None if low == "none" else AUTO
    try:
        gb = float(value)
    except ValueError:
        gb = math.nan
    if not (math.isfinite(gb) and gb > 0):
        raise argparse.ArgumentTypeError(f"a number of GB > 0, auto or none, not {value!r}")
    return gb


def number_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the numbers given (NaN, a negative target, ...), in one line."""
    for flag, v, low, inclusive in (("--seq", args.seq, 2, True), ("--batch", args.batch, 1, True),
                                    ("--context-parallel", args.context_parallel, 1, True),
                                    ("--target-gb", args.target_gb, 0.0, False),
                                    ("--time-budget", args.time_budget, 1.0, True)):
        if v is None:
            continue
        if not math.isfinite(v) or v < low or (v == low and not inclusive):
            return (f"{flag} {v}: give a finite number {'>=' if inclusive else '>'} {low:g}"
                    + (" (GB)" if flag == "--target-gb" else ""))
    return None


def describe_context(plan) -> str:
    """What one context-parallel rank holds and sends, for humans."""
    c = plan.context
    return (f"context parallel: {c['ranks']} ranks ({c['order']}), {c['shard_tokens']} of "
            f"{c['seq_len']} tokens each: peak {plan.predicted_peak_gb:.2f} GB per rank "
            f"(ring K/V buffers {c['ring_buffer_gb']:.2f} GB of it); each rank sends "
            f"{c['sent_gb_per_step']:.2f} GB per step in {c['messages_per_step']} messages; "
            f"attention work of the busiest rank {c['balance']:.3f} x the mean")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="MLX checkpoint directory or geometry name (e.g. e4b, tiny-llama)")
    parser.add_argument("--seq", "--max-seq-length", dest="seq", type=int, required=True,
                        help="sequence length L")
    parser.add_argument("--batch", "--batch-size", dest="batch", type=int, default=1)
    parser.add_argument("--target-gb", type=float, default=None, help="peak memory target")
    parser.add_argument("--host-gb", type=host_gb, default=AUTO,
                        help="host memory an offloading plan may park (GB); auto (default): "
                        f"{HOST_FRACTION:.0%}% of what is available now; none: no bound")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="max step time relative to a plain forward+backward (e.g. 1.5)")
    parser.add_argument("--calibrate", action="store_true",
                        help="measure a 1- and a 2-layer segment at two lengths and fit the "
                        "cost model (a geometry is built with random weights)")
    parser.add_argument("--measure-plan", "--measure", dest="measure", type=parse_measure,
                        default=AUTO, metavar="N",
                        help="time N candidate plans (predicted to meet --target-gb, "
                        "fastest first; more while none measured within it), a warm-up and a timed "
                        "step each, on the real model and keep the fastest measured within the "
                        "target (a geometry is built with random weights); all of them within 3 of "
                        "the pick's predicted steps; auto (default): 3 on a GPU with --target-gb, "
                        "else 0 (the cost model alone)")
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--lora-layers", "--num-layers", dest="lora_layers", type=int,
                        default=None, help="LoRA on the last N layers (default: all)")
    parser.add_argument("--quant-bits", type=int, default=None,
                        help="quantize a geometry's weights to N bits (checkpoints carry theirs)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="compute dtype (default: the checkpoint's, bfloat16 for geometries)")
    parser.add_argument("--out", required=True, help="plan JSON to write")
    parser.add_argument("--context-parallel", type=int, default=1, metavar="R",
                        help="plan one rank of R that split each sequence (segback train "
                        "--context-parallel R): the peak is a rank's, and the plan says how "
                        "many bytes each rank sends per step")
    parser.add_argument("--context-order", choices=["zigzag", "contiguous"], default="zigzag",
                        help="how --context-parallel shards a sequence (as segback train)")
    search = parser.add_argument_group("what the planner chooses")
    search.add_argument("--attention", choices=["fused", "chunked"], default="fused")
    search.add_argument("--tile", default=None,
                        help="tokens per tile for the sequence-tiled engine (implies chunked "
                        "attention), or 'auto' to weigh untiled and every tile size")
    search.add_argument("--offload", nargs="?", const="true", default="false", type=str.lower,
                        choices=["true", "false", AUTO],
                        help="park boundaries and per-layer inputs in host memory (with "
                        "--tile); 'auto' weighs both")
    search.add_argument("--light-tile", default=None,
                        help="tokens per tile of the tiled engine's light passes (the pre "
                        "pass, its VJP and the forward post pass); default: --tile")
    search.add_argument("--boundaries-on-device", "--offload-keep", dest="boundaries_on_device",
                        default=AUTO,
                        help="with --offload: the last N segments keep their boundary on the "
                        "device (no host copies); 'auto' (default): as many as --target-gb "
                        "allows, none without a target")
    run = parser.add_argument_group("how the engine runs the plan (stored in it)")
    engine_options.add_arguments(run, skip=SEARCHED)


def main(args: argparse.Namespace) -> int:
    problem = number_problem(args)
    if problem:
        print(f"segback plan: error: {problem}", file=sys.stderr)
        return 2
    try:
        runtime = engine_options.from_args(args, skip=SEARCHED)
        space = SearchSpace.from_dict({k: getattr(args, k) for k in SEARCHED})
        plan = plan_segments(args.model, args.seq, args.batch, args.target_gb, args.time_budget,
                             args.calibrate, args.lora_rank, args.lora_layers, args.dtype,
                             quant_bits=args.quant_bits, space=space, options=runtime,
                             measure=args.measure, context_parallel=args.context_parallel,
                             context_order=args.context_order,
                             host_gb=args.host_gb)
    except (ValueError, FileNotFoundError, OptionsError, PlanError) as e:  # no traceback
        print(f"segback plan: error: {e}", file=sys.stderr)
        return 2
    plan.inputs["model"] = str(args.model)
    if plan.predicted_peak_gb > ABSURD_GB:
        print(f"segback plan: warning: the plan predicts a peak of {plan.predicted_peak_gb:.3g} "
              f"GB at --seq {args.seq} --batch {args.batch}: no machine has that; check the "
              "length and batch", file=sys.stderr)
    try:
        atomic_write_json(args.out, plan.to_dict())
    except OSError as e:  # a WriteError: names --out, says what to do
        print(f"segback plan: error: {e}", file=sys.stderr)
        return 2
    engine = plan.engine
    print(describe(plan))
    print(f"predicted peak {plan.predicted_peak_gb:.2f} GB (at {plan.peak_at}), "
          f"relative step time {plan.predicted_relative_step_time:.2f}"
          + (f", tile {engine.tile}" if engine.tile else "")
          + (f", {plan.predicted_host_gb:.2f} GB in host memory" if engine.offload else ""))
    if plan.context:
        print(describe_context(plan))
    if not (plan.meets_target and plan.meets_time_budget):
        print(f"warning: {plan.message}", file=sys.stderr)
    return 0
