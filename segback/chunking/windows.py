"""Cut chunking cases into windows of at most `--window` tokens, each a training example.

This is what a user does when whole examples do not fit in memory: cut each long chat into
short windows and train on those. A window is a run of whole consecutive messages; windows do
not overlap, so the windows of a case hold its text exactly once (the same text the whole-case
training sees, in pieces). A window's gold chunks are the case's chunks that overlap it, each
anchored at its first message inside the window: a window that starts inside a chunk begins
with that chunk under its own label, as the instruction says every answer does ("The first
chunk starts at the first message").

Windows are filled greedily: messages are added while the rendered example (instruction, the
window's transcript, its gold answer) fits in `window` tokens of the model's tokenizer. The
count is estimated from per-message token counts, then settled exactly (one message fewer or
more while needed), so every window fits and the next message would not. A single message
that cannot fit in a window on its own is an error naming it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from mlx_lm.utils import load_tokenizer
from tqdm import tqdm

from segback.chunking.build import length_percentiles
from segback.chunking.filter import read_cases, to_training_row
from segback.chunking.prompt import chat_rows, render_transcript, transcript
from segback.data.tokens import encode_example
from segback.io import atomic_write_json, atomic_write_jsonl


def chunk_spans(case: dict) -> list[tuple[int, int, str]]:
    """(first message, end, label) of each gold chunk, in transcript order."""
    index = {m["id"]: i for i, m in enumerate(transcript(case))}
    starts = sorted((index[c["anchor"]], c["label"]) for c in case["gold"]["chunks"])
    ends = [s for s, _ in starts[1:]] + [len(index)]
    return [(s, e, label) for (s, label), e in zip(starts, ends)]


def window_chunks(case: dict, start: int, stop: int) -> list[dict]:
    """The gold chunks of messages [start, stop): those that overlap it, each anchored at its
    first message inside the window."""
    messages = transcript(case)
    return [{"anchor": messages[max(s, start)]["id"], "label": label}
            for s, e, label in chunk_spans(case) if s < stop and e > start]


def window_case(case: dict, start: int, stop: int, index: int) -> dict:
    """Messages [start, stop) of `case` as a case of its own (id `{case id}-w{index}`)."""
    return {
        "id": f"{case['id']}-w{index:02d}",
        "messages": transcript(case)[start:stop],
        "gold": {"chunks": window_chunks(case, start, stop)},
        "sources": case.get("sources", []),
        "window": {"case": case["id"], "index": index, "messages": [start, stop]},
    }


class _Counter:
    """Exact and estimated token counts of a case's windows."""

    def __init__(self, tokenizer: Any, case: dict) -> None:
        self.tokenizer, self.case = tokenizer, case
        messages = transcript(case)
        self.blocks = [self._tokens(render_transcript([m])) for m in messages]
        self.join = self._tokens("\n\n")
        label_tokens = {label: self._tokens(json.dumps(
            {"anchor": messages[s]["id"], "label": label}, ensure_ascii=False,
            separators=(",", ":"))) for s, _, label in chunk_spans(case)}  # as gold_completion
        self.spans = [(s, e, label_tokens[label]) for s, e, label in chunk_spans(case)]
        one = self.exact(0, 1)[0]  # the fixed part: instruction, template, answer brackets
        self.fixed = one - self.blocks[0] - self.spans[0][2]

    def _tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def estimate(self, start: int, stop: int) -> int:
        answer = sum(t + 1 for s, e, t in self.spans if s < stop and e > start)  # + commas
        return self.fixed + sum(self.blocks[start:stop]) + self.join * (stop - start - 1) + answer

    def exact(self, start: int, stop: int) -> tuple[int, int]:
        """(tokens, prompt tokens) of the window's training example."""
        ids, prompt = encode_example(self.tokenizer,
                                          chat_rows(window_case(self.case, start, stop, 0)))
        return len(ids), prompt


