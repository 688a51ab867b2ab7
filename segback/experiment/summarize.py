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

The results themselves are `chunk_result` and `generic_result`, the sweep table `sweep_summary`;
this module reads the flags and files and writes the outputs, alike for both tasks.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from segback.chunking.compare import render_markdown
from segback.experiment import chunk_result, generic_result
from segback.experiment.result_parts import (
    ResultError, check_stamps, collect_benchmarks, validate_result,
)
from segback.experiment.sweep_summary import (
    build_sweep, render_sweep_html, render_sweep_markdown, sweep_rows,
)
from segback.io import atomic_write_json, atomic_write_text, read_json


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



def _chunk_result(args: argparse.Namespace, stages: dict, artifacts: dict) -> dict:
    return chunk_result.build_result(
        args.model_name,
        baseline=read_json(args.baseline),
        finetuned=read_json(args.finetuned),
        train_summary=read_json(args.train_summary),
        plan=read_json(args.plan),
        stages=stages,
        artifacts=artifacts,
        sources={"baseline": args.baseline, "finetuned": args.finetuned,
                 "train": args.train_summary, "plan": args.plan},
    )


def _generic_result(args: argparse.Namespace, stages: dict, artifacts: dict) -> dict:
    return generic_result.build_generic_result(
        args.model_name, args.dataset,
        baseline_eval=read_json(args.baseline_eval),
        finetuned_eval=read_json(args.finetuned_eval),
        train_summary=read_json(args.train_summary),
        plan=read_json(args.plan),
        stages=stages,
        artifacts=artifacts,
        sources={"baseline_eval": args.baseline_eval, "finetuned_eval": args.finetuned_eval,
                 "baseline": args.baseline, "finetuned": args.finetuned,
                 "train": args.train_summary, "plan": args.plan},
        scorer=args.scorer,
        baseline_score=read_json(args.baseline) if args.scorer else None,
        finetuned_score=read_json(args.finetuned) if args.scorer else None,
    )


@dataclass(frozen=True)
class Task:
    """What differs between the tasks' results; `main` does the rest alike."""

    command: str
    schema: Path
    table_artifact: str  # the HTML table's name among the result's artifacts
    build: Callable[[argparse.Namespace, dict, dict], dict]
    render: Callable[[dict], str]
    summary_line: Callable[[dict], str]


TASKS = {
    "chunking": Task("segback summarize", chunk_result.SCHEMA, "score_table", _chunk_result,
                     chunk_result.render_table, chunk_result.summary_line),
    "generic": Task("segback summarize --task generic", generic_result.SCHEMA, "table",
                    _generic_result, generic_result.render_generic_table,
                    generic_result.summary_line),
}


def required(args: argparse.Namespace) -> tuple[str, ...]:
    """The flags this mode needs (argparse cannot say: they depend on --task and --scorer)."""
    if getattr(args, "task", "chunking") != "generic":
        return SINGLE_REQUIRED
    return GENERIC_REQUIRED + (("baseline", "finetuned") if args.scorer else ())


def main(args: argparse.Namespace) -> int:
    if getattr(args, "sweep", None) is not None:
        return sweep_main(args)
    task = TASKS[getattr(args, "task", "chunking")]
    if _missing(args, required(args), task.command):
        return 2
    schema = args.schema or str(task.schema)
    try:
        artifacts = _pairs(args.artifact, "--artifact")
        artifacts.setdefault("plan", args.plan)
        artifacts.setdefault("train_summary", args.train_summary)
        if args.table:
            artifacts.setdefault(task.table_artifact, args.table)
        result = task.build(args, collect_benchmarks(args.benchmarks), artifacts)
        result["config"] = check_stamps([read_json(p) for p in args.stamp],
                                        result["training"], args.train_summary)
        validate_result(result, schema)
    except (OSError, ValueError) as e:  # ResultError and json.JSONDecodeError are ValueErrors
        print(f"segback summarize: {e}", file=sys.stderr)
        return 1
    if args.table:
        atomic_write_text(args.table, task.render(result))
    atomic_write_json(args.out, result)
    print(f"{args.out}: {task.summary_line(result)}", file=sys.stderr)
    return 0


def _missing(args: argparse.Namespace, keys: Sequence[str], command: str) -> bool:
    """Print argparse's message for the required flags not given (they depend on the mode)."""
    missing = [f"--{k.replace('_', '-')}" for k in keys if getattr(args, k) is None]
    if missing:
        print(f"{command}: the following arguments are required: {', '.join(missing)}",
              file=sys.stderr)
    return bool(missing)
