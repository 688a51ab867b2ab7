"""The chunking experiment's result: scores before and after fine-tuning, training and plan.

Written to `results/{model}_chunk_score.json` and checked against result.schema.json.
"""

from __future__ import annotations

import html
from pathlib import Path

from segback.experiment.result_html import (
    compare_table, fmt, metric_keys, page_head, stage_table, training_rows,
)
from segback.experiment.result_parts import (
    SCHEMA_VERSION, delta_of, metrics_of, plan_of, training_of,
)

SCHEMA = Path(__file__).with_name("result.schema.json")  # package data


def build_result(model_name: str, baseline: dict, finetuned: dict, train_summary: dict,
                 plan: dict, stages: dict | None = None, artifacts: dict | None = None,
                 sources: dict | None = None) -> dict:
    src = {"baseline": "baseline score", "finetuned": "fine-tuned score",
           "train": "train summary", "plan": "plan", **(sources or {})}
    base = metrics_of(baseline, src["baseline"])
    tuned = metrics_of(finetuned, src["finetuned"])
    result = {
        "schema_version": SCHEMA_VERSION,
        "model": model_name,
        "baseline": base,
        "finetuned": tuned,
        "delta": delta_of(base, tuned),
        "training": training_of(train_summary, plan, src["train"]),
        "plan": plan_of(plan, src["plan"]),
        "stages": dict(stages or {}),
    }
    if artifacts:
        result["artifacts"] = dict(artifacts)
    return result


def render_table(result: dict) -> str:
    """A self-contained HTML page: the score table and the training figures."""
    tuned = result["finetuned"]
    train_rows = training_rows(result["training"])
    pred = result["plan"].get("predicted_peak_gb")
    if pred is not None:
        train_rows.append(f"<tr><td>predicted_peak_gb</td><td>{fmt('gb', pred)}</td></tr>")
    title = f"segback chunking result: {html.escape(result['model'])}"
    parts = [
        *page_head(title),
        f"<h2>{title}</h2>",
        *compare_table(result["baseline"], tuned, result["delta"], metric_keys(tuned)),
        "<h3>Training</h3><table>", *train_rows, "</table>",
        *stage_table(result["stages"]),
    ]
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def summary_line(result: dict) -> str:
    """What `segback summarize` reports on stderr."""
    d = result["delta"].get("mean_score")
    return (f"mean_score {result['baseline']['mean_score']} -> "
            f"{result['finetuned']['mean_score']} (delta {d})")
