"""The planner's choice by measurement: time candidate plans on the real model, keep the fastest
whose measured peak meets the target.

The cost model ranks plans well but misjudges absolute peaks on some devices (it under-predicts
untiled plans on CUDA by a quarter or more), so a plan it says fits may not. `measure=N` in
`plan_segments` runs one warm-up and one timed step of the real engine for each candidate, in the
cost model's order (fastest predicted first), on random tokens, with LoRA attached as training
will; the measurements go into the plan.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from segback.engine.plan import Plan
from segback.planner.calibrate import _attach_lora
from segback.planner.geometry import GB


def measure_plan(model: nn.Module, plan: Plan, seq_len: int, batch_size: int = 1,
                 lora_rank: int = 8) -> dict[str, float]:
    """{"peak_gb", "seconds"} of one engine step under `plan` (after a warm-up step)."""
    from segback.engine import value_and_grad
    from segback.engine.stack import get_stack

    layers = get_stack(model).layers
    undo = _attach_lora(layers, lora_rank)
    try:
        batch = mx.random.randint(0, model.args.vocab_size, (batch_size, seq_len + 1),
                                  key=mx.random.key(0))
        lengths = mx.array([[0, seq_len]] * batch_size)
        mx.eval(batch, model.parameters())
        seconds = []
        for _ in range(2):
            gc.collect()
            mx.clear_cache()
            mx.reset_peak_memory()
            tic = time.perf_counter()
            (loss, _), grads = value_and_grad(model, batch, lengths, plan)
            mx.eval(loss, grads)
            seconds.append(time.perf_counter() - tic)
            del grads
        return {"peak_gb": mx.get_peak_memory() / GB, "seconds": seconds[-1]}
    finally:
        for layer, originals in undo:
            layer.update_modules(tree_unflatten(originals))


def measured_pick(model: nn.Module, plans: Iterable[Plan], target_gb: float | None,
                  seq_len: int, batch_size: int, lora_rank: int, limit: int
                  ) -> tuple[Plan, list[dict]]:
    """(the chosen plan, one record per measured plan: its "index" in `plans`, the plan, peaks,
    seconds and whether it "fits" the target).

    `plans` come in the cost model's order, fastest predicted first. Up to `limit` of them are
    timed, and more while none has met the target; the fastest measured plan within the target
    wins, else the one with the smallest measured peak.
    """
    from segback.planner.plan import engine_label

    records: list[dict] = []
    for i, plan in enumerate(plans):
        if len(records) >= limit and any(r["fits"] for r in records):
            break
        r = measure_plan(model, plan, seq_len, batch_size, lora_rank)
        records.append({"index": i, "plan": plan, "segments": len(plan.segments),
                        "tile": plan.engine.tile, "offload": plan.engine.offload,
                        "predicted_gb": round(plan.predicted_peak_gb, 3),
                        "peak_gb": round(r["peak_gb"], 3), "seconds": round(r["seconds"], 4),
                        "fits": target_gb is None or r["peak_gb"] <= target_gb})
        print(f"segback plan: measured {engine_label(plan.engine.tile, plan.engine.offload)}, "
              f"{len(plan.segments)} segments: {r['peak_gb']:.2f} GB (predicted "
              f"{plan.predicted_peak_gb:.2f}), {r['seconds']:.3f} s a step", flush=True)
    fits = [r for r in records if r["fits"]]
    best = min(fits, key=lambda r: r["seconds"]) if fits else \
        min(records, key=lambda r: r["peak_gb"])
    return best["plan"], records
