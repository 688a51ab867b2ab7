"""`segback bench`: training steps of mlx-lm (full / per-layer checkpoint) vs segmented backward.

Each mode runs in its own process (mlx-lm's `grad_checkpoint` patches the layer class, and MLX's
peak counter and buffer cache are per process) on the same model, LoRA and data, and prints one
JSON line: peak GB, resting GB, seconds per step (median after a warm-up step), tokens/s, the
first step's loss (equal across modes) — or the error if the mode crashed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from segback.engine import options as engine_options
from segback.planner.cli import SEARCHED

MODES = ("full", "ckpt", "segmented")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="geometry name (e.g. tiny-e4b, e4b) or path")
    p.add_argument("--seq", type=int, required=True, help="tokens per sequence (L)")
    p.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    p.add_argument("--modes", default=",".join(MODES), help="comma list of full,ckpt,segmented")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--lora-layers", type=int, default=-1, help="-1 = all layers")
    p.add_argument("--quant-bits", type=int, default=None, help="quantize a random geometry")
    p.add_argument("--dtype", default="auto", help="auto (float32 on CPU, bfloat16 on GPU)")
    p.add_argument("--segments", default="auto",
                   help="auto (the planner), N layers per segment, or a plan JSON file")
    p.add_argument("--target-gb", type=float, default=None, help="planner memory target")
    search = p.add_argument_group("the planner's choices (with --segments auto)")
    search.add_argument("--attention", default="fused", choices=["fused", "chunked"])
    search.add_argument("--tile", default=None, help="tokens per tile, or auto")
    search.add_argument("--offload", default="false", nargs="?", const="true", type=str.lower,
                        choices=["true", "false", "auto"],
                        help="park boundaries and per-layer inputs in host memory (with --tile)")
    search.add_argument("--light-tile", default=None,
                        help="tokens per tile of the light passes (default: --tile)")
    search.add_argument("--boundaries-on-device", default="auto",
                        help="with --offload: the last N segments keep their boundary on the "
                        "device; auto: as many as --target-gb allows")
    run = p.add_argument_group("how the engine runs (on top of the plan)")
    engine_options.add_arguments(run, skip=SEARCHED)
    p.add_argument("--prompt-frac", type=float, default=0.0,
                   help="fraction of tokens masked out of the loss as prompt")
    p.add_argument("--timeout", type=int, default=3600, help="seconds per mode")
    p.add_argument("--max-ops-per-buffer", type=int, default=None,
                   help="MLX_MAX_OPS_PER_BUFFER for every mode (CUDA frees buffers per graph)")
    p.add_argument("--out", default=None, help="also append the JSON lines to this file")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)


def _load(args):
    import mlx.core as mx

    from segback.models.geometry import GEOMETRIES, build_model

    gpu = mx.default_device() == mx.gpu
    dtype = {"auto": mx.bfloat16 if gpu else mx.float32, "float32": mx.float32,
             "bfloat16": mx.bfloat16, "float16": mx.float16}[args.dtype]
    if args.model in GEOMETRIES:
        return build_model(args.model, dtype=dtype, quantize_bits=args.quant_bits), dtype
    from segback.models.load import load

    model, _ = load(args.model)
    return model, dtype


def _plan(args, model, runtime):
    """The Plan this run uses: the planner's, a plan file's, or N layers per segment."""
    from segback.engine import EngineOptions, Plan, segments_of

    if args.segments.isdigit():
        searched = {k: getattr(args, k) for k in SEARCHED if k != "boundaries_on_device"}
        keep = args.boundaries_on_device
        engine = EngineOptions.from_dict(runtime.to_dict() | searched
                                         | {"boundaries_on_device": 0 if keep == "auto"
                                            else keep})
        return Plan(segments_of(int(args.segments), len(model.layers)), engine)
    if args.segments != "auto":
        return Plan.read(args.segments)
    from segback.planner import plan_segments

    return plan_segments(model, args.seq, args.batch, target_gb=args.target_gb,
                         attention=args.attention, lora_rank=args.lora_rank, tile=args.tile,
                         offload=args.offload,
                         light_tile=None if args.light_tile is None else int(args.light_tile),
                         boundaries_on_device=args.boundaries_on_device, options=runtime)


def run_worker(args) -> dict:
    """One mode in this process; returns the result row."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx_lm.tuner.trainer import default_loss, grad_checkpoint
    from mlx_lm.tuner.utils import linear_to_lora_layers

    from segback.engine import memory_stats, reset_peak, value_and_grad

    mode = args.worker
    model, _ = _load(args)
    model.freeze()
    n = len(model.layers)
    layers = n if args.lora_layers < 0 else args.lora_layers
    linear_to_lora_layers(model, layers, {"rank": args.lora_rank, "scale": 20.0, "dropout": 0.0})
    opt = optim.AdamW(learning_rate=1e-5)
    opt.init(model.trainable_parameters())
    vocab = model.args.vocab_size
    mx.random.seed(0)
    B, L = args.batch, args.seq
    batch = mx.random.randint(0, vocab, (B, L + 1))
    lengths = mx.array([[int(args.prompt_frac * L), L]] * B)
    mx.eval(model.parameters(), opt.state, batch)
    row = {"mode": mode, "model": args.model, "seq": L, "batch": B,
           "device": str(mx.default_device()), "mlx": mx.__version__}
    for var in ("MLX_MAX_OPS_PER_BUFFER", "MLX_CUDA_GRAPH_CACHE_SIZE"):
        if var in os.environ:
            row[var.lower()] = int(os.environ[var])

    if mode == "segmented":
        plan = _plan(args, model, engine_options.from_args(args, skip=SEARCHED))
        opts = plan.engine.resolved()
        row["predicted_peak_gb"] = plan.predicted_peak_gb or None
        row["segments"] = [list(r) for r in plan.segments]
        row.update(opts.to_dict())
        stats: dict = {}

        def vg(m, b, lens):
            return value_and_grad(m, b, lens, plan, opts, stats=stats)
    else:
        if mode == "ckpt":
            grad_checkpoint(model.layers[0])
        vg = nn.value_and_grad(model, default_loss)

    if mode == "segmented" and opts.offload:  # what the engine's first call would do
        from segback.engine.host_table import park_tables

        row["host_table_gb"] = round(park_tables(model) / 1024**3, 3)
    mx.clear_cache()
    row["resting_gb"] = round(memory_stats()["active_gb"], 3)
    times, peaks = [], []
    for step in range(args.steps + 1):
        reset_peak()
        tic = time.perf_counter()
        (loss, ntoks), grads = vg(model, batch, lengths)
        opt.update(model, grads)
        mx.eval(loss, ntoks, model.parameters(), opt.state)
        times.append(time.perf_counter() - tic)
        peaks.append(memory_stats()["peak_gb"])
        if step == 0:
            row["loss"] = round(float(loss), 6)
        del grads
    sec = statistics.median(times[1:]) if len(times) > 1 else times[0]
    if mode == "segmented" and opts.offload:
        row["host_gb"] = round(stats.get("host_gb", 0.0), 3)
    row.update(peak_gb=round(max(peaks), 3), s_per_step=round(sec, 4),
               first_step_s=round(times[0], 4),
               tokens_per_s=round(B * L / sec, 1), steps=args.steps)
    return row


