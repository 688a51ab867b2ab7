"""The parts every result JSON shares, read from the workflow's outputs and checked.

A score summary's metrics (`segback score`), the training figures (`segback train`'s
train_summary.json), the segment plan (`segback plan`), stage wall times (Snakemake benchmark
files) and each stage's config hash (`segback stamp`); `validate_result` checks the assembled
result against its JSON Schema.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jsonschema

from segback.io import read_json

SCHEMA_VERSION = 1

# Scalar metrics of `segback score`, in table order. `n` is copied but has no delta.
METRICS = (
    "n", "mean_score", "valid_json_rate", "schema_rate", "anchor_rate", "label_rate",
    "nonempty_rate", "boundary_precision", "boundary_recall", "boundary_f1", "pk", "windowdiff",
    "rouge_l", "mean_generated_tokens",
)
LOWER_IS_BETTER = {"pk", "windowdiff"}
TRAINING_FIELDS = (
    "steps", "seq", "batch_size", "segments", "peak_gb", "seconds", "tokens", "first_loss",
    "final_loss", "val_loss", "tokens_per_second",
)


class ResultError(ValueError):
    """An input is missing a field, or the assembled result does not match the schema."""


def _is_scalar(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))


def number(v: Any) -> Any:
    """JSON has no NaN/inf: map them to null."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def required_fields(obj: Any, keys: Sequence[str], source: str, what: str) -> dict:
    """`keys` of a JSON object, each a JSON number or null; a clear error if any is missing."""
    if not isinstance(obj, dict):
        raise ResultError(f"{source}: expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in keys if k not in obj]
    if missing:
        raise ResultError(f"{source}: missing {what} field(s) {', '.join(missing)}")
    return {k: number(obj[k]) for k in keys}


def metrics_of(score: dict, source: str) -> dict:
    """The scalar metrics of a score summary (per-case rows dropped)."""
    out = required_fields(score, METRICS, source, "score")
    for k, v in score.items():  # any further scalar metric the scorer reports
        if k not in out and isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = number(v)
    return out


def delta_of(baseline: dict, finetuned: dict) -> dict:
    """finetuned - baseline for every shared metric except counts (`n`, `n_*`); null where either
    is null."""
    out = {}
    for k in finetuned:
        if k == "n" or k.startswith("n_") or k not in baseline:
            continue
        b, f = baseline[k], finetuned[k]
        ok = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (b, f))
        out[k] = round(f - b, 6) if ok else None
    return out


def normalize_segments(segments: Any, source: str) -> list[list[int]]:
    """Segments as [[start, stop], ...] from pairs or {"start", "stop"} objects."""
    if not isinstance(segments, list):
        raise ResultError(f"{source}: `segments` must be a list, got {type(segments).__name__}")
    out = []
    for s in segments:
        if isinstance(s, dict):
            s = [s.get("start"), s.get("stop")]
        if not (isinstance(s, (list, tuple)) and len(s) == 2):
            raise ResultError(f"{source}: bad segment {s!r}; expected [start, stop]")
        out.append([int(s[0]), int(s[1])])
    return out


def training_of(summary: dict, plan: dict, source: str) -> dict:
    missing = [k for k in ("steps", "seq", "peak_gb", "seconds") if k not in summary]
    if missing:
        raise ResultError(f"{source}: missing training field(s) {', '.join(missing)}")
    out = {k: number(summary[k]) for k in TRAINING_FIELDS if k in summary and k != "segments"}
    segments = summary.get("segments", plan.get("segments"))
    out["segments"] = normalize_segments(segments, source)
    for k, v in summary.items():  # further scalar figures, e.g. resumed_from
        if k not in out and k not in TRAINING_FIELDS and _is_scalar(v):
            out[k] = number(v)
    return out


def plan_of(plan: dict, source: str) -> dict:
    if "segments" not in plan:
        raise ResultError(f"{source}: missing plan field `segments`")
    out = {k: number(v) for k, v in plan.items() if _is_scalar(v)}
    engine = plan.get("engine") if isinstance(plan.get("engine"), dict) else {}
    out.update({k: number(v) for k, v in engine.items() if _is_scalar(v)})  # how it ran
    out["segments"] = normalize_segments(plan["segments"], source)
    out.setdefault("predicted_peak_gb", None)
    return out


def read_benchmark(path: str | Path) -> dict | None:
    """Mean wall seconds and max RSS (MB) of a Snakemake benchmark TSV; None if unreadable."""
    try:
        with open(path, newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f, delimiter="\t"))
    except OSError:
        return None

    def col(name: str) -> list[float]:
        vals = []
        for r in rows:
            try:
                vals.append(float(r.get(name, "")))
            except (TypeError, ValueError):
                pass
        return vals

    seconds = col("s")
    if not seconds:
        return None
    rss = col("max_rss")
    return {"seconds": round(sum(seconds) / len(seconds), 4),
            "max_rss_mb": round(max(rss), 2) if rss else None}


def collect_benchmarks(specs: list[str]) -> dict:
    """Benchmarks from `NAME=FILE`, `FILE` (named by its stem) or `DIR` (every *.tsv below it,
    named by its path relative to DIR). Missing files are skipped: a stage may not have run here."""
    stages: dict[str, dict] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = "", spec
        p = Path(path)
        if p.is_dir():
            files = [(str(f.relative_to(p).with_suffix("")), f) for f in sorted(p.rglob("*.tsv"))]
        else:
            files = [(name or p.stem, p)]
        for stage, f in files:
            bench = read_benchmark(f)
            if bench is not None:
                stages[stage] = bench
    return stages


def check_stamps(stamps: list[dict], training: dict, source: str) -> dict[str, str]:
    """Each stage's config hash; refuses a training run whose steps or length are not what
    the training stamp says (a stale summary left by an earlier config)."""
    train = next((s["config"] for s in stamps if s.get("stage") == "train"), None)
    if train is not None:
        want = {"steps": train.get("iters"), "seq": train.get("seq")}
        stale = {k: (training.get(k), v) for k, v in want.items()
                 if v is not None and training.get(k) != v}
        if stale:
            what = ", ".join(f"{k} {got} (config: {v})" for k, (got, v) in stale.items())
            raise ResultError(f"{source} does not follow the current config: {what}; re-run "
                              "training (delete the adapter directory if Snakemake kept it)")
    return {s["stage"]: s["hash"] for s in stamps}


def validate_result(result: dict, schema_path: str | Path) -> None:
    """Raise ResultError listing every place where `result` breaks the schema."""
    schema = read_json(schema_path)
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(result), key=lambda e: list(e.absolute_path))
    if errors:
        lines = [f"  at {'/'.join(str(p) for p in e.absolute_path) or '(top level)'}: {e.message}"
                 for e in errors]
        raise ResultError(f"result does not match {schema_path}:\n" + "\n".join(lines))
