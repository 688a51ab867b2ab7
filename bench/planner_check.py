"""The cost model's peaks against measured ones, from the rows of `bench/data/runs.jsonl`.

Every segmented row of the runs named, and every candidate the planner timed for it (the row's
`measured` records), is predicted again with today's cost model at a given activation factor,
with the cut the planner makes for that segment count and the boundaries on the device that the
plan ran with (as recorded; timed candidates before run h100-run19 did not record them: as the
planner chose them, with the tiled sizes of its day). Prints one line per plan and the error
range per engine kind:

    python bench/planner_check.py --runs h100-run17 h100-run18 --activation 1.0 1.6
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from segback.planner.cost import Coefficients, CostModel
from segback.planner.geometry import GB, read_geometry, resolve_model
from segback.planner.search import best_by_count, most_kept

RUNS = Path(__file__).resolve().parent / "data" / "runs.jsonl"
# Runs whose planner counted the tiled engine's activations at 1.0 (the analytic sizes).
ANALYTIC_TILED = ("h100-run17", "h100-run18")


def measured_rows(runs: list[str], data: Path = RUNS, model: str = "e4b") -> list[dict]:
    """The segmented rows of `model` in these runs that measured a peak."""
    return [r for r in map(json.loads, data.read_text().splitlines())
            if r.get("run") in runs and r.get("mode") == "segmented"
            and r.get("model") == model and "peak_gb" in r]


def plans(rows: list[dict]) -> list[dict]:
    """One dict per distinct measured plan: seq, batch, target, attention, host_table, tile,
    offload, mlp_chunk, segments, kept (None: as the planner chose), peak_gb."""
    out, seen = [], set()
    for r in rows:
        base = dict(seq=r["seq"], batch=r.get("batch", 1), target=r.get("target_gb"),
                    attention=r.get("attention") or "fused", host_table=r.get("host_table"),
                    run=r.get("run"),
                    # rows before the fast kernels ran mlx-lm's composed attention (fused) and
                    # the chunked kernel (tiled)
                    fast_kernels=bool(r.get("fast_kernels", False)))
        found = [dict(tile=m["tile"], offload=bool(m["offload"]), mlp_chunk=m.get("mlp_chunk"),
                      segments=m["segments"], kept=m.get("boundaries_on_device"),
                      peak_gb=m["peak_gb"])
                 for m in r.get("measured") or []]  # in the order they ran
        found += [dict(tile=r.get("tile"), offload=bool(r.get("offload")),
                       mlp_chunk=r.get("mlp_chunk"), segments=len(r["segments"]),
                       kept=r.get("boundaries_on_device"), peak_gb=r["peak_gb"])]
        parked = False  # rows before the option: the first offloaded plan parks it for good
        for f in found:
            p = base | f
            if p["tile"] and not p["fast_kernels"]:
                p["attention"] = "chunked"
            if p["host_table"] is None:
                parked = parked or p["offload"]
                p["host_table"] = parked
            key = tuple(sorted((k, str(v)) for k, v in p.items()))
            if key not in seen:
                seen.add(key)
                out.append(p)
    return out


def predict(geom, p: dict, activation: float) -> float:
    """GB the cost model predicts for plan `p` at this activation factor."""
    def model(coef, kept=0):
        return CostModel(geom, p["seq"], p["batch"], p["attention"], coef, p["tile"],
                         p["offload"], None, boundaries_on_device=kept,
                         host_table=p["host_table"],
                         mlp_chunk=p["mlp_chunk"], fast_kernels=p["fast_kernels"])

    then = model(Coefficients() if p["run"] in ANALYTIC_TILED else
                 Coefficients(activation=activation))
    cut = best_by_count(then)[p["segments"]]
    kept = p["kept"]
    if p["offload"] and kept is None:  # as the planner of the run chose it
        kept = most_kept(then, cut, p["target"]) if p["target"] else 0
    return model(Coefficients(activation=activation), kept or 0).evaluate(cut)["peak"] / GB


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", nargs="+", default=["h100-run18"])
    ap.add_argument("--activation", nargs="+", type=float, default=[1.6])
    ap.add_argument("--data", type=Path, default=RUNS)
    ap.add_argument("--model", default="e4b", help="geometry name of the rows")
    args = ap.parse_args(argv)
    rows = measured_rows(args.runs, args.data, args.model)
    if not rows:
        raise SystemExit(f"planner_check: no segmented {args.model} rows of {args.runs} in "
                         f"{args.data}")
    model, model_id = resolve_model(args.model, "bfloat16", 4)
    geom = read_geometry(model, 8, None, "bfloat16", model_id)
    found = plans(rows)
    for a in args.activation:
        by_kind: dict[str, list[float]] = {}
        print(f"activation {a}:")
        for p in found:
            pred = predict(geom, p, a)
            err = 100 * (pred - p["peak_gb"]) / p["peak_gb"]
            kind = "tiled" if p["tile"] else "untiled, MLP chunks" if p["mlp_chunk"] else "untiled"
            by_kind.setdefault(kind, []).append(err)
            print(f"  {p['seq']:>6} b{p['batch']} {kind:<19} tile {p['tile'] or '-':>4} "
                  f"{'offload' if p['offload'] else '       '} {p['segments']:>2} segments: "
                  f"{pred:6.2f} predicted, {p['peak_gb']:6.2f} GB measured ({err:+.1f}%)")
        for kind, errs in by_kind.items():
            print(f"  {kind}: {len(errs)} plans, {min(errs):+.1f}% … {max(errs):+.1f}%, "
                  f"mean {sum(errs) / len(errs):+.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
