"""`segback summarize`: assemble the experiment's result JSON from the workflow's outputs.

Reads the baseline and fine-tuned score summaries (`segback score`), the training summary
(`segback train`'s adapter/train_summary.json), the segment plan (`segback plan`) and, when given,
Snakemake benchmark files; writes `results/{model}_chunk_score.json` after validating it against
`segback/experiment/result.schema.json`, and optionally a small HTML score table for the report.

`segback summarize --sweep BRANCHES` gathers a sweep's per-branch results into one table
(`results/sweep_summary.json`, `--markdown`, `--table`): one row per branch with its fine-tuned
score, valid-JSON rate, peak training memory and training time.

`segback summarize --task generic` does the same for the workflow's generic task (the user's own
data): the baseline and fine-tuned held-out loss and perplexity (`segback evaluate`), and, when
a scorer ran, its scores beside them, into `results/{model}_{dataset}_eval.json`, validated
against `segback/experiment/generic_result.schema.json`. A sweep of such results is tabled by loss.
"""

from __future__ import annotations

import argparse
import csv
import html
import json
import math
import sys
from pathlib import Path
from typing import Any
from collections.abc import Sequence

from segback.io import atomic_write_json, atomic_write_text, read_json

SCHEMA_VERSION = 1
DEFAULT_SCHEMA = Path(__file__).with_name("result.schema.json")  # package data
GENERIC_SCHEMA = Path(__file__).with_name("generic_result.schema.json")  # package data

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
# Figures of `segback evaluate` (held-out loss) in a generic result; loss and ppl get a delta.
EVAL_FIELDS = ("loss", "ppl", "tokens", "examples")
EVAL_DELTA = ("loss", "ppl")


class ResultError(ValueError):
    """An input is missing a field, or the assembled result does not match the schema."""


def _is_scalar(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))


