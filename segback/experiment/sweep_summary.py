"""A sweep's results in one table: one row per branch (model, seq, lora_rank, window) with its
fine-tuned score, valid-JSON rate, peak training memory and training time, or for the generic
task its held-out loss and perplexity; the best branch by score, or by test loss.
"""

from __future__ import annotations

import html
import json
from typing import Any

from segback.experiment.result_html import fmt, page_head
from segback.experiment.result_parts import SCHEMA_VERSION, ResultError, number
from segback.io import read_json

# The sweep table's columns after the branch keys: (name, header, where in a result, format key).
SWEEP_FIELDS = (
    ("score", "score /100", ("finetuned", "mean_score"), "mean_score"),
    ("baseline_score", "baseline /100", ("baseline", "mean_score"), "mean_score"),
    ("delta_score", "Δ score", ("delta", "mean_score"), "mean_score"),
    ("valid_json_rate", "valid JSON", ("finetuned", "valid_json_rate"), "valid_json_rate"),
    ("peak_gb", "peak GB", ("training", "peak_gb"), "gb"),
    ("train_seconds", "training s", ("training", "seconds"), "seconds"),
    ("steps", "steps", ("training", "steps"), "steps"),
)
SWEEP_KEYS = ("model", "seq", "lora_rank")
# A sweep over train.window (whole examples vs short windows) names each branch's window too.
WINDOW_KEY = "window"
# A generic task's sweep: held-out loss and perplexity (lower is better), and the training figures.
GENERIC_SWEEP_FIELDS = (
    ("loss", "test loss", ("finetuned", "loss"), "loss"),
    ("baseline_loss", "baseline loss", ("baseline", "loss"), "loss"),
    ("delta_loss", "Δ loss", ("delta", "loss"), "loss"),
    ("ppl", "ppl", ("finetuned", "ppl"), "ppl"),
    ("baseline_ppl", "baseline ppl", ("baseline", "ppl"), "ppl"),
    *SWEEP_FIELDS[4:],  # peak GB, training seconds, steps
)
GENERIC_SCORE_FIELD = ("score", "score", ("scores", "finetuned", "mean_score"), "mean_score")


def sweep_fields(sweep_or_result: dict) -> tuple:
    """The table's columns: a chunking sweep's, or a generic one's (+ the score with a scorer)."""
    if sweep_or_result.get("task") != "generic":
        return SWEEP_FIELDS
    scored = "scores" in sweep_or_result or sweep_or_result.get("scored")
    return GENERIC_SWEEP_FIELDS + ((GENERIC_SCORE_FIELD,) if scored else ())


def keys_of(rows: list[dict]) -> tuple[str, ...]:
    """The branch keys of a sweep's rows: model, seq, lora_rank, and window where named."""
    return SWEEP_KEYS + ((WINDOW_KEY,) if any(WINDOW_KEY in r for r in rows) else ())


def sweep_rows(branches: list[dict], read=read_json) -> list[dict]:
    """One row per branch: its keys (model, seq, lora_rank; window when the branch names it),
    the table's figures read from its result JSON (`result`), and that path."""
    rows = []
    for b in branches:
        if not isinstance(b, dict) or "result" not in b:
            raise ResultError(f"sweep branch {b!r}: expected an object with a `result` path")
        result = read(b["result"])
        row = {k: b.get(k) for k in keys_of([b])}
        for name, _, path, _ in sweep_fields(result):
            part = result
            for key in path:
                if not isinstance(part, dict) or key not in part:
                    raise ResultError(f"{b['result']}: missing `{'.'.join(path)}`")
                part = part[key]
            row[name] = number(part)
        row["result"] = b["result"]
        rows.append(row)
    return rows


def build_sweep(rows: list[dict], task: str = "chunking") -> dict:
    """The sweep summary: rows, the keys that vary, and the best branch: by fine-tuned score,
    or (generic task) by fine-tuned test loss."""
    keys = keys_of(rows)
    swept = [k for k in keys if len({json.dumps(r.get(k)) for r in rows}) > 1]
    by = "loss" if task == "generic" else "score"
    scored = [r for r in rows if isinstance(r[by], (int, float))]
    pick = min if by == "loss" else max
    best = pick(scored, key=lambda r: r[by]) if scored else None
    head = {"schema_version": SCHEMA_VERSION}
    if task == "generic":
        head |= {"task": task, "best_by": by, "scored": "score" in (rows[0] if rows else {})}
    return {
        **head,
        "swept": swept,
        "best": {k: best.get(k) for k in (*keys, by, "result")} if best else None,
        "rows": rows,
    }


def _sweep_cell(name: str, fmt_key: str, v: Any) -> str:
    if v is None or fmt_key not in {"seconds", "steps"}:
        return fmt(fmt_key, v, signed=name.startswith("delta"))
    return f"{v:.0f}" if isinstance(v, (int, float)) else html.escape(str(v))


def _sweep_table(sweep: dict) -> tuple[list[str], list[list[str]]]:
    fields = sweep_fields(sweep)
    keys = keys_of(sweep["rows"])
    headers = [*keys, *(h for _, h, _, _ in fields)]
    cells = [[html.escape(str(r.get(k)) if k != WINDOW_KEY or r.get(k) else "whole")
              for k in keys]
             + [_sweep_cell(name, fk, r[name]) for name, _, _, fk in fields]
             for r in sweep["rows"]]
    return headers, cells


def _best_line(sweep: dict) -> str:
    b = sweep["best"]
    what = ("Lowest fine-tuned test loss" if sweep.get("best_by") == "loss"
            else "Best fine-tuned score")
    value = b[sweep.get("best_by", "score")]
    window = f", window {b[WINDOW_KEY] or 'whole'}" if WINDOW_KEY in b else ""
    return (f"{what}: {value} ({b['model']}, seq {b['seq']}, rank {b['lora_rank']}{window}; "
            f"{b['result']}).")


def render_sweep_markdown(sweep: dict) -> str:
    headers, cells = _sweep_table(sweep)
    lines = [f"# segback sweep: {len(cells)} branches"
             + (f" over {', '.join(sweep['swept'])}" if sweep["swept"] else ""), "",
             "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(html.unescape(c) for c in row) + " |" for row in cells]
    if sweep["best"]:
        lines += ["", _best_line(sweep)]
    return "\n".join(lines) + "\n"


def render_sweep_html(sweep: dict) -> str:
    headers, cells = _sweep_table(sweep)
    title = f"segback sweep: {len(cells)} branches"
    best = sweep["best"]["result"] if sweep["best"] else None
    what = ("Fine-tuned and baseline test loss and perplexity" if sweep.get("task") == "generic"
            else "Fine-tuned score and valid-JSON rate")
    rows = []
    for r, row in zip(sweep["rows"], cells):
        style = ' style="font-weight:bold"' if r["result"] == best else ""
        rows.append(f"<tr{style}>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>")
    return "\n".join([
        *page_head(title),
        f"<h2>{title}</h2><p>{what} on the held-out test set, peak memory and wall time of "
        "training; the best branch in bold.</p>",
        "<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in headers) + "</tr>",
        *rows, "</table>", "</body></html>",
    ]) + "\n"