def _worker_argv(args, mode: str) -> list[str]:
    argv = [sys.executable, "-m", "segback.cli", "bench", "--worker", mode]
    for key, value in vars(args).items():
        if key in ("worker", "out", "timeout", "modes", "command", "_module",
                   "max_ops_per_buffer") or value is None or value is False:
            continue
        if value is True:
            argv.append(f"--{key.replace('_', '-')}")
            continue
        argv += [f"--{key.replace('_', '-')}", str(value)]
    return argv


def main(args) -> int:
    if args.worker:
        print(json.dumps(run_worker(args)), flush=True)
        return 0
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise SystemExit(f"unknown mode(s) {bad}; choose from {', '.join(MODES)}")
    env = os.environ.copy()
    if args.max_ops_per_buffer:
        env["MLX_MAX_OPS_PER_BUFFER"] = str(args.max_ops_per_buffer)
    for mode in modes:
        tic = time.perf_counter()
        try:
            proc = subprocess.run(_worker_argv(args, mode), capture_output=True, text=True,
                                  timeout=args.timeout, env=env)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            if proc.returncode == 0 and lines:
                row = json.loads(lines[-1])
            else:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
                row = {"mode": mode, "model": args.model, "seq": args.seq,
                       "error": " | ".join(tail) or f"exit code {proc.returncode}"}
        except subprocess.TimeoutExpired:
            row = {"mode": mode, "model": args.model, "seq": args.seq,
                   "error": f"timeout after {args.timeout}s"}
        row["wall_s"] = round(time.perf_counter() - tic, 1)
        line = json.dumps(row)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")
    return 0