def _number(v: Any) -> Any:
    """JSON has no NaN/inf: map them to null."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def _required(obj: Any, keys: Sequence[str], source: str, what: str) -> dict:
    """`keys` of a JSON object, each a JSON number or null; a clear error if any is missing."""
    if not isinstance(obj, dict):
        raise ResultError(f"{source}: expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in keys if k not in obj]
    if missing:
        raise ResultError(f"{source}: missing {what} field(s) {', '.join(missing)}")
    return {k: _number(obj[k]) for k in keys}


def metrics_of(score: dict, source: str) -> dict:
    """The scalar metrics of a score summary (per-case rows dropped)."""
    out = _required(score, METRICS, source, "score")
    for k, v in score.items():  # any further scalar metric the scorer reports
        if k not in out and isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = _number(v)
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
    out = {k: _number(summary[k]) for k in TRAINING_FIELDS if k in summary and k != "segments"}
    segments = summary.get("segments", plan.get("segments"))
    out["segments"] = normalize_segments(segments, source)
    for k, v in summary.items():  # further scalar figures, e.g. resumed_from
        if k not in out and k not in TRAINING_FIELDS and _is_scalar(v):
            out[k] = _number(v)
    return out


def plan_of(plan: dict, source: str) -> dict:
    if "segments" not in plan:
        raise ResultError(f"{source}: missing plan field `segments`")
    out = {k: _number(v) for k, v in plan.items() if _is_scalar(v)}
    engine = plan.get("engine") if isinstance(plan.get("engine"), dict) else {}
    out.update({k: _number(v) for k, v in engine.items() if _is_scalar(v)})  # how it ran
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


def eval_of(ev: dict, source: str) -> dict:
    """The held-out figures of a `segback evaluate` output (loss, ppl, tokens, examples)."""
    out = _required(ev, EVAL_FIELDS, source, "evaluation")
    for k in ("dropped", "truncated", "max_seq_length", "seconds"):
        if isinstance(ev.get(k), (int, float)) and not isinstance(ev.get(k), bool):
            out[k] = _number(ev[k])
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


def validate_result(result: dict, schema_path: str | Path = DEFAULT_SCHEMA) -> None:
    """Raise ResultError listing every place where `result` breaks the schema."""
    import jsonschema

    schema = read_json(schema_path)
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(result), key=lambda e: list(e.absolute_path))
    if errors:
        lines = [f"  at {'/'.join(str(p) for p in e.absolute_path) or '(top level)'}: {e.message}"
                 for e in errors]
        raise ResultError(f"result does not match {schema_path}:\n" + "\n".join(lines))


def _fmt(key: str, v: Any, signed: bool = False) -> str:
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


def render_table(result: dict) -> str:
    """A self-contained HTML page: the score table and the training figures."""
    base, tuned, delta = result["baseline"], result["finetuned"], result["delta"]
    rows = []
    for k in [m for m in METRICS if m in tuned] + [m for m in tuned if m not in METRICS]:
        note = " (lower is better)" if k in LOWER_IS_BETTER else ""
        rows.append(f"<tr><td>{html.escape(k)}{note}</td><td>{_fmt(k, base.get(k))}</td>"
                    f"<td>{_fmt(k, tuned[k])}</td><td>{_fmt(k, delta.get(k), signed=True)}</td>"
                    "</tr>")
    t = result["training"]
    train_rows = [f"<tr><td>{html.escape(k)}</td><td>{_fmt(k, v)}</td></tr>"
                  for k, v in t.items() if k != "segments"]
    segs = ", ".join(f"[{a}, {b})" for a, b in t["segments"])
    train_rows.append(f"<tr><td>segments</td><td>{len(t['segments'])}: {segs}</td></tr>")
    pred = result["plan"].get("predicted_peak_gb")
    if pred is not None:
        train_rows.append(f"<tr><td>predicted_peak_gb</td><td>{_fmt('gb', pred)}</td></tr>")
    stage_rows = [f"<tr><td>{html.escape(k)}</td><td>{v['seconds']:.1f}</td></tr>"
                  for k, v in result["stages"].items()]
    title = f"segback chunking result: {html.escape(result['model'])}"
    parts = [
        "<!DOCTYPE html>", "<html><head><meta charset=\"utf-8\">", f"<title>{title}</title>",
        "<style>body{font-family:sans-serif}table{border-collapse:collapse;margin:1em 0}"
        "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}"
        "td:first-child{text-align:left}</style></head><body>",
        f"<h2>{title}</h2>",
        "<table><tr><th>metric</th><th>baseline</th><th>fine-tuned</th><th>delta</th></tr>",
        *rows, "</table>",
        "<h3>Training</h3><table>", *train_rows, "</table>",
    ]
    if stage_rows:
        parts += ["<h3>Stage wall time (s)</h3><table>", *stage_rows, "</table>"]
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def render_generic_table(result: dict) -> str:
    """A self-contained HTML page of a generic result: held-out loss and perplexity before and
    after fine-tuning, the scorer's scores when there are any, and the training figures."""
    def table(base: dict, tuned: dict, delta: dict, keys: list[str]) -> list[str]:
        rows = ["<table><tr><th>metric</th><th>baseline</th><th>fine-tuned</th>"
                "<th>delta</th></tr>"]
        for k in keys:
            note = " (lower is better)" if k in LOWER_IS_BETTER | set(EVAL_DELTA) else ""
            rows.append(f"<tr><td>{html.escape(k)}{note}</td><td>{_fmt(k, base.get(k))}</td>"
                        f"<td>{_fmt(k, tuned.get(k))}</td>"
                        f"<td>{_fmt(k, delta.get(k), signed=True)}</td></tr>")
        return [*rows, "</table>"]

    base, tuned = result["baseline"], result["finetuned"]
    title = (f"segback result: {html.escape(result['model'])} on "
             f"{html.escape(result['dataset'])}")
    parts = [
        "<!DOCTYPE html>", "<html><head><meta charset=\"utf-8\">", f"<title>{title}</title>",
        "<style>body{font-family:sans-serif}table{border-collapse:collapse;margin:1em 0}"
        "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}"
        "td:first-child{text-align:left}</style></head><body>",
        f"<h2>{title}</h2><h3>Held-out test loss</h3>",
        *table(base, tuned, result["delta"], list(EVAL_FIELDS)),
    ]
    if "scores" in result:
        sc = result["scores"]
        keys = [m for m in METRICS if m in sc["finetuned"]] + \
            [m for m in sc["finetuned"] if m not in METRICS]
        parts += [f"<h3>Scores ({html.escape(result['scorer'])})</h3>",
                  *table(sc["baseline"], sc["finetuned"], sc["delta"], keys)]
    t = result["training"]
    train_rows = [f"<tr><td>{html.escape(k)}</td><td>{_fmt(k, v)}</td></tr>"
                  for k, v in t.items() if k != "segments"]
    segs = ", ".join(f"[{a}, {b})" for a, b in t["segments"])
    train_rows.append(f"<tr><td>segments</td><td>{len(t['segments'])}: {segs}</td></tr>")
    parts += ["<h3>Training</h3><table>", *train_rows, "</table>"]
    stage_rows = [f"<tr><td>{html.escape(k)}</td><td>{v['seconds']:.1f}</td></tr>"
                  for k, v in result["stages"].items()]
    if stage_rows:
        parts += ["<h3>Stage wall time (s)</h3><table>", *stage_rows, "</table>"]
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