def cut_case(case: dict, tokenizer: Any, window: int) -> list[dict]:
    """The windows of one case as training rows (`segback filter-data`'s row format)."""
    count = _Counter(tokenizer, case)
    n = len(transcript(case))
    rows, start = [], 0
    while start < n:
        stop = start + 1
        while stop < n and count.estimate(start, stop + 1) <= window:
            stop += 1
        tokens, prompt = count.exact(start, stop)
        while tokens > window and stop > start + 1:  # the estimate was short
            stop -= 1
            tokens, prompt = count.exact(start, stop)
        while stop < n and tokens <= window:  # the estimate was long: one more may fit
            more = count.exact(start, stop + 1)
            if more[0] > window:
                break
            stop, (tokens, prompt) = stop + 1, more
        if tokens > window:
            mid = transcript(case)[start]["id"]
            raise ValueError(f"case {case['id']}: message {mid} alone makes a {tokens}-token "
                             f"example, more than the {window}-token window; raise --window or "
                             "cut messages shorter (data.max_message_chars)")
        rows.append(to_training_row(window_case(case, start, stop, len(rows)), tokens, prompt))
        start = stop
    return rows


def cut_cases(cases: list[dict], tokenizer: Any, window: int) -> tuple[list[dict], dict]:
    """(window rows of every case, report).

    The report compares the windows with the whole cases: how many windows a case makes and
    how many tokens each side holds (all tokens, and the answer tokens the loss counts), so a
    run can give both kinds of training the same tokens per step.
    """
    rows, per_case = [], []
    for case in tqdm(cases, desc="cut windows", file=sys.stderr, leave=False):
        windows = cut_case(case, tokenizer, window)
        rows += windows
        per_case.append(len(windows))
    whole = [r["n_tokens"] for r in cases]
    whole_answer = [r["n_tokens"] - r["prompt_tokens"] for r in cases]
    tokens = [r["n_tokens"] for r in rows]
    answer = [r["n_tokens"] - r["prompt_tokens"] for r in rows]
    mean_case = sum(whole) / len(cases) if cases else 0.0
    mean_window = sum(tokens) / len(rows) if rows else 0.0
    report = {
        "window": window,
        "cases": len(cases),
        "windows": len(rows),
        "windows_per_case": length_percentiles(per_case),
        "mean_windows_per_case": round(len(rows) / len(cases), 3) if cases else None,
        "case_tokens": sum(whole),
        "window_tokens": sum(tokens),
        "case_answer_tokens": sum(whole_answer),
        "window_answer_tokens": sum(answer),
        # Windows a step must hold to see as many tokens as a step of one whole case
        "windows_per_case_tokens": round(mean_case / mean_window, 3) if mean_window else None,
        "window_lengths": length_percentiles(tokens),
    }
    return rows, report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model dir (only its tokenizer is read)")
    parser.add_argument("--data", required=True,
                        help="cases JSONL (`segback build-data` or `segback filter-data`)")
    parser.add_argument("--window", type=int, required=True,
                        help="tokens per window (prompt + answer), e.g. 2048")
    parser.add_argument("--out", required=True, help="window rows, JSONL")
    parser.add_argument("--report", required=True, help="counts and tokens of both sides, JSON")


def main(args: argparse.Namespace) -> int:
    if args.window < 1:
        raise SystemExit("segback window-data: --window must be positive")
    cases = read_cases(args.data)
    if any("n_tokens" not in c or "prompt_tokens" not in c for c in cases):
        raise SystemExit(f"segback window-data: {args.data}: rows without n_tokens; cut the "
                         "rows `segback filter-data` writes")
    tokenizer = load_tokenizer(Path(args.model))
    try:
        rows, report = cut_cases(cases, tokenizer, args.window)
    except ValueError as e:
        raise SystemExit(f"segback window-data: {args.data}: {e}") from None
    report.update(model=str(args.model), data=str(args.data))
    atomic_write_jsonl(args.out, rows)
    atomic_write_json(args.report, report)
    print(f"segback window-data: {report['cases']} cases -> {report['windows']} windows of "
          f"<= {args.window} tokens ({report['mean_windows_per_case']} a case; "
          f"{report['case_tokens']} -> {report['window_tokens']} tokens, answers "
          f"{report['case_answer_tokens']} -> {report['window_answer_tokens']})",
          file=sys.stderr)
    return 0
