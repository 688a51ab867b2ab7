"""`segback compare`: arms scored on one test set, side by side and split by conversation length.

Each arm is a `segback score` summary of the same test cases (the stock model, and adapters
trained in different ways); its per-case rows are grouped into length buckets by the test
rows' `n_tokens` (prompt + gold answer, the model's tokenizer, as `segback filter-data` counts
them) and averaged per bucket: the weighted score, valid JSON, labels, boundary precision /
recall / F1, Pk and WindowDiff (lower is better), label ROUGE-L, predicted chunks per gold chunk
and generated tokens. Arms with a training summary also show what training saw (steps, tokens,
time, peak memory), so a comparison states that the arms had the same budget.

Differences between the first two fine-tuned arms are paired by case (the same conversations),
with a bootstrap 95% interval of the mean difference (seeded): with a few dozen test cases, a
difference inside its interval's reach of zero is not an answer either way.
"""

from __future__ import annotations

import argparse
import html
import json
import math
import sys
from typing import Any

import numpy as np

from segback.io import atomic_write_json, atomic_write_text, read_json, read_jsonl

# (key, header, how a case row gives it, lower is better)
METRICS = (
    ("mean_score", "score /100", lambda r: r["score"], False),
    ("valid_json_rate", "valid JSON", lambda r: r["components"]["json"], False),
    ("label_rate", "labels valid", lambda r: r["components"]["labels"], False),
    ("boundary_precision", "boundary P", lambda r: r["boundary"]["precision"], False),
    ("boundary_recall", "boundary R", lambda r: r["boundary"]["recall"], False),
    ("boundary_f1", "boundary F1", lambda r: r["boundary"]["f1"], False),
    ("pk", "Pk", lambda r: r["pk"], True),
    ("windowdiff", "WindowDiff", lambda r: r["windowdiff"], True),
    ("rouge_l", "label ROUGE-L", lambda r: r["rouge_l"], False),
    ("chunks_per_gold", "chunks / gold",
     lambda r: r["n_pred_chunks"] / r["n_gold_chunks"] if r["n_gold_chunks"] else None, False),
    ("mean_generated_tokens", "generated tokens", lambda r: r.get("generated_tokens"), False),
)
TRAINING = ("steps", "seq", "batch_size", "grad_accum", "input_tokens", "tokens", "seconds",
            "peak_gb", "first_loss", "final_loss")
PAIRED = ("mean_score", "boundary_f1", "pk", "windowdiff", "rouge_l")
BOOTSTRAP = 2000


class CompareError(ValueError):
    """Inputs that cannot be compared; the message says which file and why."""


def _finite(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


def mean(values: list[Any], digits: int = 4) -> float | None:
    vals = [v for v in map(_finite, values) if v is not None]
    return round(sum(vals) / len(vals), digits) if vals else None


def bucket_name(lo: int, hi: int) -> str:
    def k(n: int) -> str:
        return f"{n / 1024:g}K" if n % 1024 == 0 else str(n)

    return f"{k(lo)}–{k(hi)}"


def buckets_of(edges: list[int]) -> list[dict]:
    """Buckets [edges[i], edges[i+1]) (the last one closed), from at least two ascending edges."""
    if len(edges) < 2 or any(b <= a for a, b in zip(edges, edges[1:])):
        raise CompareError(f"--buckets needs two or more ascending token counts, got {edges}")
    return [{"name": bucket_name(lo, hi), "min": lo, "max": hi}
            for lo, hi in zip(edges, edges[1:])]


def bucket_index(n_tokens: int, buckets: list[dict]) -> int | None:
    for i, b in enumerate(buckets):
        last = i == len(buckets) - 1
        if b["min"] <= n_tokens < b["max"] or (last and n_tokens == b["max"]):
            return i
    return None


def summarize_rows(rows: list[dict]) -> dict:
    """The metrics' means over `rows` (case rows of `segback score`)."""
    out: dict[str, Any] = {"n": len(rows)}
    for key, _, get, _ in METRICS:
        out[key] = mean([get(r) for r in rows], 1 if key == "mean_generated_tokens" else 4)
    return out


def paired(a: dict[str, dict], b: dict[str, dict], key: str, seed: int = 0) -> dict:
    """Per-case difference a - b of one metric over the cases both define it for: mean, a
    bootstrap 95% interval, and how many cases a is better, worse or equal on."""
    get = next(g for k, _, g, _ in METRICS if k == key)
    lower = next(lo for k, _, _, lo in METRICS if k == key)
    diffs = [x - y for cid in a if cid in b
             for x, y in [(_finite(get(a[cid])), _finite(get(b[cid])))]
             if x is not None and y is not None]
    if not diffs:
        return {"metric": key, "n": 0, "mean_diff": None, "ci95": None}
    d = np.asarray(diffs)
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, len(d), (BOOTSTRAP, len(d)))].mean(axis=1)
    better = (d < 0) if lower else (d > 0)
    worse = (d > 0) if lower else (d < 0)
    return {"metric": key, "n": len(d), "mean_diff": round(float(d.mean()), 4),
            "ci95": [round(float(np.percentile(means, 2.5)), 4),
                     round(float(np.percentile(means, 97.5)), 4)],
            "better": int(better.sum()), "worse": int(worse.sum()),
            "equal": int(len(d) - better.sum() - worse.sum()), "lower_is_better": lower}


