"""One mode of `segback bench` in this process (`segback bench --worker MODE`): load the model,
attach LoRA, plan (segmented mode), run a warm-up and the timed steps, return the row.

Runs only in a worker process: mlx-lm's `grad_checkpoint` patches the layer class, and MLX's
peak counter and buffer cache are per process.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections import Counter

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx_lm.tuner.trainer import default_loss, grad_checkpoint
from mlx_lm.tuner.utils import linear_to_lora_layers

from segback.backend.ops_per_buffer import ENV as OPS_ENV
from segback.data.packing import collate_packed
from segback.engine import EngineOptions, Packed, Plan, memory_stats, reset_peak, \
    segments_of, value_and_grad
from segback.engine import options as engine_options
from segback.engine.head import loss_mask
from segback.engine.host_table import park_tables, parked_bytes
from segback.models.dequant_linear import use_dequantized_matmul
from segback.models.random_init import GEOMETRIES, build_model
from segback.models.load import load
from segback.planner import plan_segments
from segback.planner.cli import SEARCHED
from segback.planner.cost import CostModel
from segback.planner.flops import default_matmul_dtype, matmul_peak, step_flops
from segback.planner.geometry import read_geometry


def _load(args):
    gpu = mx.default_device() == mx.gpu
    dtype = {"auto": mx.bfloat16 if gpu else mx.float32, "float32": mx.float32,
             "bfloat16": mx.bfloat16, "float16": mx.float16}[args.dtype]
    if args.model in GEOMETRIES:
        return build_model(args.model, dtype=dtype, quantize_bits=args.quant_bits), dtype
    model, _ = load(args.model, dequant_matmul=False)  # --dequant-matmul decides
    return model, dtype


def _plan(args, model, runtime):
    """The Plan this run uses: the planner's, a plan file's, or N layers per segment."""
    if args.segments.isdigit():
        searched = {k: getattr(args, k) for k in SEARCHED if k != "boundaries_on_device"}
        keep = args.boundaries_on_device
        engine = EngineOptions.from_dict(runtime.to_dict() | searched
                                         | {"boundaries_on_device": 0 if keep == "auto"
                                            else keep})
        return Plan(segments_of(int(args.segments), len(model.layers)), engine)
    if args.segments != "auto":
        return Plan.read(args.segments)
    return plan_segments(model, args.seq, args.batch, target_gb=args.target_gb,
                         attention=args.attention, lora_rank=args.lora_rank, tile=args.tile,
                         offload=args.offload,
                         light_tile=None if args.light_tile is None else int(args.light_tile),
                         boundaries_on_device=args.boundaries_on_device, options=runtime,
                         measure=args.measure)


def run_worker(args) -> dict:
    """One mode in this process; returns the result row."""
    mode = args.worker
    peak_flops = matmul_peak()  # before the model: nothing else holds memory yet
    model, dtype = _load(args)
    dequant = args.dequant_matmul == "true" or (args.dequant_matmul == "auto"
                                               and mode == "segmented")
    if dequant:
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
    if not pack:
        return (mx.random.randint(0, vocab, (B, L + 1)),
                mx.array([[int(prompt_frac * L), L]] * B))
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
    per_token = step_flops(geom, seq, batch, mode, plan, loss_tokens)["flops_per_token"]
    model_tflops = per_token * tokens_per_s / 1e12
    device_tflops = peak_flops / 1e12
    return {"flops_per_token": round(per_token),
            "model_tflops": _sig(model_tflops),
            "device_matmul_tflops": _sig(device_tflops),
            "matmul_dtype": str(default_matmul_dtype()).split(".")[-1],
            "hw_fraction": _sig(model_tflops / device_tflops) if device_tflops > 0 else None}




def _progress(line: str) -> None:
    print(f"bench {line}", file=sys.stderr, flush=True)
