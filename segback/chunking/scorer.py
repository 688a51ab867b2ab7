"""Score chunking answers against the gold chunks; never crashes on model output.

Per case, a weighted score out of 100 (the weights are WEIGHTS):

    json 30      a JSON object could be extracted from the text (```json fences and prose
                 around it are tolerated; the first object with a "chunks" key wins, else the
                 first complete object)
    schema 20    it matches chunks.schema.json: {"chunks": [{"anchor": str, "label": str}]}
    anchors 25   fraction of chunks whose anchor names a transcript message: exactly, or after a
                 repair (surrounding brackets/quotes/spaces, case, a unique prefix of >= 4
                 characters, or exactly one message id inside it); repairs are counted.
                 Unknown, ambiguous and duplicate anchors fail.
    labels 15    fraction of chunks whose label is a non-empty string of <= 8 words, distinct
                 (case-insensitively) from the labels before it
    nonempty 10  the chunk list has at least one entry

When no JSON can be extracted every component scores 0; when the schema fails, anchors and
labels still get credit for the well-formed entries (the fraction is over all entries).

Segmentation quality, beside the score:
- boundaries: a boundary is the index of a chunk's first message. The first chunk always starts
  at message 0, so index 0 is left out of both gold and prediction (it would reward every
  answer for free). Precision, recall and F1 match exact indices; an empty prediction has
  precision 0 (1 when the gold is empty too). Summary figures are means over cases.
- Pk and WindowDiff (nltk; lower is better) over the boundary string of message positions
  1..n-1, with k = half the mean gold chunk length in messages (at least 1); cases of fewer
  than 3 messages get None and are left out of the means.
- rouge_l: ROUGE-L F (rouge-score, stemmed) between each gold label and the label of the
  predicted chunk that starts at the same message (0 when none does), averaged over gold chunks.

A gold answer scores 100 with boundary F1 = 1; an empty answer scores 0.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any

from segback.chunking.prompt import transcript
from segback.io import atomic_write_json, read_jsonl

WEIGHTS = {"json": 30, "schema": 20, "anchors": 25, "labels": 15, "nonempty": 10}
MAX_LABEL_WORDS = 8
MIN_PREFIX = 4
SCHEMA_PATH = Path(__file__).with_name("chunks.schema.json")

_FENCE = re.compile(r"```[ \t]*(?:json|JSON)?[ \t]*\n?(.*?)```", re.S)
_MAX_STARTS = 256  # '{' positions tried per text: bounds the work on pathological output


@lru_cache(maxsize=1)
def validator() -> Any:
    import jsonschema

    schema = json.loads(SCHEMA_PATH.read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


@lru_cache(maxsize=1)
def rouge() -> Any:
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def extract_json(text: Any) -> tuple[Any, str | None]:
    """(object, None) for the answer's JSON object, or (None, why not)."""
    if text is None or (isinstance(text, str) and not text.strip()):
        return None, "empty output"
    if not isinstance(text, str):
        return None, f"text is not a string: {type(text).__name__}"
    decoder = json.JSONDecoder(parse_constant=_reject_constant)
    first_error = None
    for candidate in [*(m.group(1) for m in _FENCE.finditer(text)), text]:
        starts = [i for i, c in enumerate(candidate) if c == "{"][:_MAX_STARTS]
        fallback = None
        for n, start in enumerate(starts):
            try:
                obj, _ = decoder.raw_decode(candidate, start)
            except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
                first_error = first_error or getattr(e, "msg", None) or str(e) or type(e).__name__
                continue
            if isinstance(obj, dict) and "chunks" in obj:
                return obj, None
            if n == 0:  # an inner object of a broken outer one does not count
                fallback = obj
        if fallback is not None:
            return fallback, None
    if "{" not in text:
        return None, "no JSON object"
    return None, f"invalid or truncated JSON ({first_error})"


def resolve_anchor(anchor: Any, ids: list[str], index: dict[str, int]
                   ) -> tuple[int | None, str]:
    """(message index or None, 'exact' | 'repaired' | why it failed)."""
    if not isinstance(anchor, str):
        return None, "anchor not a string"
    if anchor in index:
        return index[anchor], "exact"
    a = anchor.strip().strip("[]<>()\"'` ").strip().lower()
    if a in index:
        return index[a], "repaired"
    if len(a) >= MIN_PREFIX:
        hits = [i for i in ids if i.startswith(a)]
        if len(hits) == 1:
            return index[hits[0]], "repaired"
        if len(hits) > 1:
            return None, "ambiguous anchor"
        inside = [i for i in ids if i in a]
        if len(inside) == 1:
            return index[inside[0]], "repaired"
    return None, "unknown anchor"


def label_problem(label: Any, seen: set[str]) -> str | None:
    if not isinstance(label, str):
        return "label not a string"
    words = label.split()
    if not words:
        return "empty label"
    if len(words) > MAX_LABEL_WORDS:
        return f"label over {MAX_LABEL_WORDS} words"
    key = " ".join(words).lower()
    if key in seen:
        return "duplicate label"
    seen.add(key)
    return None


