"""The planner's choice by measurement: time candidate plans on the real model, keep the fastest
whose measured peak meets the target.

The cost model ranks plans well but its absolute peaks are device-dependent (plans on CUDA
measure above its analytic sizes; `cost.CUDA_ACTIVATION` corrects most of it, not all), so a
plan it says fits may not. `measure=N` in `plan_segments` runs one warm-up and one timed step of
the real engine for candidates in the cost model's order (fastest predicted first; each
configuration's cuts bisected for the fastest that fits), on random tokens, with LoRA attached as
training will; the measurements go into the plan.

Timing is bounded: all candidates together take at most `MEASURE_BUDGET` steps of the cost
model's pick (predicted relative step times before the first is timed, wall-clock seconds
after), so the defaults finish in a few steps' time whatever the model and length.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Hashable, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from segback.engine import value_and_grad
from segback.engine.options import AUTO
from segback.engine.plan_file import Plan
from segback.engine.stack import get_stack
from segback.planner.calibrate import attach_lora
from segback.planner.geometry import GB
from segback.planner.search import MARGIN, engine_label, within


# Candidates `measure="auto"` times: on a GPU with a memory target, where the cost model's
# absolute peaks are least reliable; none on a CPU, where they hold (tests/test_planner.py).
AUTO_MEASURE = 3

# Steps one measurement runs: a warm-up (kernels built, buffers allocated) and the timed one.
MEASURE_STEPS = 2
# Steps of the cost model's pick that timing all candidates may take together.
MEASURE_BUDGET = 3.0
# The cost model's largest under-prediction of a measured peak on CUDA (bench/RESULTS.md:
# -19.4%, untiled Llama-8B on MLX's kernel): a plan predicted this far under its target fits.
PREDICTION_DOUBT = 0.20


def why_not_timed(times: Sequence[float], peaks_gb: Sequence[float], target_gb: float | None,
                   budget: float) -> str | None:
    """None if timing the candidates (fastest predicted first: relative step times and
    predicted peaks) can change the pick; else why not: the first alone fits the budget and
    its predicted peak leaves the model's largest error to spare under the target, so timing
    it would only confirm it (a long sequence's step can take minutes)."""
    if len(times) > 1 and MEASURE_STEPS * (times[0] + times[1]) <= budget:
        return None
    if target_gb is None or peaks_gb[0] * (1 + PREDICTION_DOUBT) > target_gb * (1 - MARGIN):
        return None
    return (f"not timing candidates: only the first fits the timing budget, and its "
            f"predicted {peaks_gb[0]:.2f} GB leaves "
            f"{PREDICTION_DOUBT:.0%} (the cost model's largest recorded error) to spare under "
            f"the {target_gb:g} GB target")


class _Spent(Exception):
    """The next candidate would take the timing past its budget."""


def measure_count(measure: int | str, target_gb: float | None) -> int:
    """How many candidate plans to time: `measure` as given, or for "auto" AUTO_MEASURE on a
    GPU when there is a memory target to meet, else none."""
    if measure != AUTO:
        return int(measure)
    return AUTO_MEASURE if target_gb is not None and mx.default_device() == mx.gpu else 0


def parse_measure(value: str) -> int | str:
    """`--measure` / `--measure-plan` as a command line or config gives it: AUTO or a count
    >= 0."""
    if value.strip().lower() == AUTO:
        return AUTO
    if not value.strip().isdigit():
        raise ValueError(f"must be auto or a whole number >= 0, not {value!r}")
    return int(value)


def measure_plan(model: nn.Module, plan: Plan, seq_len: int, batch_size: int = 1,
                 lora_rank: int = 8) -> dict[str, float]:
    """{"peak_gb", "seconds"} of one engine step under `plan` (after a warm-up step)."""
    layers = get_stack(model).layers
    undo = attach_lora(layers, lora_rank)
    try:
        batch = mx.random.randint(0, model.args.vocab_size, (batch_size, seq_len + 1),
                                  key=mx.random.key(0))
        lengths = mx.array([[0, seq_len]] * batch_size)
        mx.eval(batch, model.parameters())
        seconds = []
        for _ in range(MEASURE_STEPS):
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


def measured_pick(model: nn.Module, candidates: Sequence[tuple[Hashable, Callable[[], Plan]]],
                  target_gb: float | None, seq_len: int, batch_size: int, lora_rank: int,
                  limit: int, times: Sequence[float] | None = None,
                  budget: float | None = None) -> tuple[Plan, list[dict]]:
    """(the chosen plan, one record per measured plan: its "index" in `candidates`, the plan,
    peaks, seconds and whether it "fits" the target, i.e. `within` it).

    `candidates` are (configuration, build) pairs in the cost model's order, fastest predicted
    first; the plans of one configuration (tile, offload, attention) differ only in their cuts,
    so along that order they get smaller and a little slower. Configurations are tried in the
    order of their fastest plan: its fastest plan is timed, and if it is over the target, its
    smallest; if that one fits, a bisection between the two finds the fastest that does (a
    handful of steps where walking the list would time dozens of near-equal plans). The search
    stops once `limit` plans are timed and one fits; fewer timed, the next untimed candidates
    in order make up the `limit`. With `times` (each candidate's predicted relative step time)
    and a `budget` in the same unit, a candidate is timed only while the timing so far (wall
    seconds, in that unit at the rate of the last timed step) and its MEASURE_STEPS predicted
    steps stay within the budget; the first must fit it by prediction. The fastest measured
    within the target wins, else the one with the smallest measured peak.
    """
    records: list[dict] = []
    measured: dict[int, dict] = {}
    clock = {"spent": 0.0, "rate": None}  # wall seconds timing; seconds per unit of `times`

    def affordable(i: int) -> bool:
        if budget is None or times is None:
            return True
        used = clock["spent"] / clock["rate"] if clock["rate"] else 0.0
        return used + MEASURE_STEPS * times[i] <= budget

    def fits(i: int) -> bool:
        if i not in measured:
            if not affordable(i):
                raise _Spent
            plan = candidates[i][1]()
            tic = time.perf_counter()
            r = measure_plan(model, plan, seq_len, batch_size, lora_rank)
            clock["spent"] += time.perf_counter() - tic
            if times is not None and times[i] > 0:
                clock["rate"] = r["seconds"] / times[i]
            measured[i] = rec = {
                "index": i, "plan": plan, "segments": len(plan.segments),
                "tile": plan.engine.tile, "offload": plan.engine.offload,
                "mlp_chunk": plan.engine.mlp_chunk,
                "boundaries_on_device": plan.engine.boundaries_on_device,
                "predicted_gb": round(plan.predicted_peak_gb, 3),
                "relative_time": round(plan.predicted_relative_step_time, 4),
                "peak_gb": round(r["peak_gb"], 3), "seconds": round(r["seconds"], 4),
                "fits": within(r["peak_gb"] * GB, target_gb)}
            records.append(rec)
            label = engine_label(plan.engine.tile, plan.engine.offload, plan.engine.mlp_chunk)
            print(f"segback plan: measured {label},"
                  f" {len(plan.segments)} segments: {r['peak_gb']:.2f} GB (predicted "
                  f"{plan.predicted_peak_gb:.2f}), {r['seconds']:.3f} s a step", flush=True)
        return measured[i]["fits"]

    groups: dict[Hashable, list[int]] = {}
    for i, (key, _) in enumerate(candidates):
        groups.setdefault(key, []).append(i)
    try:
        for idx in groups.values():
            if len(records) >= limit and any(r["fits"] for r in records):
                break
            if fits(idx[0]) or len(idx) == 1 or not fits(idx[-1]):
                continue
            lo, hi = 0, len(idx) - 1  # idx[lo] is over the target, idx[hi] within it
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if fits(idx[mid]) else (mid, hi)
        for i in range(len(candidates)):  # fewer than `limit` timed: the next ones in order
            if len(records) >= limit:
                break
            fits(i)
    except _Spent:
        print(f"segback plan: timed {len(records)} candidate plans in {clock['spent']:.1f} s;"
              " the next would take timing past its budget: stopping there", flush=True)
    if not records:
        raise ValueError("no candidate plans to measure (the first is over the budget)")
    fitting = [r for r in records if r["fits"]]
    best = min(fitting, key=lambda r: r["seconds"]) if fitting else \
        min(records, key=lambda r: r["peak_gb"])
    return best["plan"], records