# ---- sweeps --------------------------------------------------------------------------------------

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
            row[name] = _number(part)
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
        return _fmt(fmt_key, v, signed=name.startswith("delta"))
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
        "<!DOCTYPE html>", "<html><head><meta charset=\"utf-8\">", f"<title>{title}</title>",
        "<style>body{font-family:sans-serif}table{border-collapse:collapse;margin:1em 0}"
        "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}"
        "td:first-child{text-align:left}</style></head><body>",
        f"<h2>{title}</h2><p>{what} on the held-out test set, peak memory and wall time of "
        "training; the best branch in bold.</p>",
        "<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in headers) + "</tr>",
        *rows, "</table>", "</body></html>",
    ]) + "\n"


def sweep_main(args: argparse.Namespace) -> int:
    try:
        branches = json.loads(args.sweep)
        if not isinstance(branches, list) or not branches:
            raise ResultError("--sweep expects a JSON list of branches")
        sweep = build_sweep(sweep_rows(branches), getattr(args, "task", "chunking"))
        by_length = {p: read_json(p) for p in getattr(args, "by_length", None) or []}
    except (OSError, ValueError) as e:  # ResultError and json.JSONDecodeError are ValueErrors
        print(f"segback summarize --sweep: {e}", file=sys.stderr)
        return 1
    if by_length:  # the arms split by conversation length (`segback compare`)
        sweep["by_length"] = list(by_length)
    if args.table:
        atomic_write_text(args.table, render_sweep_html(sweep))
    if args.markdown:
        from segback.chunking.compare import render_markdown

        atomic_write_text(args.markdown, "\n".join(
            [render_sweep_markdown(sweep), *(render_markdown(c) for c in by_length.values())]))
    atomic_write_json(args.out, sweep)
    print(f"{args.out}: {len(sweep['rows'])} branches", file=sys.stderr)
    return 0


def _pairs(items: list[str], flag: str) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ResultError(f"{flag} expects NAME=PATH, got {item!r}")
        out[key] = value
    return out


SINGLE_REQUIRED = ("model_name", "baseline", "finetuned", "train_summary", "plan")
GENERIC_REQUIRED = ("model_name", "dataset", "baseline_eval", "finetuned_eval", "train_summary",
                    "plan")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # Required unless --sweep (checked in main, so the sweep table needs none of them).
    parser.add_argument("--model-name", help="name of the `models` entry (required)")
    parser.add_argument("--baseline", help="score JSON of the stock model (required)")
    parser.add_argument("--finetuned", help="score JSON with the adapter (required)")
    parser.add_argument("--train-summary", help="adapter/train_summary.json (required)")
    parser.add_argument("--plan", help="plan JSON used for training (required)")
    parser.add_argument("--benchmarks", nargs="*", default=[], metavar="[NAME=]PATH",
                        help="Snakemake benchmark TSV files or a directory of them "
                             "(stage wall times; missing files are skipped)")
    parser.add_argument("--artifact", action="append", default=[], metavar="NAME=PATH",
                        help="record a related file's path in the result (repeatable)")
    parser.add_argument("--stamp", action="append", default=[], metavar="PATH",
                        help="a stage's config stamp (segback stamp); repeatable")
    parser.add_argument("--schema", default=None,
                        help="result JSON Schema (default: segback/experiment/result.schema.json, "
                             "or generic_result.schema.json with --task generic)")
    parser.add_argument("--task", choices=("chunking", "generic"), default="chunking",
                        help="generic: the user's own data; --baseline-eval/--finetuned-eval "
                             "(segback evaluate) are the results, --baseline/--finetuned the "
                             "scores of --scorer when one ran")
    parser.add_argument("--dataset", default=None, help="--task generic: the dataset's name")
    parser.add_argument("--baseline-eval", default=None,
                        help="--task generic: `segback evaluate` JSON of the stock model")
    parser.add_argument("--finetuned-eval", default=None,
                        help="--task generic: `segback evaluate` JSON with the adapter")
    parser.add_argument("--scorer", default=None,
                        help="--task generic: the scorer whose --baseline/--finetuned scores "
                             "to include (e.g. chunking)")
    parser.add_argument("--out", required=True, help="result JSON to write")
    parser.add_argument("--table", default=None, help="also write an HTML score table here")
    parser.add_argument("--sweep", default=None, metavar="JSON",
                        help="instead: gather a sweep's results into one table; a JSON list of "
                             "branches {model, seq, lora_rank, result: result JSON path}")
    parser.add_argument("--markdown", default=None,
                        help="with --sweep: also write the table as Markdown here")
    parser.add_argument("--by-length", action="append", default=[], metavar="PATH",
                        help="with --sweep: a `segback compare` JSON to link and (in the "
                             "Markdown) show beside the table; repeatable")


