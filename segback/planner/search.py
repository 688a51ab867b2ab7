"""The search over cuts: an O(N^3) min-max DP for every segment count, with a branch per
choice of which Gemma-4 donors stay uncut from their sharers; then the pick among engine
configurations (untiled, tile sizes, offload) and the boundaries kept on the device."""

from __future__ import annotations

import itertools

import numpy as np

from segback.engine.options import AUTO
from segback.planner.cost import CostModel
from segback.planner.geometry import GB
from segback.planner.space import SearchSpace


# Ties within this fraction of the minimum peak go to fewer segments (faster, better fusion).
TIE_FRACTION = 0.005
# The stated margin: a plan meets a target only if its peak, predicted or measured, is this
# far under it (a training step's peak differs from a planned or timed one by the optimizer
# update and the batch's contents: +1% seen on CUDA).
MARGIN = 0.02
# Tile sizes (tokens) `--tile auto` weighs, largest (fastest) first.
TILE_SIZES = (4096, 2048, 1024, 512, 256)
# MLP chunks (tokens) `--tile auto` weighs for untiled plans (EngineOptions.mlp_chunk).
MLP_CHUNKS = (1024,)


def within(peak_bytes: float, target_gb: float | None) -> bool:
    """Whether a peak meets the target with the stated MARGIN (no target: always)."""
    return target_gb is None or peak_bytes <= target_gb * GB * (1 - MARGIN)


def best_by_count(cost: CostModel) -> dict[int, list[tuple[int, int]]]:
    """For every segment count, the contiguous cut minimising the peak (min-max DP).

    The worst backward event of a plan is max_k(k * stored boundary + fixed + pending dK/dV +
    S[a_k, b_k]); dp[j][i] is its minimum over plans of layers [0, i) in j segments. Donors
    whose sharers may stay in their segment (no saved K/V) are a separate branch that forbids
    cuts between them, so the DP's count is exact in the branch matching a plan's real saved
    set. The tiled engine keeps every donor's K/V, so it has only the all-saved branch.
    """
    n = cost.g.num_layers
    S = cost.segment_matrix()
    bb, fixed = cost.boundary_bytes, cost.fixed_bytes
    spans = {d: (d, max(r)) for d, r in cost.g.sharers().items()}
    donors = sorted(spans)
    branches = (itertools.product([False, True], repeat=len(donors))
                if len(donors) <= 4 and not cost.tile else [tuple([True] * len(donors))])
    best: dict[int, tuple[float, list[tuple[int, int]]]] = {}
    for saved_flags in branches:
        allowed = np.ones(n + 1, bool)
        pending = np.zeros(n + 1)  # pending[i]: dK/dV alive while a segment ending at i runs
        for d, saved in zip(donors, saved_flags):
            lo, hi = spans[d]
            if saved:
                pending[d + 1:] += cost.kv_bytes[d]
            else:
                allowed[lo + 1: hi + 1] = False
        allowed[n] = True
        dp = np.full((n + 1, n + 1), np.inf)  # dp[j, i]
        arg = np.zeros((n + 1, n + 1), int)
        dp[1, 1:] = fixed + pending[1:] + S[0, 1:]
        for j in range(2, n + 1):
            event = (j - 1) * bb + fixed + pending[None, :] + S  # [p, i]
            cand = np.maximum(dp[j - 1][:, None], event)
            cand[~allowed, :] = np.inf
            arg[j] = np.argmin(cand, axis=0)
            dp[j] = cand[arg[j], np.arange(n + 1)]
        for j in range(1, n + 1):
            if not np.isfinite(dp[j, n]):
                continue
            cuts, i = [], n
            for jj in range(j, 0, -1):
                p = 0 if jj == 1 else int(arg[jj, i])
                cuts.append((p, i))
                i = p
            plan = cuts[::-1]
            peak = cost.evaluate(plan)["peak"]
            if j not in best or peak < best[j][0]:
                best[j] = (peak, plan)
    return {j: plan for j, (_, plan) in best.items()}


def plan_host_bytes(cost: CostModel, segments: list[tuple[int, int]], target_gb: float | None,
                    boundaries_on_device: int | str = AUTO) -> float:
    """Host bytes of a plan with the boundaries it keeps on the device (AUTO: as many as the
    target leaves room for, as `plan._plan` keeps them); `cost` is left as it was."""
    if not cost.offload:
        return cost.host_bytes(len(segments))
    saved = cost.boundaries_on_device
    if boundaries_on_device != AUTO:
        cost.boundaries_on_device = int(boundaries_on_device)
    elif target_gb is not None and within(cost.evaluate(segments)["peak"], target_gb):
        most_kept(cost, segments, target_gb)
    else:
        cost.boundaries_on_device = 0
    host = cost.host_bytes(len(segments))
    cost.boundaries_on_device = saved
    return host


def parks_within(cost: CostModel, segments: list[tuple[int, int]], target_gb: float | None,
                 boundaries_on_device: int | str, host_gb: float | None) -> bool:
    """Whether the plan's parked boundaries fit `host_gb` (None: no bound). Parking all of them
    is checked first: when that fits, the boundaries kept on the device need not be found."""
    if host_gb is None or not cost.offload:
        return True
    return (plan_host_bytes(cost, segments, target_gb, 0) <= host_gb * GB
            or plan_host_bytes(cost, segments, target_gb, boundaries_on_device) <= host_gb * GB)


