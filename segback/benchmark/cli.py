"""`segback bench`: training steps of mlx-lm (full / per-layer checkpoint) vs segmented backward.

Each mode runs in its own process (mlx-lm's `grad_checkpoint` patches the layer class, and MLX's
peak counter and buffer cache are per process) on the same model, LoRA and data, and prints one
JSON line: peak GB, resting GB, seconds per step (median after a warm-up step), tokens/s, the
first step's loss (equal across modes) — or the error if the mode crashed.

`--pack N` compares packing: B x N random examples of (seq + 1) // N tokens, packed N to a row
(block-diagonal attention, `segback.data.packing`) in the segmented mode, and as B x N rows of their
own in the mlx-lm modes; the loss is the same. Rows get `pack`, `example_tokens` and `packed`;
tokens_per_s counts the examples' input tokens as rows of their own (B x N x (tokens - 1)).

Throughput keys of every row (segback.planner.flops says what is counted):

    flops_per_token       model FLOPs of one step per input token, from the geometry: forward,
                          backward and the recompute this mode does (ckpt and segmented: one
                          more forward of the layers; tiled: also the boundaries inside a
                          segment and Q/K/V once more); causal / sliding-window attention
    model_tflops          flops_per_token x tokens_per_s / 1e12
    device_matmul_tflops  measured rate of a large square matmul on this device, in
    matmul_dtype          this dtype (bfloat16 on a GPU, float32 on the CPU); once per row
    hw_fraction           model_tflops / device_matmul_tflops

Every line starts with where it was measured (`segback.benchmark.provenance`), with the sweep
configuration (`--config-name`, see bench/sweep.py) and run label (`--run`).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import threading
import time

from segback.backend.ops_per_buffer import CUDA_DEFAULT, limit_ops_per_buffer
from segback.backend.ops_per_buffer import ENV as OPS_ENV
from segback.benchmark.provenance import append_rows, with_provenance
from segback.benchmark.worker import run_worker
from segback.engine import options as engine_options
from segback.planner.cli import SEARCHED
from segback.planner.measure import parse_measure

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
    p.add_argument("--dequant-matmul", default="false", nargs="?", const="true",
                   choices=["auto", "true", "false"], type=str.lower,
                   help="quantized linears run long sequences as dequantize-then-matmul "
                   "(segback.models.dequant_linear): true in every mode; auto in the segmented "
                   "mode only (as `segback train` loads models; the mlx-lm modes as mlx-lm "
                   "ships); false (default, as every row before it was measured)")
    p.add_argument("--segments", default="auto",
                   help="auto (the planner), N layers per segment, or a plan JSON file")
    p.add_argument("--target-gb", type=float, default=None, help="planner memory target")
    p.add_argument("--measure-plan", "--measure", dest="measure", type=parse_measure,
                   default="auto", metavar="N",
                   help="with --segments auto: time N candidate plans on the "
                   "model first and keep the fastest measured within --target-gb, as `segback "
                   "train --measure-plan` "
                   "(auto, the default: 3 on a GPU with --target-gb, else 0)")
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
    p.add_argument("--pack", type=int, default=None, metavar="N",
                   help="N examples of (seq + 1) // N tokens per row: packed into one row "
                   "(block-diagonal mask) in the segmented mode, N rows of their own in the "
                   "mlx-lm modes (the same examples, the same loss)")
    p.add_argument("--prompt-frac", type=float, default=0.0,
                   help="fraction of tokens masked out of the loss as prompt")
    p.add_argument("--timeout", type=int, default=3600, help="seconds per mode")
    p.add_argument("--max-ops-per-buffer", type=int, default=None,
                   help="MLX_MAX_OPS_PER_BUFFER for every mode (CUDA frees buffers per graph); "
                   "default: the environment's, or where unset MLX's own for mlx-lm's modes and "
                   f"segback's CUDA default ({CUDA_DEFAULT}) for the segmented mode")
    p.add_argument("--out", default=None, help="also append the JSON lines to this file")
    p.add_argument("--config-name", default=None,
                   help="name of the bench/sweep.py configuration this run is (row key "
                   "\"config\")")
    p.add_argument("--run", default=None,
                   help="label shared by the rows of one sweep (row key \"run\")")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)


def _worker_argv(args, mode: str) -> list[str]:
    argv = [sys.executable, "-m", "segback.cli", "bench", "--worker", mode]
    for key, value in vars(args).items():
        if key in ("worker", "out", "timeout", "modes", "command", "_module", "config_name",
                   "run", "max_ops_per_buffer") or value is None or value is False:
            continue
        if value is True:
            argv.append(f"--{key.replace('_', '-')}")
            continue
        argv += [f"--{key.replace('_', '-')}", str(value)]
    return argv


def _mode_env(args, mode: str) -> dict[str, str]:
    """A worker's environment: `--max-ops-per-buffer` for every mode, else the user's, with
    segback's CUDA default filled in for the segmented mode (as `segback train` runs) and not
    for mlx-lm's (as it ships)."""
    env = os.environ.copy()
    if args.max_ops_per_buffer:
        env[OPS_ENV] = str(args.max_ops_per_buffer)
    elif mode == "segmented":
        limit_ops_per_buffer(env)
    return env


def _run_worker(argv: list[str], env: dict[str, str],
                timeout: float) -> tuple[int | None, str, list[str]]:
    """Run one mode's worker, passing its stderr (the plan, each step) through as it comes, so
    that a slow or killed mode still shows how far it got. Returns its exit code (None after a
    timeout), its stdout and the last lines of its stderr."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    tail: collections.deque[str] = collections.deque(maxlen=20)
    out: list[str] = []

    def echo() -> None:
        for line in proc.stderr:
            sys.stderr.write(line)
            sys.stderr.flush()
            tail.append(line.rstrip())

    readers = [threading.Thread(target=echo, daemon=True),
               threading.Thread(target=lambda: out.append(proc.stdout.read()), daemon=True)]
    for t in readers:
        t.start()
    try:
        code: int | None = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        code = None
    for t in readers:
        t.join(timeout=5)
    return code, "".join(out), [ln for ln in tail if ln]


def main(args) -> int:
    if args.worker:
        print(json.dumps(run_worker(args)), flush=True)
        return 0
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise SystemExit(f"unknown mode(s) {bad}; choose from {', '.join(MODES)}")
    for mode in modes:
        tic = time.perf_counter()
        code, stdout, tail = _run_worker(_worker_argv(args, mode), _mode_env(args, mode),
                                         args.timeout)
        lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
        if code == 0 and lines:
            row = json.loads(lines[-1])
        else:
            error = (f"timeout after {args.timeout}s" if code is None else
                     " | ".join(tail[-3:]) or f"exit code {code}")
            if code is None and tail:
                error += f"; last output: {tail[-1]}"
            row = {"mode": mode, "model": args.model, "seq": args.seq, "error": error}
        row["wall_s"] = round(time.perf_counter() - tic, 1)
        row = with_provenance(row, args.config_name, args.run)
        print(json.dumps(row), flush=True)
        if args.out:
            append_rows(args.out, [row])
    return 0
