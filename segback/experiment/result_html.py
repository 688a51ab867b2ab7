"""HTML pieces the result pages share: the page head, a before/after table, the training and
stage tables, and `fmt` for one cell."""

from __future__ import annotations

import html
from typing import Any

from segback.experiment.result_parts import LOWER_IS_BETTER, METRICS


def page_head(title: str) -> list[str]:
    """A self-contained page's lines up to its <body>."""
    return [
        "<!DOCTYPE html>", "<html><head><meta charset=\"utf-8\">", f"<title>{title}</title>",
        "<style>body{font-family:sans-serif}table{border-collapse:collapse;margin:1em 0}"
        "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}"
        "td:first-child{text-align:left}</style></head><body>",
    ]


def fmt(key: str, v: Any, signed: bool = False) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return html.escape(str(v))
    if isinstance(v, int):
        return f"{v:+d}" if signed else str(v)
    if key.endswith("_rate") or key in {"boundary_precision", "boundary_recall", "boundary_f1",
                                        "rouge_l"}:
        return f"{v * 100:+.1f} pp" if signed else f"{v * 100:.1f}%"
    digits = 2 if key == "mean_score" else 3
    return f"{v:+.{digits}f}" if signed else f"{v:.{digits}f}"


def metric_keys(tuned: dict) -> list[str]:
    """A score table's rows: the known metrics in table order, then any further ones."""
    return [m for m in METRICS if m in tuned] + [m for m in tuned if m not in METRICS]


def compare_table(base: dict, tuned: dict, delta: dict, keys: list[str],
                  lower: set[str] = LOWER_IS_BETTER) -> list[str]:
    """Baseline, fine-tuned and delta per metric; `lower` are marked lower-is-better."""
    rows = ["<table><tr><th>metric</th><th>baseline</th><th>fine-tuned</th><th>delta</th></tr>"]
    for k in keys:
        note = " (lower is better)" if k in lower else ""
        rows.append(f"<tr><td>{html.escape(k)}{note}</td><td>{fmt(k, base.get(k))}</td>"
                    f"<td>{fmt(k, tuned.get(k))}</td><td>{fmt(k, delta.get(k), signed=True)}</td>"
                    "</tr>")
    return [*rows, "</table>"]


def training_rows(training: dict) -> list[str]:
    """One row per training figure, the segments last."""
    rows = [f"<tr><td>{html.escape(k)}</td><td>{fmt(k, v)}</td></tr>"
            for k, v in training.items() if k != "segments"]
    segs = ", ".join(f"[{a}, {b})" for a, b in training["segments"])
    rows.append(f"<tr><td>segments</td><td>{len(training['segments'])}: {segs}</td></tr>")
    return rows


def stage_table(stages: dict) -> list[str]:
    """Each stage's wall time; nothing when no benchmark was read."""
    rows = [f"<tr><td>{html.escape(k)}</td><td>{v['seconds']:.1f}</td></tr>"
            for k, v in stages.items()]
    return ["<h3>Stage wall time (s)</h3><table>", *rows, "</table>"] if rows else []
