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

Every line starts with where it was measured (`provenance`): the UTC date, the git revision of
this checkout ("-dirty" with uncommitted changes to tracked files), the machine (platform, CPU
model, core count, host memory, GPU name and memory; no host name), the mlx and mlx-lm versions,
and the sweep configuration (`--config-name`, see bench/sweep.py) and run label (`--run`).
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from segback.engine import options as engine_options
from segback.planner.cli import SEARCHED
from segback.planner.measure import parse_measure
from segback.backend.ops_per_buffer import CUDA_DEFAULT, limit_ops_per_buffer
from segback.backend.ops_per_buffer import ENV as OPS_ENV

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
    p.add_argument("--measure", type=parse_measure, default="auto", metavar="N",
                   help="with --segments auto: time N candidate plans on the model first and "
                   "keep the fastest measured within --target-gb, as `segback plan --measure` "
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


def _load(args):
    import mlx.core as mx

    from segback.models.geometry import GEOMETRIES, build_model

    gpu = mx.default_device() == mx.gpu
    dtype = {"auto": mx.bfloat16 if gpu else mx.float32, "float32": mx.float32,
             "bfloat16": mx.bfloat16, "float16": mx.float16}[args.dtype]
    if args.model in GEOMETRIES:
        return build_model(args.model, dtype=dtype, quantize_bits=args.quant_bits), dtype
    from segback.models.load import load

    model, _ = load(args.model, dequant_matmul=False)  # --dequant-matmul decides
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
                         boundaries_on_device=args.boundaries_on_device, options=runtime,
                         measure=args.measure)


