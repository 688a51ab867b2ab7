"""On paper: one long sequence over R GPUs with `segback train --context-parallel R`, from the
planner's cost model (`segback.planner.context.RingCostModel`) and measured rates.

For each assumed rate of the ring's per-block attention, the planner picks the fastest plan
of each rank that fits `--target-gb` (untiled or tiled, with or without offload), and this
prints one JSON line: the rank's predicted peak, the bytes it sends per step, and the step's
time split into the linears and the tiles' fixed costs (at `--linear-tflops`), attention (its
FLOPs, each forward as often as the plan runs it, over the assumed rate) and the exchanges
(bytes over `--link-gbs`), with and without the exchanges hidden behind attention (each
block's transfer runs while the previous block is attended).

Defaults: Llama-3.1-8B (4-bit weights run as bf16 matmuls, LoRA rank 8 on every linear, bf16),
1M tokens on 8 H100s (80 GB, 72 GB target), the linears at 282 TFLOP/s (run h100-run22,
fast-defaults: 8K tokens, 0.407 of the 694 TFLOP/s bf16 matmul rate), and NVLink at 360 GB/s
each way between neighbours (H100 SXM: 450 GB/s each way, 80% of it).

    python bench/context_parallel_paper.py
    python bench/context_parallel_paper.py --seq 262144 --ranks 4
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from segback.planner.context import RingCostModel  # noqa: E402
from segback.planner.cost import CUDA_ACTIVATION, Coefficients  # noqa: E402
from segback.planner.geometry import GB, read_geometry, resolve_model  # noqa: E402
from segback.planner.search import TILE_SIZES, choose, within  # noqa: E402

MATMUL_TFLOPS = 694.0  # H100 bf16 dense matmul, measured (bench/RESULTS.md)
# Per-block attention rates, as fractions of MATMUL_TFLOPS (attention_bench, run h100-run22,
# head dim 128, 32K causal): MLX's fused kernel, segback's flash kernel, and the composed
# matmuls (MLX's unfused path) that ring attention's blocks run today.
RATES = {"mlx-fused": 0.453, "flash": 0.188, "composed": 0.038}


def estimate(args: argparse.Namespace, rate_name: str) -> dict:
    model, model_id = resolve_model(args.model, "bfloat16", args.quant_bits)
    geom = read_geometry(model, args.lora_rank, None, "bfloat16", args.model)
    attention_tflops = RATES[rate_name] * MATMUL_TFLOPS
    coef = Coefficients(activation=CUDA_ACTIVATION)  # the planner's CUDA default
    best = None
    for tile, offload in [(None, False)] + [(t, o) for t in TILE_SIZES for o in (False, True)]:
        cost = RingCostModel(geom, args.seq, args.ranks, args.order, 1, "fused", coef, tile,
                             offload, fast_kernels=True,
                             attention_time=args.linear_tflops / attention_tflops)
        segments, fits, _, _ = choose(cost, args.target_gb, None)
        if not fits:
            continue
        flops = cost.step_flops(segments)
        if best is None or flops < best[0]:
            best = (flops, cost, segments)
    if best is None:
        return {"rate": rate_name, "fits": False}
    flops, cost, segments = best
    # the linears (and the tiles' fixed costs) alone: the same plan with attention free
    linears = RingCostModel(geom, args.seq, args.ranks, args.order, 1, "fused", coef,
                            cost.tile, cost.offload, fast_kernels=True, attention_time=0.0)
    linear_s = linears.step_flops(segments) / (args.linear_tflops * 1e12)
    attn = sum(f * a + b for g, f in zip(cost.g.layers, cost.forwards(segments))
               for a, b in [cost._attention_flops(g, "ring")])
    attention_s = attn / (args.linear_tflops * 1e12)
    sent = cost.sent_bytes(segments)
    comm_s = sent / (args.link_gbs * 1e9)
    ev = cost.evaluate(segments)
    hidden = linear_s + max(attention_s, comm_s)
    return {"bench": "context_parallel_paper", "model": args.model, "seq": args.seq,
            "ranks": args.ranks, "order": args.order, "shard_tokens": cost.shards.padded,
            "rate": rate_name, "attention_tflops": round(attention_tflops, 1),
            "linear_tflops": args.linear_tflops, "link_gbs": args.link_gbs,
            "target_gb": args.target_gb, "tile": cost.tile, "offload": cost.offload,
            "segments": len(segments), "peak_gb": round(ev["peak"] / GB, 2),
            "peak_at": ev["peak_at"], "ring_buffer_gb": round(cost.ring_buffer_bytes() / GB, 2),
            "sent_gb_per_step": round(sent / GB, 1), "messages_per_step":
            cost.messages(segments), "balance": round(max(cost.balance(g)
                                                           for g in cost.g.layers), 4),
            "linear_s": round(linear_s, 1), "attention_s": round(attention_s, 1),
            "exchange_s": round(comm_s, 1), "step_s_overlapped": round(hidden, 1),
            "step_s_serial": round(linear_s + attention_s + comm_s, 1),
            "tokens_per_s": round(args.seq / hidden, 1), "fits": within(ev["peak"],
                                                                        args.target_gb)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--seq", type=int, default=1 << 20)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--order", default="zigzag")
    p.add_argument("--quant-bits", type=int, default=4)
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--target-gb", type=float, default=72.0)
    p.add_argument("--linear-tflops", type=float, default=282.0)
    p.add_argument("--link-gbs", type=float, default=360.0)
    p.add_argument("--rates", nargs="+", default=list(RATES), choices=list(RATES))
    args = p.parse_args()
    for rate in args.rates:
        print(json.dumps(estimate(args, rate)), flush=True)


if __name__ == "__main__":
    main()
