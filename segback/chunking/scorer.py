"""`segback score`: grade chunking answers against the gold chunks; never crashes on model output.

Per case, a weighted score out of 100 (the weights are WEIGHTS):

    json 30      a JSON object could be extracted from the text (`extract`)
    schema 20    it matches chunks.schema.json: {"chunks": [{"anchor": str, "label": str}]}
                 with at most MAX_CHUNKS chunks
    anchors 25   fraction of chunks that are placed: the anchor names a transcript message
                 (exactly or after a repair) and the chunk is in transcript order (`placement`)
    labels 15    fraction of chunks that are placed and whose label is a short, distinct title
    nonempty 10  at least one chunk is placed

A label or a non-empty list earns nothing without a chunk of the transcript to go with it, so an
answer whose anchors are all unknown scores 50 (json + schema), not 75. Denominators are all
entries of the list; entries after the first MAX_CHUNKS are not examined and earn nothing. When
no JSON can be extracted every component scores 0; when the schema fails, anchors and labels
still get credit for the well-formed entries. Beside the score: boundary precision, recall and
F1, Pk, WindowDiff and label ROUGE-L (`metrics`).

Summary figures are means over the cases where the figure is defined (null values are left
out; a mean with no values is null). score.json is strict JSON (no NaN or Infinity). Warnings
about the predictions file (`inputs`) go into the summary's `warnings` and to stderr. Of several
rows with the same id the first is scored and the others are reported; ids that are not gold
cases are reported and ignored; gold cases without a prediction score 0 and count in
`n_missing`.

A gold answer scores 100 with boundary F1 = 1; an empty answer scores 0.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any

import jsonschema

from segback.chunking.extract import extract_json
from segback.chunking.inputs import InputError, load_predictions, read_cases, show_id
from segback.chunking.metrics import boundary_prf, finite, rouge_l, window_metrics
from segback.chunking.placement import MAX_CHUNKS, label_problem, place_chunks
from segback.chunking.prompt import transcript
from segback.io import atomic_write_text

WEIGHTS = {"json": 30, "schema": 20, "anchors": 25, "labels": 15, "nonempty": 10}
MAX_WARNINGS = 100  # kept in the summary; the rest are counted
SCHEMA_PATH = Path(__file__).with_name("chunks.schema.json")


@lru_cache(maxsize=1)
def validator() -> Any:
    schema = json.loads(SCHEMA_PATH.read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def schema_problem(obj: Any) -> str | None:
    """The first schema error as a reason, or None; over-long lists are caught before
    jsonschema so it never walks or prints them."""
    chunks = obj.get("chunks") if isinstance(obj, dict) else None
    if isinstance(chunks, list) and len(chunks) > MAX_CHUNKS:
        return f"schema: {len(chunks)} chunks, more than the {MAX_CHUNKS} allowed at chunks"
    try:
        error = next(validator().iter_errors(obj), None)
    except RecursionError:  # not reached for objects within MAX_DEPTH; belt and braces
        return "schema: nested too deeply to check"
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path) or "root"
    return f"schema: {error.message[:200]} at {where}"


def score_case(case: dict, text: Any) -> dict:
    """The score row of one case: components, total, reasons and segmentation metrics."""
    messages = transcript(case)
    ids = [m["id"] for m in messages]
    index = {mid: i for i, mid in enumerate(ids)}
    gold_chunks = case["gold"]["chunks"]
    gold_at = {index[c["anchor"]]: c["label"] for c in gold_chunks if c["anchor"] in index}
    comp = dict.fromkeys(WEIGHTS, 0.0)
    reasons: list[str] = []
    pred_at: dict[int, Any] = {}
    repairs, n_pred = 0, 0

    obj, why = extract_json(text)
    if why is not None:
        reasons.append(why)
    else:
        comp["json"] = 1.0
        problem = schema_problem(obj)
        if problem:
            reasons.append(problem)
        else:
            comp["schema"] = 1.0
        chunks = obj.get("chunks") if isinstance(obj, dict) else None
        items = chunks if isinstance(chunks, list) else []
        n_pred = len(items)
        placed, counts, repairs = place_chunks(items, ids, index)
        placed_items = set(placed.values())
        good_labels = 0
        seen_labels: set[str] = set()
        for i, item in enumerate(items[:MAX_CHUNKS]):
            if not isinstance(item, dict):
                continue
            problem = label_problem(item.get("label"), seen_labels)
            if problem:
                counts[problem] = counts.get(problem, 0) + 1
            elif i in placed_items:
                good_labels += 1
        pred_at = {pos: items[i].get("label") for pos, i in sorted(placed.items())}
        if items:
            comp["anchors"] = len(placed) / len(items)
            comp["labels"] = good_labels / len(items)
            comp["nonempty"] = float(bool(placed))
            if not placed:
                reasons.append("no chunk placed in the transcript")
        else:
            reasons.append("no chunks")
        reasons += [f"{v} x {k}" for k, v in counts.items()]
        if repairs:
            reasons.append(f"{repairs} x anchor repaired")

    gold_b, pred_b = set(gold_at) - {0}, set(pred_at) - {0}
    pk_v, wd_v = window_metrics(len(messages), gold_b, pred_b)
    rl = [rouge_l(label, pred_at.get(pos)) for pos, label in gold_at.items()]
    return {
        "id": case["id"],
        "score": round(sum(WEIGHTS[k] * v for k, v in comp.items()), 4),
        "components": comp,
        "reasons": reasons,
        "n_messages": len(messages),
        "n_gold_chunks": len(gold_chunks),
        "n_pred_chunks": n_pred,
        "anchor_repairs": repairs,
        "boundary": boundary_prf(gold_b, pred_b),
        "pk": pk_v,
        "windowdiff": wd_v,
        "rouge_l": sum(rl) / len(rl) if rl else 0.0,
    }


def _mean(values: list[Any], digits: int = 4) -> float | None:
    """Mean of the finite numbers in `values` (None, NaN and non-numbers left out)."""
    vals = [v for v in map(finite, values) if v is not None]
    return round(sum(vals) / len(vals), digits) if vals else None


def index_predictions(preds: list[Any], where: list[str], case_ids: set[str],
                      warnings: list[str]) -> tuple[dict[str, Any], int]:
    """({case id: first prediction row}, duplicate rows); reports odd, duplicate and unknown
    rows in `warnings`."""
    lines: dict[str, list[int]] = {}
    for i, p in enumerate(preds):
        pid = p.get("id") if isinstance(p, dict) else None
        if not isinstance(p, dict):
            warnings.append(f"{where[i]}: prediction is not a JSON object; ignored")
        elif isinstance(pid, bool) or not isinstance(pid, (str, int)):
            warnings.append(f"{where[i]}: prediction has no string or integer id; ignored")
        else:
            lines.setdefault(str(pid), []).append(i)
    n_duplicates = 0
    for pid, rows in lines.items():
        if len(rows) > 1:
            n_duplicates += len(rows) - 1
            warnings.append(f"duplicate prediction id {show_id(pid)} at "
                            f"{', '.join(where[i] for i in rows[:10])}"
                            f"{' …' if len(rows) > 10 else ''}; the first is scored")
        if pid not in case_ids:
            warnings.append(f"{where[rows[0]]}: prediction id {show_id(pid)} is not a gold case; "
                            "ignored")
    return {pid: preds[rows[0]] for pid, rows in lines.items()}, n_duplicates


def _cap(warnings: list[str]) -> list[str]:
    if len(warnings) <= MAX_WARNINGS:
        return warnings
    return [*warnings[:MAX_WARNINGS], f"… and {len(warnings) - MAX_WARNINGS} more warnings"]


def score_predictions(cases: list[dict], preds: list[Any], where: list[str] | None = None,
                      warnings: list[str] | None = None) -> dict:
    """Summary over all cases; a case without a prediction scores 0 ('missing prediction').

    `where[i]` says where preds[i] came from (e.g. 'file:line') for warnings; `warnings` are
    earlier ones (from reading the file) to report with the summary's own."""
    where = where if where is not None else [f"prediction {i + 1}" for i in range(len(preds))]
    warnings = list(warnings or [])
    case_ids = {str(c["id"]) for c in cases}
    by_id, n_duplicates = index_predictions(preds, where, case_ids, warnings)
    rows = []
    for case in cases:
        pred = by_id.get(str(case["id"]))
        row = score_case(case, pred.get("text") if pred else None)
        if pred is None:
            row["reasons"] = ["missing prediction"]
        row["generated_tokens"] = finite(pred.get("generated_tokens")) if pred else None
        rows.append(row)
    missing = [str(c["id"]) for c in cases if str(c["id"]) not in by_id]
    if missing:
        shown = ", ".join(show_id(m) for m in missing[:10]) + (" …" if len(missing) > 10 else "")
        warnings.append(f"{len(missing)} gold case(s) have no prediction and score 0: {shown}")
    comp = {k: [r["components"][k] for r in rows] for k in WEIGHTS}
    return {
        "n": len(rows),
        "n_missing": len(missing),
        "n_extra_predictions": sum(i not in case_ids for i in by_id),
        "n_duplicate_predictions": n_duplicates,
        "weights": WEIGHTS,
        "mean_score": _mean([r["score"] for r in rows], 2),
        "valid_json_rate": _mean(comp["json"]),
        "schema_rate": _mean(comp["schema"]),
        "anchor_rate": _mean(comp["anchors"]),
        "label_rate": _mean(comp["labels"]),
        "nonempty_rate": _mean(comp["nonempty"]),
        "boundary_precision": _mean([r["boundary"]["precision"] for r in rows]),
        "boundary_recall": _mean([r["boundary"]["recall"] for r in rows]),
        "boundary_f1": _mean([r["boundary"]["f1"] for r in rows]),
        "pk": _mean([r["pk"] for r in rows]),
        "windowdiff": _mean([r["windowdiff"] for r in rows]),
        "rouge_l": _mean([r["rouge_l"] for r in rows]),
        "mean_generated_tokens": _mean([r["generated_tokens"] for r in rows], 1),
        "anchor_repairs": sum(r["anchor_repairs"] for r in rows),
        "warnings": _cap(warnings),
        "cases": rows,
    }


def to_json(summary: dict) -> str:
    """Strict JSON: a NaN or Infinity here is a bug, so it raises instead of being written."""
    return json.dumps(summary, indent=2, allow_nan=False) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", required=True, help="cases JSONL (raw or filtered)")
    parser.add_argument("--pred", required=True, help="predictions JSONL from `segback generate`")
    parser.add_argument("--out", required=True, help="summary JSON")


def main(args: argparse.Namespace) -> int:
    try:
        cases = read_cases(args.data)
        preds, where, warnings = load_predictions(args.pred)
    except InputError as e:
        raise SystemExit(f"segback score: {e}") from None
    summary = score_predictions(cases, preds, where, warnings)
    for warning in summary["warnings"]:
        print(f"segback score: warning: {warning}", file=sys.stderr)
    try:
        atomic_write_text(args.out, to_json(summary))
    except OSError as e:
        raise SystemExit(f"segback score: cannot write {args.out} ({e.strerror or e}); "
                         "check that --out names a writable path.") from None
    print(f"segback score: {summary['n']} cases, mean score {summary['mean_score']}, "
          f"valid JSON {summary['valid_json_rate']}, boundary F1 {summary['boundary_f1']}",
          file=sys.stderr)
    return 0