def build_comparison(arms: list[dict], lengths: dict[str, int], buckets: list[dict],
                     read=read_json) -> dict:
    """The comparison of `arms` ({name, score, train_summary?}) on the test cases of `lengths`
    ({case id: n_tokens})."""
    out_arms, by_id = [], []
    for arm in arms:
        if not isinstance(arm, dict) or not {"name", "score"} <= set(arm):
            raise CompareError(f"arm {arm!r}: expected an object with `name` and `score`")
        score = read(arm["score"])
        rows = {str(r["id"]): r for r in score.get("cases", [])}
        if set(rows) != set(lengths):
            raise CompareError(f"{arm['score']}: scores {len(rows)} cases, the test set has "
                               f"{len(lengths)} (or other ids): every arm must be scored on the "
                               "same test set")
        groups: list[list[dict]] = [[] for _ in buckets]
        for cid, r in rows.items():
            i = bucket_index(lengths[cid], buckets)
            if i is not None:
                groups[i].append(r)
        entry: dict[str, Any] = {
            "name": arm["name"], "score": arm["score"],
            "all": summarize_rows(list(rows.values())),
            "by_length": {b["name"]: summarize_rows(g) for b, g in zip(buckets, groups)},
        }
        if arm.get("train_summary"):
            summary = read(arm["train_summary"])
            entry["training"] = {k: summary.get(k) for k in TRAINING}
        out_arms.append(entry)
        by_id.append(rows)
    counts = [0] * len(buckets)
    for n in lengths.values():
        i = bucket_index(n, buckets)
        if i is not None:
            counts[i] += 1
    trained = [i for i, a in enumerate(out_arms) if "training" in a]
    comparison = {
        "schema_version": 1,
        "cases": len(lengths),
        "buckets": [{**b, "n": c} for b, c in zip(buckets, counts)],
        "outside_buckets": len(lengths) - sum(counts),
        "arms": out_arms,
    }
    if len(trained) >= 2:
        i, j = trained[:2]
        comparison["paired"] = {
            "a": out_arms[i]["name"], "b": out_arms[j]["name"],
            "metrics": [paired(by_id[i], by_id[j], key) for key in PAIRED],
        }
    return comparison


# ---- rendering ------------------------------------------------------------------------------

def _cell(key: str, v: Any) -> str:
    if v is None:
        return "–"
    if key in ("n", "steps", "seq", "batch_size", "grad_accum", "input_tokens", "tokens"):
        return f"{int(v):,}"
    if key in ("mean_score", "mean_generated_tokens", "seconds"):
        return f"{v:.1f}"
    if key in ("valid_json_rate", "label_rate"):
        return f"{v * 100:.0f}%"
    return f"{v:.2f}" if key in ("peak_gb", "first_loss", "final_loss") else f"{v:.3f}"