def boundary_prf(gold: set[int], pred: set[int]) -> dict[str, float]:
    tp = len(gold & pred)
    p = tp / len(pred) if pred else float(not gold)
    r = tp / len(gold) if gold else float(not pred)
    f1 = 2 * p * r / (p + r) if p + r else 0.0
    return {"precision": p, "recall": r, "f1": f1}


def window_metrics(n: int, gold: set[int], pred: set[int]) -> tuple[float | None, float | None]:
    """(Pk, WindowDiff) over message positions 1..n-1; None for degenerate short cases."""
    from nltk.metrics.segmentation import pk, windowdiff

    if n < 3:
        return None, None
    ref = "".join("1" if i in gold else "0" for i in range(1, n))
    hyp = "".join("1" if i in pred else "0" for i in range(1, n))
    k = min(len(ref), max(1, round(n / (2 * (len(gold) + 1)))))
    return pk(ref, hyp, k=k), windowdiff(ref, hyp, k)


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
        errors = sorted(validator().iter_errors(obj), key=lambda e: list(e.absolute_path))
        if errors:
            e = errors[0]
            where = "/".join(str(p) for p in e.absolute_path) or "root"
            reasons.append(f"schema: {e.message[:200]} at {where}")
        else:
            comp["schema"] = 1.0
        chunks = obj.get("chunks") if isinstance(obj, dict) else None
        items = chunks if isinstance(chunks, list) else []
        n_pred = len(items)
        counts: dict[str, int] = {}
        good_anchors = good_labels = 0
        seen_labels: set[str] = set()
        for item in items:
            if not isinstance(item, dict):
                counts["chunk not an object"] = counts.get("chunk not an object", 0) + 1
                continue
            pos, how = resolve_anchor(item.get("anchor"), ids, index)
            if pos is not None and pos in pred_at:
                pos, how = None, "duplicate anchor"
            if pos is None:
                counts[how] = counts.get(how, 0) + 1
            else:
                good_anchors += 1
                repairs += how == "repaired"
                pred_at[pos] = item.get("label")
            problem = label_problem(item.get("label"), seen_labels)
            if problem:
                counts[problem] = counts.get(problem, 0) + 1
            else:
                good_labels += 1
        if items:
            comp["anchors"] = good_anchors / len(items)
            comp["labels"] = good_labels / len(items)
            comp["nonempty"] = 1.0
        else:
            reasons.append("no chunks")
        reasons += [f"{v} x {k}" for k, v in counts.items()]
        if repairs:
            reasons.append(f"{repairs} x anchor repaired")
        if list(pred_at) != sorted(pred_at):
            reasons.append("anchors out of order")

    gold_b, pred_b = set(gold_at) - {0}, set(pred_at) - {0}
    pk_v, wd_v = window_metrics(len(messages), gold_b, pred_b)
    rl = [rouge().score(label, pred_at[pos])["rougeL"].fmeasure
          if isinstance(pred_at.get(pos), str) else 0.0 for pos, label in gold_at.items()]
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
    vals = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return round(sum(vals) / len(vals), digits) if vals else None


def score_predictions(cases: list[dict], preds: list[Any]) -> dict:
    """Summary over all cases; a case without a prediction scores 0 ('missing prediction')."""
    by_id = {}
    for p in preds:
        if isinstance(p, dict) and "id" in p:
            by_id.setdefault(str(p["id"]), p)
    rows = []
    for case in cases:
        pred = by_id.get(str(case["id"]))
        row = score_case(case, pred.get("text") if pred else None)
        if pred is None:
            row["reasons"] = ["missing prediction"]
        row["generated_tokens"] = pred.get("generated_tokens") if pred else None
        rows.append(row)
    case_ids = {str(c["id"]) for c in cases}
    comp = {k: [r["components"][k] for r in rows] for k in WEIGHTS}
    return {
        "n": len(rows),
        "n_missing": sum(str(c["id"]) not in by_id for c in cases),
        "n_extra_predictions": sum(i not in case_ids for i in by_id),
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
        "cases": rows,
    }


def read_predictions(path: str | Path) -> list[Any]:
    """Prediction rows; unreadable lines are skipped (their cases then count as missing)."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", required=True, help="cases JSONL (raw or filtered)")
    parser.add_argument("--pred", required=True, help="predictions JSONL from `segback generate`")
    parser.add_argument("--out", required=True, help="summary JSON")


def main(args: argparse.Namespace) -> int:
    cases = read_jsonl(args.data)
    if not cases:
        raise SystemExit(f"segback score: no cases in {args.data}")
    summary = score_predictions(cases, read_predictions(args.pred))
    atomic_write_json(args.out, summary)
    print(f"segback score: {summary['n']} cases, mean score {summary['mean_score']}, "
          f"valid JSON {summary['valid_json_rate']}, boundary F1 {summary['boundary_f1']}",
          file=sys.stderr)
    return 0
