"""Greedy generation for a test set: batched, stopped early at complete JSON, resumable per case.

Rows may be chunking cases (`build_prompt` renders them, exactly as in training), chats
(`messages`; the assistant turn is generated for the messages before a final assistant message,
which is kept as `reference`), `prompt`/`completion` pairs (the prompt is the user turn) or
`text` rows (continued as raw text, without a chat template, as `text` rows are trained).
Chat prompts are encoded by `segback.data.tokens.encode_chat` with the generation prompt.

Cases are decoded together with mlx-lm's `BatchGenerator` (continuous batching: a finished case
frees its slot for the next one, so each step reads the weights once for the whole batch).
Greedy decoding is per-sequence exact: left padding is masked and positions are per sequence,
so a case decodes to the same tokens alone or in a batch (up to float rounding of near-ties).
A sequence stops at an end-of-turn token, at `--max-tokens`, or (`--stop-at-json`, the default
for chunking cases) once its text holds a complete top-level JSON object. The scorer reads
the first such object with a "chunks" key, so what follows one rarely changes a score; it
only changes when a later object would have been preferred (a fenced one, or the first
object lacked "chunks"), and the stop applies alike to baseline and fine-tuned models.

Each finished case is appended to `<out>.partial.jsonl` (flushed and fsynced), so a restarted
run skips the cases already there; the final `--out` is written atomically, in data order, and
the partial file is removed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.sample_utils import make_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper
from tqdm import tqdm

from segback.chunking.extract import extract_json, reject_constant
from segback.chunking.prompt import build_prompt, gold_completion
from segback.data.tokens import encode_chat, with_bos
from segback.io import atomic_write_jsonl, atomic_write_text, read_jsonl
from segback.models.load import load  # mlx-lm's loader, float32 on CPU (bf16 is ~35x slower)

# End-of-turn markers of common chat formats; those in the vocabulary also stop generation.
END_OF_TURN = ("<end_of_turn>", "<eos>", "<|im_end|>", "<|eot_id|>", "<|end|>",
               "<|endoftext|>", "</s>")
DEFAULT_BATCH_SIZE = 16  # decode throughput of Gemma-3 270M on 2 CPU cores levels off here


def stop_ids(tokenizer: Any) -> set[int]:
    """EOS ids of the wrapper plus the end-of-turn tokens present in the vocabulary."""
    ids = set(getattr(tokenizer, "eos_token_ids", None) or [])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    ids.update(vocab[t] for t in END_OF_TURN if t in vocab)
    return ids


class JsonWatch:
    """Sees streamed text; true once it holds a complete top-level JSON object.

    Braces count only inside an object and outside its strings, so each character is looked at
    once; a balanced span is parsed (as strictly as `extract.extract_json`) only when its
    closing brace arrives. A span that is not JSON (`{see below}`) is dropped and watching goes on.
    A stop therefore always follows a parsed object; the one miss is a `{` opening a span that
    never balances (a lone quote in it), after which the sequence runs to its cap as without
    the watch.
    """

    def __init__(self) -> None:
        self.span: list[str] = []
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.done = False

    def feed(self, text: str) -> bool:
        for ch in text:
            if self.done:
                break
            if self.depth == 0:
                if ch == "{":
                    self.span, self.depth = ["{"], 1
                continue
            self.span.append(ch)
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch == "{":
                self.depth += 1
            elif ch == "}":
                self.depth -= 1
                if self.depth == 0:
                    self.done = _is_json("".join(self.span))
        return self.done


def _is_json(text: str) -> bool:
    try:
        json.loads(text, parse_constant=reject_constant)
    except (ValueError, RecursionError):
        return False
    return True


@dataclass
class Request:
    """One row to generate for: its prompt ids and what its output row keeps."""

    key: str  # str(id): the resume key
    id: Any
    prompt: list[int]
    kind: str  # "chunking" | "chat" | "prompt" | "text"
    reference: str | None = None


def is_chunking_case(row: dict) -> bool:
    """A chunking case has gold chunks and a transcript whose messages carry ids."""
    if "gold" not in row:
        return False
    if "transcript" in row:
        return True
    msgs = row.get("messages")
    return isinstance(msgs, list) and bool(msgs) and all(
        isinstance(m, dict) and "id" in m for m in msgs)


def row_request(tokenizer: Any, row: Any, index: int) -> Request:
    """The prompt of a data row (any of the formats in the module docstring)."""
    if not isinstance(row, dict):
        raise ValueError(f"row {index + 1}: not a JSON object")
    rid = row.get("id", index)
    reference = None
    if is_chunking_case(row):
        kind, messages = "chunking", [{"role": "user", "content": build_prompt(row)}]
        reference = gold_completion(row) if isinstance(row["gold"], dict) else None
    elif "messages" in row:
        kind, messages = "chat", list(row["messages"])
        if messages and messages[-1].get("role") == "assistant":
            reference = messages.pop()["content"]
    elif "prompt" in row:
        kind, messages = "prompt", [{"role": "user", "content": row["prompt"]}]
        reference = row.get("completion")
    elif "text" in row:
        ids = with_bos(tokenizer, list(tokenizer.encode(row["text"])))
        return Request(str(rid), rid, ids, "text")
    else:
        raise ValueError(f"row {index + 1}: unknown format (keys: {sorted(row)}); expected a "
                         "chunking case, 'messages', 'prompt' (+ 'completion') or 'text'")
    if not messages:
        raise ValueError(f"row {index + 1}: no messages before the answer")
    ids = encode_chat(tokenizer, messages, add_generation_prompt=True)
    return Request(str(rid), rid, ids, kind, reference)


@dataclass
class _Decoding:
    """A sequence in flight: its detokenizer, JSON watch and counters."""

    request: Request
    detokenizer: Any
    watch: JsonWatch | None
    n_tokens: int = 0
    start: float = field(default_factory=time.perf_counter)


def _finish(d: _Decoding, reason: str) -> dict:
    d.detokenizer.finalize()
    text = d.detokenizer.text
    req = d.request
    row = {"id": req.id, "text": text}
    if req.kind == "chunking":
        row["parsed"] = extract_json(text)[0]
    if req.reference is not None:
        row["reference"] = req.reference
    row.update(prompt_tokens=len(req.prompt), generated_tokens=d.n_tokens,
               finish_reason=reason, seconds=round(time.perf_counter() - d.start, 3))
    return row


def generate_rows(model: Any, tokenizer: Any, requests: list[Request], max_tokens: int,
                  batch_size: int = DEFAULT_BATCH_SIZE, prefill_step_size: int = 2048,
                  stop_at_json: bool | None = None,
                  progress: Callable[[int], None] | None = None) -> Iterator[dict]:
    """Greedy outputs of `requests`, yielded as each finishes (not in request order).

    Longest prompts go first, so neighbours in a batch have similar lengths (little padding)
    and an out-of-memory shows at once. Prompts are prefilled in chunks of `prefill_step_size`
    tokens, several together only when the longest fits that many times in one chunk, so a
    prefill pass never holds more activations than one `prefill_step_size` forward pass.
    `stop_at_json=None` stops at complete JSON for chunking cases only. `progress` gets the
    number of tokens each decoding step produced.
    """
    if not requests:
        return
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    order = sorted(requests, key=lambda r: -len(r.prompt))
    longest = min(len(order[0].prompt), prefill_step_size)
    gen = BatchGenerator(
        model, max_tokens=max_tokens, stop_tokens=[[t] for t in sorted(stop_ids(tokenizer))],
        sampler=make_sampler(temp=0.0), completion_batch_size=batch_size,
        prefill_batch_size=max(1, min(batch_size, prefill_step_size // max(longest, 1))),
        prefill_step_size=prefill_step_size)
    uids = gen.insert([r.prompt for r in order], [max_tokens] * len(order))
    waiting = dict(zip(uids, order))
    active: dict[int, _Decoding] = {}

    def start(uid: int) -> _Decoding:
        req = waiting.pop(uid)
        json_stop = req.kind == "chunking" if stop_at_json is None else stop_at_json
        active[uid] = _Decoding(req, tokenizer.detokenizer, JsonWatch() if json_stop else None)
        return active[uid]

    try:
        while True:
            prompt_responses, responses = gen.next()
            if not prompt_responses and not responses:
                break
            for p in prompt_responses:
                if p.uid in waiting:  # its prefill starts: its clock too
                    start(p.uid)
            if progress is not None and responses:
                progress(len(responses))
            for r in responses:
                d = active.get(r.uid) or start(r.uid)
                d.n_tokens += 1
                if r.finish_reason == "stop":  # an end-of-turn token: not part of the text
                    yield _finish(active.pop(r.uid), "stop")
                    continue
                d.detokenizer.add_token(r.token)
                if d.watch is not None and d.watch.feed(d.detokenizer.last_segment):
                    if r.finish_reason is None:
                        gen.remove([r.uid])
                    yield _finish(active.pop(r.uid), "json")
                elif r.finish_reason is not None:
                    yield _finish(active.pop(r.uid), r.finish_reason)
    finally:
        gen.close()


def partial_path(out: str | Path) -> Path:
    return Path(f"{out}.partial.jsonl")


def read_partial(path: Path, header: dict) -> dict[str, dict]:
    """Finished rows of an interrupted run with the same settings, by str(id).

    A torn last line (a crash mid-write) is dropped; a file written with other settings is
    ignored entirely, since its rows would not be what this run produces.
    """
    if not path.is_file():
        return {}
    rows: dict[str, dict] = {}
    with open(path, encoding="utf-8") as f:
        lines = [line for line in f if line.strip()]
    try:
        first = json.loads(lines[0]) if lines else None
    except json.JSONDecodeError:
        first = None
    if first != header:
        print(f"segback generate: ignoring {path} (written with other settings)",
              file=sys.stderr)
        return {}
    for line in lines[1:]:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and "id" in row:
            rows[str(row["id"])] = row
    return rows


class PartialWriter:
    """Appends finished rows durably: a kill loses at most the cases still in flight."""

    def __init__(self, path: Path, header: dict, rows: list[dict]) -> None:
        # Rewritten whole first, so a torn line from the last run cannot glue onto a new row.
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in [header, *rows]))
        self.f = open(path, "a", encoding="utf-8")

    def write(self, row: dict) -> None:
        self.f.write(json.dumps(row) + "\n")
        self.f.flush()
        os.fsync(self.f.fileno())

    def close(self) -> None:
        self.f.close()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="MLX model dir for mlx_lm.load")
    parser.add_argument("--adapter", default=None, help="LoRA adapter dir (mlx-lm layout)")
    parser.add_argument("--data", required=True,
                        help="JSONL of chunking cases (raw or filtered), chats ('messages'), "
                             "'prompt'/'completion' or 'text' rows")
    parser.add_argument("--out", required=True, help="predictions JSONL")
    parser.add_argument("--max-tokens", type=int, default=1024, help="max generated tokens")
    parser.add_argument("--limit", type=int, default=None, help="only the first K rows")
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE,
                        help="sequences decoded together")
    parser.add_argument("--prefill-step-size", type=int, default=2048,
                        help="prompt tokens per prefill forward pass (bounds its memory)")
    parser.add_argument("--stop-at-json", action=argparse.BooleanOptionalAction, default=None,
                        help="stop a sequence once its text holds a complete JSON object "
                             "(default: on for chunking cases, off for other rows)")


def settings(args: argparse.Namespace) -> dict:
    """What decides the outputs; a partial file is resumed only under the same settings."""
    return {"partial": {"model": os.path.abspath(args.model),
                        "adapter": args.adapter and os.path.abspath(args.adapter),
                        "max_tokens": args.max_tokens, "stop_at_json": args.stop_at_json}}


def main(args: argparse.Namespace) -> int:
    if not Path(args.data).is_file():
        raise SystemExit(f"segback generate: data file not found: {args.data}")
    if args.batch_size < 1 or args.prefill_step_size < 1 or args.max_tokens < 1:
        raise SystemExit("segback generate: --batch-size, --prefill-step-size and --max-tokens "
                         "must be positive")
    rows = read_jsonl(args.data)[: args.limit]
    if not rows:
        raise SystemExit(f"segback generate: no rows in {args.data}")
    model, tokenizer = load(args.model, adapter_path=args.adapter)
    if tokenizer is None:
        raise SystemExit(f"segback generate: {args.model} has no tokenizer")
    try:
        requests = [row_request(tokenizer, row, i) for i, row in enumerate(rows)]
    except ValueError as e:
        raise SystemExit(f"segback generate: {args.data}: {e}") from e
    keys = [r.key for r in requests]
    if len(set(keys)) < len(keys):
        raise SystemExit(f"segback generate: {args.data}: duplicate ids (resuming and scoring "
                         "need one row per id)")

    partial = partial_path(args.out)
    header = settings(args)
    done = {k: v for k, v in read_partial(partial, header).items() if k in set(keys)}
    todo = [r for r in requests if r.key not in done]
    if done:
        print(f"segback generate: resuming, {len(done)} of {len(requests)} rows already in "
              f"{partial}", file=sys.stderr)
    writer = PartialWriter(partial, header, list(done.values()))
    bar = tqdm(total=len(todo), desc="generate", unit="case", file=sys.stderr)
    tic, n_tokens = time.perf_counter(), 0

    def progress(n: int) -> None:
        nonlocal n_tokens
        n_tokens += n
        bar.set_postfix(tok_s=f"{n_tokens / (time.perf_counter() - tic):.1f}", refresh=False)
        bar.update(0)  # redraws at most every `mininterval`

    try:
        for row in generate_rows(model, tokenizer, todo, args.max_tokens, args.batch_size,
                                 args.prefill_step_size, args.stop_at_json, progress):
            writer.write(row)
            done[str(row["id"])] = row
            bar.update(1)
    finally:
        bar.close()
        writer.close()

    out_rows = [done[k] for k in keys]
    atomic_write_jsonl(args.out, out_rows)
    partial.unlink()
    reasons: dict[str, int] = {}
    for r in out_rows:
        reasons[r["finish_reason"]] = reasons.get(r["finish_reason"], 0) + 1
    n_json = sum(r.get("parsed") is not None for r in out_rows)
    print(f"segback generate: {len(out_rows)} rows ({len(todo)} generated, "
          f"{n_tokens / max(time.perf_counter() - tic, 1e-9):.1f} tok/s), {n_json} parsed as "
          f"JSON, finished by {reasons}, peak memory {mx.get_peak_memory() / 1e9:.2f} GB "
          f"-> {args.out}", file=sys.stderr)
    return 0