def tables(comparison: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, headers, rows) of the score table by length and of the training table."""
    keys = [k for k, _, _, _ in METRICS]
    heads = ["length", "arm", "n", *(h + (" ↓" if lo else "") for _, h, _, lo in METRICS)]
    rows = []
    for b in [*(b["name"] for b in comparison["buckets"]), "all"]:
        for arm in comparison["arms"]:
            m = arm["all"] if b == "all" else arm["by_length"][b]
            rows.append([b, arm["name"], _cell("n", m["n"]), *(_cell(k, m[k]) for k in keys)])
    out = [("Scores by conversation length (tokens, prompt + gold answer)", heads, rows)]
    trained = [a for a in comparison["arms"] if "training" in a]
    if trained:
        theads = ["arm", *TRAINING]
        trows = [[a["name"], *(_cell(k, a["training"].get(k)) for k in TRAINING)]
                 for a in trained]
        out.append(("Training", theads, trows))
    if "paired" in comparison:
        p = comparison["paired"]
        prow = [[m["metric"], str(m["n"]), _cell(m["metric"], m["mean_diff"]),
                 "–" if m["ci95"] is None else
                 f"[{_cell(m['metric'], m['ci95'][0])}, {_cell(m['metric'], m['ci95'][1])}]",
                 f"{m.get('better', 0)} / {m.get('worse', 0)} / {m.get('equal', 0)}"]
                for m in p["metrics"]]
        out.append((f"Paired by case: {p['a']} minus {p['b']}",
                    ["metric", "cases", "mean difference", "95% bootstrap interval",
                     f"{p['a']} better / worse / equal"], prow))
    return out


def render_markdown(comparison: dict) -> str:
    lines = [f"# Arms on {comparison['cases']} test conversations", ""]
    for title, heads, rows in tables(comparison):
        lines += [f"## {title}", "", "| " + " | ".join(heads) + " |",
                  "|" + "---|" * len(heads)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        lines.append("")
    return "\n".join(lines)


def render_html(comparison: dict) -> str:
    parts = ["<!DOCTYPE html>", "<html><head><meta charset=\"utf-8\">",
             "<title>segback: arms by conversation length</title>",
             "<style>body{font-family:sans-serif}table{border-collapse:collapse;margin:1em 0}"
             "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}"
             "td:first-child,td:nth-child(2){text-align:left}</style></head><body>",
             f"<h2>Arms on {comparison['cases']} test conversations</h2>"]
    for title, heads, rows in tables(comparison):
        parts += [f"<h3>{html.escape(title)}</h3><table><tr>"
                  + "".join(f"<th>{html.escape(h)}</th>" for h in heads) + "</tr>"]
        parts += ["<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>"
                  for r in rows]
        parts.append("</table>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


# ---- command --------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", required=True,
                        help="the test rows every arm was scored on (`segback filter-data`)")
    parser.add_argument("--arms", required=True, metavar="JSON",
                        help="a JSON list of arms {name, score: score JSON, train_summary: "
                             "adapter/train_summary.json (fine-tuned arms)}, in table order")
    parser.add_argument("--buckets", required=True,
                        help="length bucket edges in tokens, comma-separated, e.g. "
                             "8192,16384,24576,32768")
    parser.add_argument("--out", required=True, help="comparison JSON")
    parser.add_argument("--markdown", default=None, help="also write the tables as Markdown")
    parser.add_argument("--table", default=None, help="also write the tables as HTML")


def main(args: argparse.Namespace) -> int:
    try:
        edges = [int(x) for x in args.buckets.split(",") if x.strip()]
        arms = json.loads(args.arms)
        if not isinstance(arms, list) or not arms:
            raise CompareError("--arms expects a non-empty JSON list")
        rows = read_jsonl(args.data)
        if any("n_tokens" not in r for r in rows):
            raise CompareError(f"{args.data}: rows without n_tokens; give the test rows "
                               "`segback filter-data` writes")
        comparison = build_comparison(arms, {str(r["id"]): r["n_tokens"] for r in rows},
                                      buckets_of(edges))
    except (OSError, ValueError, KeyError) as e:  # CompareError, bad JSON, bad score rows
        print(f"segback compare: {e}", file=sys.stderr)
        return 1
    if args.markdown:
        atomic_write_text(args.markdown, render_markdown(comparison))
    if args.table:
        atomic_write_text(args.table, render_html(comparison))
    atomic_write_json(args.out, comparison)
    f1 = ", ".join(f"{a['name']} {a['all']['boundary_f1']}" for a in comparison["arms"])
    print(f"segback compare: {comparison['cases']} cases; boundary F1 {f1} -> {args.out}",
          file=sys.stderr)
    return 0