def run_worker(args) -> dict:
    """One mode in this process; returns the result row."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx_lm.tuner.trainer import default_loss, grad_checkpoint
    from mlx_lm.tuner.utils import linear_to_lora_layers

    import numpy as np

    from segback.engine import Packed, memory_stats, reset_peak, value_and_grad
    from segback.engine.head import loss_mask
    from segback.planner.flops import matmul_peak
    from segback.planner.geometry import read_geometry

    mode = args.worker
    peak_flops = matmul_peak()  # before the model: nothing else holds memory yet
    model, dtype = _load(args)
    dequant = args.dequant_matmul == "true" or (args.dequant_matmul == "auto"
                                               and mode == "segmented")
    if dequant:
        from segback.models.dequant_linear import use_dequantized_matmul

        use_dequantized_matmul(model)
    model.freeze()
    n = len(model.layers)
    layers = n if args.lora_layers < 0 else args.lora_layers
    linear_to_lora_layers(model, layers, {"rank": args.lora_rank, "scale": 20.0, "dropout": 0.0})
    opt = optim.AdamW(learning_rate=1e-5)
    opt.init(model.trainable_parameters())
    vocab = model.args.vocab_size
    mx.random.seed(0)
    B, L = args.batch, args.seq
    batch, lengths = bench_batch(B, L, vocab, args.prompt_frac, args.pack, mode == "segmented")
    mx.eval(model.parameters(), opt.state, batch)
    row = {"mode": mode, "model": args.model, "seq": L, "batch": B,
           "device": str(mx.default_device()), "mlx": mx.__version__,
           "dequant_matmul": dequant}
    if args.pack:
        row |= {"pack": args.pack, "example_tokens": (L + 1) // args.pack,
                "packed": mode == "segmented"}
    for var in (OPS_ENV, "MLX_CUDA_GRAPH_CACHE_SIZE"):
        if var in os.environ:
            row[var.lower()] = int(os.environ[var])

    plan = None
    if mode == "segmented":
        plan = _plan(args, model, engine_options.from_args(args, skip=SEARCHED))
        opts = plan.engine.resolved()
        row["predicted_peak_gb"] = plan.predicted_peak_gb or None
        if args.target_gb is not None:
            row["target_gb"], row["meets_target"] = args.target_gb, plan.meets_target
        row["segments"] = [list(r) for r in plan.segments]
        if plan.inputs.get("measured"):
            row["measured"] = plan.inputs["measured"]
        row.update(opts.to_dict())
        stats: dict = {}

        def vg(m, b, lens):
            return value_and_grad(m, b, lens, plan, opts, stats=stats)
    else:
        if mode == "ckpt":
            grad_checkpoint(model.layers[0])
        vg = nn.value_and_grad(model, default_loss)

    if mode == "segmented" and opts.host_table:  # what the engine's first call does
        from segback.engine.host_table import park_tables, parked_bytes

        park_tables(model)  # the planner's timed candidates may have parked it already
        row["host_table_gb"] = round(parked_bytes(model) / 1024**3, 3)
    mx.clear_cache()
    row["resting_gb"] = round(memory_stats()["active_gb"], 3)
    times, peaks = [], []
    _progress(f"{mode}: resting {row['resting_gb']} GB, warm-up step and {args.steps} timed")
    for step in range(args.steps + 1):
        reset_peak()
        tic = time.perf_counter()
        (loss, ntoks), grads = vg(model, batch, lengths)
        opt.update(model, grads)
        mx.eval(loss, ntoks, model.parameters(), opt.state)
        times.append(time.perf_counter() - tic)
        peaks.append(memory_stats()["peak_gb"])
        _progress(f"{mode}: step {step}/{args.steps} {times[-1]:.3f} s, peak {peaks[-1]:.3f} GB")
        if step == 0:
            row["loss"] = round(float(loss), 6)
        del grads
    sec = statistics.median(times[1:]) if len(times) > 1 else times[0]
    if mode == "segmented" and opts.offload:
        row["host_gb"] = round(stats.get("host_gb", 0.0), 3)
    # Work of the examples as rows of their own (with --pack: N rows of (L + 1) // N tokens).
    rows, seq = (B, L) if not args.pack else (B * args.pack, (L + 1) // args.pack - 1)
    row.update(peak_gb=round(max(peaks), 3), s_per_step=round(sec, 4),
               first_step_s=round(times[0], 4),
               tokens_per_s=round(rows * seq / sec, 1), steps=args.steps)
    geom = read_geometry(model, args.lora_rank, None if args.lora_layers < 0 else args.lora_layers,
                         dtype, args.model)
    if mode == "segmented":  # which attention kernel each layer ran
        from collections import Counter

        from segback.planner.cost import CostModel

        cost = CostModel(geom, L, B, opts.attention, tile=opts.tile, mlp_chunk=opts.mlp_chunk)
        row["fast_kernels"] = cost.fast_kernels
        row["attention_kernels"] = dict(Counter(cost.kernel(g) for g in geom.layers))
    counted = lengths if isinstance(lengths, Packed) else np.array(lengths)
    loss_tokens = int(loss_mask(counted, batch.shape[1]).sum())
    row.update(throughput(geom, seq, rows, mode, plan, loss_tokens, rows * seq / sec,
                          peak_flops))
    return row


def bench_batch(B: int, L: int, vocab: int, prompt_frac: float, pack: int | None,
                packed: bool):
    """(batch, lengths) of random tokens: B rows of L + 1 tokens; with `pack` N, B x N examples
    of (L + 1) // N tokens, packed N to a row (`packed`) or one per row."""
    import mlx.core as mx

    if not pack:
        return (mx.random.randint(0, vocab, (B, L + 1)),
                mx.array([[int(prompt_frac * L), L]] * B))
    from segback.data.packing import collate_packed

    n = (L + 1) // pack
    if n < 2:
        raise SystemExit(f"--pack {pack}: examples of {n} token(s); raise --seq")
    ids = mx.random.randint(0, vocab, (B * pack, n))
    offset = int(prompt_frac * (n - 1))
    if not packed:
        return ids, mx.array([[offset, n - 1]] * (B * pack))
    rows = ids.tolist()
    return collate_packed([[(rows[b * pack + k], offset) for k in range(pack)]
                           for b in range(B)], pack * n, pad_to=1)


