"""`plan_segments`: the planner's API, from a model (or config, geometry, checkpoint) and a
sequence length to a `segback.engine.Plan`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from segback.engine.options import AUTO, EngineOptions
from segback.engine.plan_file import Plan, segments_of
from segback.engine.ring_attention import shard_positions
from segback.models.dequant_linear import use_dequantized_matmul
from segback.models.family import check_family
from segback.models.load import load
from segback.models.random_init import build_model, geometry_config
from segback.planner.calibrate import CALIBRATION_LENGTHS, fit_coefficients
from segback.planner.context import RingCostModel
from segback.planner.cost import Coefficients, CostModel, device_coefficients
from segback.planner.geometry import DTYPES, FULL, GB, read_geometry, resolve_model
from segback.planner.measure import (MEASURE_BUDGET, MEASURE_STEPS, measure_count,
                                     measured_pick, why_not_timed)
from segback.planner.host import host_budget_gb
from segback.planner.search import (best_by_count, choose, engine_label, most_kept,
                                    parks_within, pick, tile_configs, within)
from segback.planner.space import SearchSpace


def plan_segments(
    model_or_config: nn.Module | dict | str,
    seq_len: int,
    batch_size: int = 1,
    target_gb: float | None = None,
    time_budget: float | None = None,
    calibrate: bool = False,
    lora_rank: int = 8,
    lora_layers: int | None = None,
    dtype: str | None = None,
    attention: str = "fused",
    quant_bits: int | None = None,
    calibration_lengths: Sequence[int] = CALIBRATION_LENGTHS,
    coefficients: Coefficients | dict | None = None,
    segments: Any = None,
    tile: int | str | None = None,
    offload: bool | str = False,
    light_tile: int | None = None,
    boundaries_on_device: int | str = AUTO,
    options: EngineOptions | None = None,
    space: SearchSpace | None = None,
    measure: int | str = 0,
    measure_budget: float = MEASURE_BUDGET,
    context_parallel: int = 1,
    context_order: str = "zigzag",
    host_gb: float | str | None = AUTO,
) -> Plan:
    """Plan the segments of a segmented backward and the engine options that run them.

    `model_or_config` is an mlx-lm model, a config dict, a geometry name
    (segback.models.random_init) or an MLX checkpoint directory; the last three are read lazily,
    nothing is materialized.
    `quant_bits` quantizes a config/geometry (a model or checkpoint carries its own bits);
    calibrating a config/geometry builds it with random weights.
    `coefficients` reuses an earlier calibration (a plan's `inputs.calibration`); `segments`
    (ranges or layers per segment, as the engine takes them) skips the search and only predicts.
    `tile` (tokens) plans the sequence-tiled engine, `offload` with host-parked boundaries;
    `tile="auto"` (and `offload="auto"`) also weigh untiled and every tile size of TILE_SIZES
    (with and without offload): with a target, the fastest that meets it, else the smallest
    peak. `light_tile` plans the tiled engine's light passes on their own tile (default: the
    tile); `boundaries_on_device` keeps the last N segments' boundaries on the device, "auto"
    (default) as many as the target leaves room for (none without one). `space` (a
    `SearchSpace`) gives these five at once, in place of `attention`, `tile`, `offload`,
    `light_tile` and `boundaries_on_device`. `options` carries the
    run-time engine options (compile, shared traces, tiles in flight, prefetch, head chunk) into
    the plan; the planner fills in what it chose. `measure` > 0 times that many candidate plans
    (those predicted to meet the target, fastest predicted first; more while none measured
    within it) on the real model, a warm-up and a timed step each, and returns the fastest
    measured within the target (`segback.planner.measure`); the records are in the plan's
    `inputs.measured`.
    `measure="auto"` times a few on a GPU when there is a target, none otherwise, and none
    when only the first fits the budget with the model's largest error to spare under the
    target (`measure.why_not_timed`). Timing stops
    at `measure_budget` of the cost model's pick's predicted steps (skipped, with a note, when
    one candidate's warm-up and timed step would not fit); a measured plan over the target is
    not chosen: if none fits, the fastest untimed one whose prediction, scaled by the measured
    overshoot, does. Targets are met with `search.MARGIN` to spare, predicted or measured.
    `context_parallel` R > 1 plans one rank of R that each run a shard of the sequence
    (`context_order`) with ring attention (`segback.planner.context`): the plan's peak is a
    rank's, and its `context` says what each rank sends; it is not timed (`measure`) nor
    calibrated, which would need the ring.
    `host_gb` bounds what an offloading plan parks in host memory (GB; "auto", the default:
    `host.HOST_FRACTION` of the memory available now; None: no bound): plans that would park
    more are not weighed or timed.
    """
    if seq_len < 2:
        raise ValueError("seq_len must be at least 2")
    if isinstance(model_or_config, dict) and not isinstance(model_or_config, nn.Module):
        check_family(model_or_config, "the config")  # before a model is built from it
    if context_parallel > 1:
        if calibrate or measure not in (0, AUTO):
            raise ValueError(f"--context-parallel {context_parallel} plans one rank of a ring: "
                             "it cannot be calibrated or timed in one process (drop "
                             "--calibrate and --measure)")
        measure = 0
        shard = shard_positions(seq_len, context_parallel, context_order).padded
    else:
        shard = seq_len
    auto_measure = measure == AUTO  # then the planner may also judge timing not worth it
    measure = measure_count(measure, target_gb)
    host_limit = host_budget_gb(host_gb)
    runtime = options or EngineOptions()
    if space is None:
        space = SearchSpace.from_dict(dict(
            attention=attention, tile=tile, offload=offload, light_tile=light_tile,
            boundaries_on_device=boundaries_on_device))
    configs = tile_configs(shard, space, runtime.mlp_chunk)
    if measure and not isinstance(model_or_config, (nn.Module, dict)) \
            and Path(model_or_config).is_dir():  # time it as training loads it
        model_or_config, _ = load(model_or_config, dtype=dtype)
        model_or_config.freeze()
    if (calibrate or measure) and _is_lazy_random(model_or_config):  # needs real weights
        if dtype is None:  # bfloat16 matmuls are slow on CPU
            dtype = "bfloat16" if mx.default_device() == mx.gpu else "float32"
        config = model_or_config if isinstance(model_or_config, dict) \
            else geometry_config(model_or_config)
        model_id = str(model_or_config if isinstance(model_or_config, str)
                       else config["model_type"])
        model_or_config = build_model(config, dtype=DTYPES[dtype], quantize_bits=quant_bits)
        if quant_bits:  # as `segback.models.load` runs a quantized checkpoint for training
            use_dequantized_matmul(model_or_config)
        model_or_config.freeze()  # calibration attaches LoRA to the layers it measures
    else:
        model_id = None
    model, default_id = resolve_model(model_or_config, dtype, quant_bits)
    model_id = model_id or default_id
    geom = read_geometry(model, lora_rank, lora_layers, dtype, model_id)
    coef = Coefficients(**coefficients) if isinstance(coefficients, dict) else \
        coefficients or Coefficients()
    if calibrate:
        kinds = {att for att, *_ in configs}  # measure the attention the plan will run
        coef = fit_coefficients(model, geom, batch_size, lora_rank,
                                kinds.pop() if len(kinds) == 1 else space.attention,
                                calibration_lengths)
    given = segments
    options = []  # (cost, segments, meets_target, meets_time, message) per configuration
    given_coef = coefficients is not None or coef.calibrated
    if not given_coef:
        coef = device_coefficients()
    for att, t, off, chunk in configs:  # boundaries on the device are chosen after the cut
        kw = dict(prefetch=runtime.prefetch and off, host_table=runtime.host_table,
                  mlp_chunk=chunk)
        cost = CostModel(geom, seq_len, batch_size, att, coef, t, off,
                         space.light_tile if t else None, **kw) if context_parallel == 1 else \
            RingCostModel(geom, seq_len, context_parallel, context_order, batch_size, att,
                          coef, t, off, space.light_tile if t else None, **kw)
        if given is None:
            options.append((cost, *choose(cost, target_gb, time_budget, host_limit,
                                          space.boundaries_on_device)))
            continue
        segs = segments_of(given, geom.num_layers)
        peak = cost.evaluate(segs)["peak"]
        options.append((cost, segs, within(peak, target_gb),
                        time_budget is None or cost.relative_step_time(segs) <= time_budget,
                        f"given plan of {len(segs)} segments: {peak / GB:.2f} GB"))
    def finish(cost, segments, meets_target, meets_time, message):
        return _plan(cost, segments, meets_target, meets_time, message, len(options), geom,
                     target_gb, space.boundaries_on_device, runtime, inputs)

    inputs = dict(model=model_id, model_type=geom.model_type, num_layers=geom.num_layers,
                  seq_len=seq_len, batch_size=batch_size, target_gb=target_gb,
                  time_budget=time_budget, dtype=geom.dtype, attention=space.attention,
                  tile=space.tile, offload=space.offload, light_tile=space.light_tile,
                  boundaries_on_device=space.boundaries_on_device, lora_rank=lora_rank,
                  lora_layers=lora_layers,
                  quant_bits=quant_bits if quant_bits is not None else
                  (geom.quant_bits[0] if len(geom.quant_bits) == 1 else geom.quant_bits or None),
                  calibration=asdict(coef) if coef.calibrated else None)
    if context_parallel > 1:
        inputs |= dict(context_parallel=context_parallel, context_order=context_order)
    best = pick(options, target_gb)
    if not measure or given is not None:
        return finish(*best)
    candidates = []
    for cost, *_ in options:
        for segs in best_by_count(cost).values():
            peak = cost.evaluate(segs)["peak"]
            if within(peak, target_gb) and parks_within(cost, segs, target_gb,
                                                        space.boundaries_on_device, host_limit):
                candidates.append((cost.relative_step_time(segs), peak, cost, segs))
    if not candidates:  # nothing is predicted to fit: measure the planner's own choice
        return finish(*best)
    candidates.sort(key=lambda c: (c[0], c[1]))
    budget = measure_budget * best[0].relative_step_time(best[1])
    if MEASURE_STEPS * candidates[0][0] > budget:
        note = (f"not timing candidates: one takes {MEASURE_STEPS} steps, more than the "
                f"budget of {measure_budget:g} of the pick's predicted steps")
    else:
        note = why_not_timed([c[0] for c in candidates], [c[1] / GB for c in candidates],
                             target_gb, budget) if auto_measure else None
    if note:
        print(f"segback plan: {note}", flush=True)
        cost, segs, ok, in_time, message = best
        return finish(cost, segs, ok, in_time, f"{message} ({note})")

    def build(cost, segs, target=target_gb):  # plans are built only as they are measured
        label = engine_label(cost.tile, cost.offload, cost.mlp_chunk)
        return lambda: _plan(cost, segs, True, True, f"{label}, {len(segs)} segments", 1, geom,
                             target, space.boundaries_on_device, runtime, inputs)

    plan, records = measured_pick(model, [(id(cost), build(cost, segs))
                                          for _, _, cost, segs in candidates],
                                  target_gb, seq_len, batch_size, lora_rank, measure,
                                  times=[c[0] for c in candidates], budget=budget)
    rec = next(r for r in records if r["plan"] is plan)
    message = (f"measured {len(records)} of {len(candidates)} candidate plans: {plan.message}, "
               f"{rec['peak_gb']:.2f} GB measured, {rec['seconds']:.3f} s a step")
    measured = {"measured": [{k: v for k, v in r.items() if k != "plan"} for r in records]}
    if not rec["fits"]:  # none measured within the target: none of them is chosen
        plan, message = corrected_pick(candidates, records, target_gb, build, message)
    return replace(plan, meets_target=rec["fits"] or plan is not rec["plan"], message=message,
                   inputs=plan.inputs | measured)


def corrected_pick(candidates: list[tuple], records: list[dict], target_gb: float,
                   build: Any, message: str) -> tuple[Plan, str]:
    """Every measured plan missed the target: the fastest candidate not measured whose
    predicted peak, scaled by the worst measured/predicted ratio, meets it; else the smallest
    measured peak, said to miss. (Measuring the unmeasured is past the budget.)"""
    ratio = max(r["peak_gb"] / r["predicted_gb"] for r in records)
    timed = {r["index"] for r in records}
    for i, (_, peak, cost, segs) in enumerate(candidates):
        if i not in timed and within(peak * ratio, target_gb):
            plan = build(cost, segs, target_gb / ratio)()
            return plan, (f"{message}; none within {target_gb:g} GB: {plan.message}, predicted "
                          f"{plan.predicted_peak_gb:.2f} GB x {ratio:.3f} (the measured "
                          f"overshoot) = {plan.predicted_peak_gb * ratio:.2f} GB, not timed")
    low = min(records, key=lambda r: r["peak_gb"])
    return low["plan"], (f"{message}; none within {target_gb:g} GB, measured or predicted "
                         f"x {ratio:.3f} (the measured overshoot): the smallest measured peak, "
                         f"{low['peak_gb']:.2f} GB")


def _plan(cost, segments, meets_target, meets_time, message, n_options, geom, target_gb,
          boundaries_on_device, runtime, inputs) -> Plan:
    """The Plan of one (configuration, cut): kept boundaries, engine options, predictions."""
    if cost.offload and boundaries_on_device == AUTO:
        if target_gb is not None and meets_target:
            cost.boundaries_on_device = most_kept(cost, segments, target_gb)
    elif cost.offload:
        cost.boundaries_on_device = boundaries_on_device
        meets_target = within(cost.evaluate(segments)["peak"], target_gb)
    if cost.offload and cost.boundaries_on_device:
        message += f"; the last {cost.kept(len(segments))} boundaries stay on the device"
    if n_options > 1:
        message = (f"{engine_label(cost.tile, cost.offload, cost.mlp_chunk)} (best of {n_options} "
                   f"configurations): {message}")
    ev = cost.evaluate(segments)
    sharers = geom.sharers()
    saved_kv = [dict(donor=d, kind=geom.layers[d].kind, read_by_segments=ks,
                     sharer_layers=sharers[d], gb=cost.kv_bytes[d] / GB)
                for d, ks in sorted(ev["saved"].items())]
    engine = replace(
        runtime, attention=cost.attention, tile=cost.tile, offload=cost.offload,
        light_tile=cost.light if cost.tile and cost.light != cost.tile else None,
        mlp_chunk=cost.mlp_chunk,
        boundaries_on_device=cost.kept(len(segments)) if cost.offload else 0)
    return Plan(
        segments=[(a, b) for a, b in segments],
        engine=engine,
        saved_kv=saved_kv,
        predicted_peak_gb=ev["peak"] / GB,
        breakdown={k: v / GB for k, v in ev["breakdown"].items()},
        peak_at=ev["peak_at"],
        segment_gb=[x / GB for x in ev["segment_bytes"]],
        predicted_relative_step_time=cost.relative_step_time(segments),
        predicted_host_gb=cost.host_bytes(len(segments)) / GB,
        meets_target=bool(meets_target),
        meets_time_budget=bool(meets_time),
        message=message,
        layer_types=[g.kind for g in geom.layers],
        inputs=dict(inputs),
        context=cost.summary(segments) if isinstance(cost, RingCostModel) else {},
    )


def _is_lazy_random(model_or_config: Any) -> bool:
    """A config dict or geometry name (an nn.Module is a dict too, hence the first check)."""
    if isinstance(model_or_config, nn.Module):
        return False
    return isinstance(model_or_config, dict) or not Path(model_or_config).is_dir()


def describe(plan: Plan) -> str:
    """One line per segment, for humans."""
    lines = [plan.message]
    for (a, b), gb in zip(plan.segments, plan.segment_gb):
        kinds = "".join("F" if plan.layer_types[i] == FULL else "s" for i in range(a, b))
        lines.append(f"  [{a:>2}, {b:>2}) {kinds:<8} {gb:7.2f} GB")
    return "\n".join(lines)