def main(args: argparse.Namespace) -> int:
    if getattr(args, "sweep", None) is not None:
        return sweep_main(args)
    if getattr(args, "task", "chunking") == "generic":
        return generic_main(args)
    args.schema = args.schema or str(DEFAULT_SCHEMA)
    if _missing(args, SINGLE_REQUIRED, "segback summarize"):
        return 2
    try:
        artifacts = _pairs(args.artifact, "--artifact")
        artifacts.setdefault("plan", args.plan)
        artifacts.setdefault("train_summary", args.train_summary)
        if args.table:
            artifacts.setdefault("score_table", args.table)
        result = build_result(
            args.model_name,
            baseline=read_json(args.baseline),
            finetuned=read_json(args.finetuned),
            train_summary=read_json(args.train_summary),
            plan=read_json(args.plan),
            stages=collect_benchmarks(args.benchmarks),
            artifacts=artifacts,
            sources={"baseline": args.baseline, "finetuned": args.finetuned,
                     "train": args.train_summary, "plan": args.plan},
        )
        result["config"] = check_stamps([read_json(p) for p in args.stamp],
                                        result["training"], args.train_summary)
        validate_result(result, args.schema)
    except (OSError, ValueError) as e:  # ResultError and json.JSONDecodeError are ValueErrors
        print(f"segback summarize: {e}", file=sys.stderr)
        return 1
    if args.table:
        atomic_write_text(args.table, render_table(result))
    atomic_write_json(args.out, result)
    d = result["delta"].get("mean_score")
    print(f"{args.out}: mean_score {result['baseline']['mean_score']} -> "
          f"{result['finetuned']['mean_score']} (delta {d})", file=sys.stderr)
    return 0


def _missing(args: argparse.Namespace, keys: Sequence[str], command: str) -> bool:
    """Print argparse's message for the required flags not given (they depend on the mode)."""
    missing = [f"--{k.replace('_', '-')}" for k in keys if getattr(args, k) is None]
    if missing:
        print(f"{command}: the following arguments are required: {', '.join(missing)}",
              file=sys.stderr)
    return bool(missing)


def generic_main(args: argparse.Namespace) -> int:
    """`segback summarize --task generic`: the result of the user's own data."""
    required = GENERIC_REQUIRED + (("baseline", "finetuned") if args.scorer else ())
    if _missing(args, required, "segback summarize --task generic"):
        return 2
    schema = args.schema or str(GENERIC_SCHEMA)
    try:
        artifacts = _pairs(args.artifact, "--artifact")
        artifacts.setdefault("plan", args.plan)
        artifacts.setdefault("train_summary", args.train_summary)
        if args.table:
            artifacts.setdefault("table", args.table)
        result = build_generic_result(
            args.model_name, args.dataset,
            baseline_eval=read_json(args.baseline_eval),
            finetuned_eval=read_json(args.finetuned_eval),
            train_summary=read_json(args.train_summary),
            plan=read_json(args.plan),
            stages=collect_benchmarks(args.benchmarks),
            artifacts=artifacts,
            sources={"baseline_eval": args.baseline_eval, "finetuned_eval": args.finetuned_eval,
                     "baseline": args.baseline, "finetuned": args.finetuned,
                     "train": args.train_summary, "plan": args.plan},
            scorer=args.scorer,
            baseline_score=read_json(args.baseline) if args.scorer else None,
            finetuned_score=read_json(args.finetuned) if args.scorer else None,
        )
        result["config"] = check_stamps([read_json(p) for p in args.stamp],
                                        result["training"], args.train_summary)
        validate_result(result, schema)
    except (OSError, ValueError) as e:  # ResultError and json.JSONDecodeError are ValueErrors
        print(f"segback summarize: {e}", file=sys.stderr)
        return 1
    if args.table:
        atomic_write_text(args.table, render_generic_table(result))
    atomic_write_json(args.out, result)
    b, f = result["baseline"], result["finetuned"]
    print(f"{args.out}: test loss {b['loss']} -> {f['loss']} (ppl {b['ppl']} -> {f['ppl']})"
          + (f"; {args.scorer} score {result['scores']['baseline']['mean_score']} -> "
             f"{result['scores']['finetuned']['mean_score']}" if args.scorer else ""),
          file=sys.stderr)
    return 0