def _sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def throughput(geom, seq: int, batch: int, mode: str, plan, loss_tokens: int | None,
               tokens_per_s: float, peak_flops: float) -> dict:
    """A row's throughput keys (see the module docstring) for a step of `mode` on `geom`."""
    from segback.planner.flops import default_matmul_dtype, step_flops

    per_token = step_flops(geom, seq, batch, mode, plan, loss_tokens)["flops_per_token"]
    model_tflops = per_token * tokens_per_s / 1e12
    device_tflops = peak_flops / 1e12
    return {"flops_per_token": round(per_token),
            "model_tflops": _sig(model_tflops),
            "device_matmul_tflops": _sig(device_tflops),
            "matmul_dtype": str(default_matmul_dtype()).split(".")[-1],
            "hw_fraction": _sig(model_tflops / device_tflops) if device_tflops > 0 else None}


def git_revision(root: str | Path | None = None) -> str | None:
    """Short revision of the checkout segback runs from, "-dirty" if a tracked file differs
    from it; None outside a git checkout (an installed wheel) or without git."""
    root = Path(root or Path(__file__).resolve().parents[1])
    env = os.environ | {"GIT_OPTIONAL_LOCKS": "0"}  # read only: never touch a shared index

    def git(*cmd: str) -> str:
        return subprocess.run(["git", "-C", str(root), *cmd], capture_output=True, text=True,
                              check=True, timeout=30, env=env).stdout.strip()

    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() != root.resolve():
            return None  # segback is installed inside some other repository
        rev = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return rev + ("-dirty" if dirty else "")


_DEVICE_INFO = """import json, mlx.core as mx
gpu = mx.cuda.is_available() or mx.metal.is_available()
print(json.dumps({k: v for k, v in mx.device_info().items()} if gpu else None))"""


def _gpu_info() -> dict | None:
    """mlx's description of its GPU (None on a CPU-only mlx). Asked in a child process unless
    mlx is loaded here already: a parent holding a GPU context would take device memory from
    the modes it runs."""
    if "mlx.core" in sys.modules:
        import mlx.core as mx

        try:
            gpu = mx.cuda.is_available() or mx.metal.is_available()
            return dict(mx.device_info()) if gpu else None
        except (AttributeError, RuntimeError):  # an mlx without device_info
            return None
    try:
        out = subprocess.run([sys.executable, "-c", _DEVICE_INFO], capture_output=True,
                             text=True, timeout=120)
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    if platform.system() == "Darwin":
        try:
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"],
                                  capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or None


@functools.cache
def machine() -> dict:
    """The machine, without its host name: platform, CPU model, cores, host memory, GPU."""
    try:
        host_gb = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3, 1)
    except (ValueError, OSError, AttributeError):
        host_gb = None
    gpu = _gpu_info() or {}
    gpu_bytes = gpu.get("total_memory") or gpu.get("memory_size")
    return {"platform": f"{platform.system()}-{platform.machine()}", "cpu": _cpu_model(),
            "cores": os.cpu_count(), "memory_gb": host_gb,
            "gpu": gpu.get("device_name") or gpu.get("architecture") if gpu else None,
            "gpu_memory_gb": round(gpu_bytes / 1024**3, 1) if gpu_bytes else None}


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


@functools.cache
def _static_provenance() -> dict:
    return {"git": git_revision(), "machine": machine(), "mlx": _version("mlx"),
            "mlx_lm": _version("mlx-lm")}


def provenance(config: str | None = None, run: str | None = None) -> dict:
    """What every row of bench/data/runs.jsonl starts with (bench/ scripts use it too)."""
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            **_static_provenance(), "config": config, "run": run}


def with_provenance(row: dict, config: str | None = None, run: str | None = None) -> dict:
    """`row` after its provenance; the row's own keys (e.g. the worker's "mlx") win."""
    head = provenance(config, run)
    return head | row | {k: head[k] for k in ("date", "config", "run")}


def append_rows(path: str | Path, rows: list[dict]) -> None:
    """Append JSON lines to `path` (one write: concurrent appenders do not interleave lines)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))


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


def _progress(line: str) -> None:
    print(f"bench {line}", file=sys.stderr, flush=True)


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
