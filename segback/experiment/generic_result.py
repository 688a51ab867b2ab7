"""The generic task's result (the user's own data): held-out loss and perplexity before and
after fine-tuning (`segback evaluate`), and a scorer's scores beside them when one ran.

Written to `results/{model}_{dataset}_eval.json` and checked against generic_result.schema.json.
"""

from __future__ import annotations

import html
from pathlib import Path

from segback.experiment.result_html import (
    compare_table, metric_keys, page_head, stage_table, training_rows,
)
from segback.experiment.result_parts import (
    LOWER_IS_BETTER, SCHEMA_VERSION, ResultError, delta_of, metrics_of, number, plan_of,
    required_fields, training_of,
)

SCHEMA = Path(__file__).with_name("generic_result.schema.json")  # package data

# Figures of `segback evaluate` (held-out loss) in a generic result; loss and ppl get a delta.
EVAL_FIELDS = ("loss", "ppl", "tokens", "examples")
EVAL_DELTA = ("loss", "ppl")


def eval_of(ev: dict, source: str) -> dict:
    """The held-out figures of a `segback evaluate` output (loss, ppl, tokens, examples)."""
    out = required_fields(ev, EVAL_FIELDS, source, "evaluation")
    for k in ("dropped", "truncated", "max_seq_length", "seconds"):
        if isinstance(ev.get(k), (int, float)) and not isinstance(ev.get(k), bool):
            out[k] = number(ev[k])
    return out


def build_generic_result(model_name: str, dataset: str, baseline_eval: dict,
                         finetuned_eval: dict, train_summary: dict, plan: dict,
                         stages: dict | None = None, artifacts: dict | None = None,
                         sources: dict | None = None, scorer: str | None = None,
                         baseline_score: dict | None = None,
                         finetuned_score: dict | None = None) -> dict:
    """The generic task's result: held-out loss/perplexity before and after, and with a
    scorer its scores (`scores.baseline`, `scores.finetuned`, `scores.delta`)."""
    src = {"baseline_eval": "baseline evaluation", "finetuned_eval": "fine-tuned evaluation",
           "baseline": "baseline score", "finetuned": "fine-tuned score",
           "train": "train summary", "plan": "plan", **(sources or {})}
    base = eval_of(baseline_eval, src["baseline_eval"])
    tuned = eval_of(finetuned_eval, src["finetuned_eval"])
    delta = {}
    for k in EVAL_DELTA:
        b, f = base[k], tuned[k]
        delta[k] = round(f - b, 6) if None not in (b, f) else None
    result = {
        "schema_version": SCHEMA_VERSION,
        "task": "generic",
        "dataset": dataset,
        "model": model_name,
        "baseline": base,
        "finetuned": tuned,
        "delta": delta,
        "training": training_of(train_summary, plan, src["train"]),
        "plan": plan_of(plan, src["plan"]),
        "stages": dict(stages or {}),
    }
    if scorer:
        if baseline_score is None or finetuned_score is None:
            raise ResultError(f"scorer {scorer}: both the baseline and the fine-tuned score "
                              "are needed (--baseline, --finetuned)")
        b_scores = metrics_of(baseline_score, src["baseline"])
        f_scores = metrics_of(finetuned_score, src["finetuned"])
        result["scorer"] = scorer
        result["scores"] = {"baseline": b_scores, "finetuned": f_scores,
                            "delta": delta_of(b_scores, f_scores)}
    if artifacts:
        result["artifacts"] = dict(artifacts)
    return result


def render_generic_table(result: dict) -> str:
    """A self-contained HTML page of a generic result: held-out loss and perplexity before and
    after fine-tuning, the scorer's scores when there are any, and the training figures."""
    lower = LOWER_IS_BETTER | set(EVAL_DELTA)
    title = (f"segback result: {html.escape(result['model'])} on "
             f"{html.escape(result['dataset'])}")
    parts = [
        *page_head(title),
        f"<h2>{title}</h2><h3>Held-out test loss</h3>",
        *compare_table(result["baseline"], result["finetuned"], result["delta"],
                       list(EVAL_FIELDS), lower),
    ]
    if "scores" in result:
        sc = result["scores"]
        parts += [f"<h3>Scores ({html.escape(result['scorer'])})</h3>",
                  *compare_table(sc["baseline"], sc["finetuned"], sc["delta"],
                                 metric_keys(sc["finetuned"]), lower)]
    parts += ["<h3>Training</h3><table>", *training_rows(result["training"]), "</table>"]
    parts += stage_table(result["stages"])
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def summary_line(result: dict) -> str:
    """What `segback summarize --task generic` reports on stderr."""
    b, f = result["baseline"], result["finetuned"]
    line = f"test loss {b['loss']} -> {f['loss']} (ppl {b['ppl']} -> {f['ppl']})"
    if "scorer" in result:
        line += (f"; {result['scorer']} score {result['scores']['baseline']['mean_score']} -> "
                 f"{result['scores']['finetuned']['mean_score']}")
    return line
