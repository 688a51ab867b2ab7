"""Keep the cases whose full training example fits in `--max-tokens` of the model's tokenizer
(and, with `--min-tokens`, is at least that long: the long-conversation variant keeps only
conversations that need long context).

Kept rows are ready for mlx-lm-style chat training: `messages` is [user prompt, assistant gold
JSON] (`prompt.chat_rows`), so the case's own chat moves to `transcript`. Each row also gets
`n_tokens` (prompt + completion, as `segback.data.tokens.encode_example` renders it) and
`prompt_tokens`. Only the tokenizer is loaded, never the weights.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from mlx_lm.utils import load_tokenizer
from tqdm import tqdm

from segback.chunking.build import length_percentiles
from segback.chunking.prompt import chat_rows, transcript
from segback.data.tokens import encode_example
from segback.io import atomic_write_json, atomic_write_jsonl, read_jsonl


def to_training_row(case: dict, n_tokens: int, prompt_tokens: int) -> dict:
    """The case with its chat under `transcript` and the trainable pair under `messages`."""
    row = {k: v for k, v in case.items() if k not in ("messages", "transcript", "n_tokens",
                                                       "prompt_tokens")}
    row["transcript"] = transcript(case)
    row["messages"] = chat_rows(case)
    row["n_tokens"] = n_tokens
    row["prompt_tokens"] = prompt_tokens
    return row


def filter_cases(cases: list[dict], tokenizer: Any, max_tokens: int, min_tokens: int = 0
                 ) -> tuple[list[dict], dict]:
    """(kept training rows, report) for cases of `min_tokens` to `max_tokens` tokens."""
    kept, all_lengths = [], []
    for case in tqdm(cases, desc="count tokens", file=sys.stderr, leave=False):
        ids, prompt_len = encode_example(tokenizer, chat_rows(case))
        all_lengths.append(len(ids))
        if min_tokens <= len(ids) <= max_tokens:
            kept.append(to_training_row(case, len(ids), prompt_len))
    report = {
        "max_tokens": max_tokens,
        "total": len(cases),
        "kept": len(kept),
        "dropped": len(cases) - len(kept),
        "kept_tokens": length_percentiles([r["n_tokens"] for r in kept]),
        "all_tokens": length_percentiles(all_lengths),
    }
    if min_tokens:
        report["min_tokens"] = min_tokens
        report["too_short"] = sum(n < min_tokens for n in all_lengths)
    return kept, report


CASE_FIELDS = ("id", "gold")  # generate and score key their rows by id, score reads the gold


def read_cases(path: str | Path) -> list[dict]:
    """The data file's rows, with a clear error when it is missing or empty."""
    path = Path(path)
    if not path.is_file():
        raise SystemExit(f"segback filter-data: data file not found: {path}")
    cases = read_jsonl(path)
    if not cases:
        raise SystemExit(f"segback filter-data: data file is empty: {path}")
    for line, case in enumerate(cases, 1):
        missing = [k for k in CASE_FIELDS if k not in case] if isinstance(case, dict) \
            else list(CASE_FIELDS)
        if missing:
            raise SystemExit(f"segback filter-data: {path}:{line}: the case has no "
                              f"{', '.join(missing)}; every chunking case needs "
                              f"{', '.join(CASE_FIELDS)} (rebuild it with segback build-data)")
    return cases


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model dir (only its tokenizer is read)")
    parser.add_argument("--data", required=True, help="cases JSONL from `segback build-data`")
    parser.add_argument("--max-tokens", type=int, required=True,
                        help="keep cases whose prompt + completion fit in this many tokens")
    parser.add_argument("--min-tokens", type=int, default=0,
                        help="and drop those shorter than this many tokens")
    parser.add_argument("--out", required=True, help="kept rows, JSONL")
    parser.add_argument("--report", required=True, help="counts and length percentiles, JSON")


def main(args: argparse.Namespace) -> int:
    cases = read_cases(args.data)
    tokenizer = load_tokenizer(Path(args.model))
    kept, report = filter_cases(cases, tokenizer, args.max_tokens,
                                getattr(args, "min_tokens", 0))
    report.update(model=str(args.model), data=str(args.data))
    atomic_write_jsonl(args.out, kept)
    atomic_write_json(args.report, report)
    t = report["all_tokens"]
    span = f"{report['min_tokens']}-{args.max_tokens}" if report.get("min_tokens") else \
        f"<= {args.max_tokens}"
    print(f"segback filter-data: kept {report['kept']}/{report['total']} cases of "
          f"{span} tokens (all: p50 {t['p50']}, p90 {t['p90']}, max {t['max']})",
          file=sys.stderr)
    if not kept:
        print("segback filter-data: no case fits; raise --max-tokens (or lower --min-tokens)",
              file=sys.stderr)
        return 1
    return 0