def choose(
    cost: CostModel, target_gb: float | None, time_budget: float | None,
    host_gb: float | None = None, boundaries_on_device: int | str = AUTO,
) -> tuple[list[tuple[int, int]], bool, bool, str]:
    """(segments, meets_target, meets_time_budget, message) under the strategy of the brief:
    the fastest plan whose peak meets the target, else the minimum-peak plan (ties go to the
    faster). Untiled, fewer segments are faster; tiled, more are (a segment of k layers
    recomputes k - 1 layer inputs in its backward). With `host_gb`, only plans whose parked
    boundaries fit it are weighed (fewer segments park fewer); if none does, the one parking
    least, said not to meet its target."""
    plans = best_by_count(cost)
    among = ""
    if host_gb is not None and cost.offload:
        fits = {j: p for j, p in plans.items()
                if parks_within(cost, p, target_gb, boundaries_on_device, host_gb)}
        if not fits:
            host = {j: plan_host_bytes(cost, p, target_gb, boundaries_on_device)
                    for j, p in plans.items()}
            j = min(host, key=lambda j: (host[j], j))
            return plans[j], False, True, (
                f"no plan of this configuration fits {host_gb:.1f} GB of host memory: the "
                f"least, {j} segments, parks {host[j] / GB:.1f} GB")
        if len(fits) < len(plans):
            among = f" (among the plans parking at most {host_gb:.1f} GB in host memory)"
        plans = fits
    peaks = {j: cost.evaluate(p)["peak"] for j, p in plans.items()}
    times = {j: cost.relative_step_time(p) for j, p in plans.items()}
    in_time = [j for j in plans if time_budget is None or times[j] <= time_budget]
    meets_time = bool(in_time)
    def fastest(js):
        return min(js, key=lambda j: (times[j], j))

    if not in_time:
        j = fastest(plans)
        return plans[j], within(peaks[j], target_gb), False, (
            f"time budget {time_budget} is below the fastest plan's relative step time "
            f"{times[j]:.3f} (the recompute forward alone costs that): returning that plan "
            f"({j} segments)")
    floor = min(peaks[j] for j in in_time)
    near_floor = [j for j in in_time if peaks[j] <= floor * (1 + TIE_FRACTION)]
    j_min = fastest(near_floor)
    if target_gb is None:
        return plans[j_min], True, meets_time, (
            f"minimum-peak plan: {j_min} segments, {peaks[j_min] / GB:.2f} GB{among}")
    ok = [j for j in in_time if within(peaks[j], target_gb)]
    if ok:
        j = fastest(ok)
        return plans[j], True, meets_time, (
            f"{j} segments meet the {target_gb:g} GB target at {peaks[j] / GB:.2f} GB{among}")
    what = " within the time budget" if time_budget is not None else ""
    return plans[j_min], False, meets_time, (
        f"target {target_gb:g} GB cannot be met{what}: the smallest achievable peak is "
        f"{peaks[j_min] / GB:.2f} GB ({j_min} segments){among}; returning that plan")


def most_kept(cost: CostModel, segments: list[tuple[int, int]], target_gb: float) -> int:
    """The most boundaries (of the last segments) that can stay on the device within the
    target: the peak only grows with each one kept."""
    best = 0
    for keep in range(1, len(segments) + 1):
        cost.boundaries_on_device = keep
        if not within(cost.evaluate(segments)["peak"], target_gb):
            break
        best = keep
    cost.boundaries_on_device = best
    return best


def tile_configs(seq_len: int, space: SearchSpace, mlp_chunk: int | None = None
                 ) -> list[tuple[str, int | None, bool, int | None]]:
    """(attention, tile, offload, mlp_chunk) configurations the planner weighs in `space`
    (`mlp_chunk` as the engine options give it)."""
    attention, tile, offload = space.attention, space.tile, space.offload
    if mlp_chunk and tile not in (None, AUTO):
        raise ValueError("mlp_chunk is for untiled plans: drop it, or --tile")
    offloads = [False, True] if offload == AUTO else [bool(offload)]
    if tile != AUTO:
        if tile is None:
            return [(attention, None, False, mlp_chunk)]
        return [(attention, tile, off, None) for off in offloads]
    sizes = [t for t in TILE_SIZES if t < seq_len] or [seq_len]
    chunks = [mlp_chunk] if mlp_chunk else [None] + [c for c in MLP_CHUNKS if c < seq_len]
    untiled = [] if offload is True else [(attention, None, False, c) for c in chunks]
    return untiled + [(attention, t, off, None) for off in offloads for t in sizes]


def engine_label(tile: int | None, offload: bool, mlp_chunk: int | None = None) -> str:
    """"untiled", "untiled, MLP chunks of 1024", "tile 2048" or "tile 2048, offload": how a
    plan runs its layers."""
    if tile:
        return f"tile {tile}" + (", offload" if offload else "")
    return "untiled" + (f", MLP chunks of {mlp_chunk}" if mlp_chunk else "")


def pick(options: list[tuple], target_gb: float | None) -> tuple:
    """Among (cost, segments, meets_target, meets_time, message): with a target, the fastest
    option meeting it (and the time budget); else, or if none does, the smallest peak (ties
    within TIE_FRACTION go to the faster)."""
    def peak(o):
        return o[0].evaluate(o[1])["peak"]

    def time(o):
        return o[0].relative_step_time(o[1])

    if len(options) == 1:
        return options[0]
    ok = [o for o in options if o[2] and o[3]]
    if target_gb is not None and ok:
        return min(ok, key=time)
    in_time = [o for o in options if o[3]] or options
    floor = min(peak(o) for o in in_time)
    return min((o for o in in_time if peak(o) <= floor * (1 + TIE_FRACTION)), key=time)
