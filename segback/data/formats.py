"""Rows in mlx-lm's formats, as (ids, offset) examples: `encode_row`, `encode_rows`, `fit`.

Rows are chat (`messages`, optional `tools`), completions (`prompt`/`completion`) or text
(`text`), field names configurable (`DataFormat`). Each becomes (ids, offset) exactly as mlx-lm's
ChatDataset / CompletionsDataset / TextDataset `.process()` makes it, up to the `<bos>` rule in
`segback.data.tokens`; only tokens from `offset` on count in the loss. Differences, each for a
reason:
- rows mlx-lm would train on silently wrong (`"content": null`, `"prompt": null` -> "None") or
  crash on are refused with a DataError naming file:line and what to do;
- `mask_prompt` is on by default (mlx-lm: off); with it on, text rows still count whole (mlx-lm
  refuses a text dataset) and a chat must end with the assistant's reply;
- examples are truncated to `max_len` when loaded (mlx-lm: when batched), and those left with no
  token to train on are dropped.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from segback.data.dataset import DataError, TokenDataset, one_line
from segback.data.tokens import encode_example, encode_text


@dataclass(frozen=True)
class DataFormat:
    """How rows become examples: mlx-lm's `mask_prompt` and `*_feature` config keys.

    `mask_prompt` defaults to on (segback's default; mlx-lm's is off).
    """

    mask_prompt: bool = True
    prompt_feature: str = "prompt"
    completion_feature: str = "completion"
    chat_feature: str = "messages"
    text_feature: str = "text"

    @classmethod
    def from_config(cls, config: Any, base: DataFormat | None = None) -> DataFormat:
        """From an mlx-lm style config (a dict or an object); absent or None keys keep `base`'s."""
        base = base or cls()
        get = config.get if isinstance(config, dict) else lambda k: getattr(config, k, None)
        values = {f.name: get(f.name) for f in fields(cls)}
        return cls(**{k: getattr(base, k) if v is None else v for k, v in values.items()})


@dataclass
class RawSplit:
    """Rows of one split before tokenizing, and where they came from (for error messages)."""

    rows: Sequence[dict]
    name: str  # a file path, or "dataset[split]"
    fmt: DataFormat = field(default_factory=DataFormat)
    lines: Sequence[int] | None = None  # JSONL line numbers; None: rows are counted
    kind: str | None = None  # every row's format (Arrow has fixed columns); None: per row

    def where(self, i: int) -> str:
        return f"{self.name}:{self.lines[i]}" if self.lines else f"{self.name} row {i + 1}"


def row_format(row: Any, fmt: DataFormat) -> str | None:
    """'completions', 'chat' or 'text' by the keys present, in mlx-lm's order (create_dataset)."""
    if not isinstance(row, dict):
        return None
    if fmt.prompt_feature in row and fmt.completion_feature in row:
        return "completions"
    if fmt.chat_feature in row:
        return "chat"
    if fmt.text_feature in row:
        return "text"
    return None


def unknown_format(row: Any, fmt: DataFormat, where: str) -> DataError:
    keys = sorted(row) if isinstance(row, dict) else f"a JSON {type(row).__name__}, not an object"
    return DataError(
        f"{where}: unknown format (keys: {keys}); a row needs {fmt.chat_feature!r} (chat), "
        f"{fmt.prompt_feature!r} and {fmt.completion_feature!r} (completions) or "
        f"{fmt.text_feature!r} (text), as in mlx-lm: rename the fields, or name yours with "
        "chat_feature / prompt_feature / completion_feature / text_feature.")


def _string(row: dict, key: str, where: str) -> str:
    value = row[key]
    if isinstance(value, str):
        return value
    if value is None:
        raise DataError(f"{where}: {key!r} is null (mlx-lm would train on the text 'None'): "
                        "fill it in or drop the row.")
    raise DataError(f"{where}: {key!r} is a {type(value).__name__}, not a string: write it as a "
                    "string.")


def _messages(row: dict, key: str, where: str) -> list[dict]:
    """The chat as written, checked: roles are strings, content is present but on tool calls."""
    messages = row[key]
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: {key!r} must be a non-empty list of messages "
                        f"({{'role': ..., 'content': ...}}), not {json.dumps(messages)[:80]}.")
    for k, m in enumerate(messages, 1):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise DataError(f"{where}: message {k} has no 'role' string: each message is "
                            "{'role': ..., 'content': ...}.")
        content = m.get("content")
        if isinstance(content, (str, list)):
            continue
        if content is None and m["role"] == "assistant" and m.get("tool_calls"):
            continue  # an assistant tool-call turn: content null or absent, as OpenAI writes it
        if content is None:
            raise DataError(f"{where}: message {k} ({m['role']}) has no content ('content' is "
                            "null or missing); only an assistant turn with 'tool_calls' may "
                            "leave it out: fill it in or drop the row.")
        raise DataError(f"{where}: message {k} has content of type {type(content).__name__}: "
                        "it must be a string (or a list of content parts).")
    return messages


def encode_row(tokenizer: Any, row: Any, fmt: DataFormat, where: str = "row",
               kind: str | None = None) -> tuple[list[int], int]:
    """(ids, offset) for one row, before truncation: mlx-lm's `.process(row)`, checked."""
    kind = kind or row_format(row, fmt)
    if kind is None:
        raise unknown_format(row, fmt, where)
    if kind == "text":
        return encode_text(tokenizer, _string(row, fmt.text_feature, where)), 0
    if kind == "completions":
        messages = [{"role": "user", "content": _string(row, fmt.prompt_feature, where)},
                    {"role": "assistant", "content": _string(row, fmt.completion_feature, where)}]
    else:
        messages = _messages(row, fmt.chat_feature, where)
        if fmt.mask_prompt and messages[-1]["role"] != "assistant":
            raise DataError(f"{where}: with mask_prompt on, a training example must end with an "
                            f"assistant message (the completion), not {messages[-1]['role']!r}: "
                            "end the chat with the reply, or turn mask_prompt off.")
    tools = row.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise DataError(f"{where}: 'tools' must be a list of tool schemas, not a "
                        f"{type(tools).__name__}.")
    try:
        return encode_example(tokenizer, messages, tools=tools, mask_prompt=fmt.mask_prompt)
    except Exception as e:  # the chat template refused the row (roles out of order, ...)
        raise DataError(f"{where}: the chat template failed on this row ({one_line(e)}): "
                        "fix the row or the template.") from e


def tokenize_split(tokenizer: Any, split: RawSplit) -> list[tuple[list[int], int]]:
    """(ids, offset) for every row of a split, untruncated."""
    return [encode_row(tokenizer, row, split.fmt, split.where(i), split.kind)
            for i, row in enumerate(split.rows)]


def fit(examples: list[tuple[list[int], int]], max_len: int, name: str = "data") -> TokenDataset:
    """Truncate to `max_len` tokens and drop examples left with no loss token."""
    if max_len < 2:
        raise ValueError("max_len must be at least 2 tokens")
    kept, dropped, truncated = [], 0, 0
    for ids, offset in examples:
        cut = len(ids) > max_len
        ids = ids[:max_len]
        if len(ids) < 2 or offset > len(ids) - 1:
            dropped += 1
            continue
        truncated += cut
        kept.append((ids, offset))
    if not kept:
        raise DataError(f"{name}: none of {len(examples)} examples has a token to train on within "
                        f"max_len={max_len} tokens (their prompts fill it): raise the sequence "
                        "length limit (segback train --seq; mlx-lm's max_seq_length) or shorten "
                        "the prompts.")
    if dropped:
        print(f"segback: {name}: dropped {dropped} of {len(examples)} examples whose prompt fills "
              f"all {max_len} tokens", file=sys.stderr)
    if truncated:
        print(f"segback: {name}: truncated {truncated} examples to {max_len} tokens "
              "(their completions are cut short)", file=sys.stderr)
    return TokenDataset(kept, name=name, dropped=dropped, truncated=truncated)


def encode_rows(tokenizer: Any, rows: Sequence[dict], max_len: int, name: str = "data",
                fmt: DataFormat | None = None) -> TokenDataset:
    """Tokenize in-memory rows (any mix of formats), truncate to `max_len`, drop the empty."""
    split = RawSplit(rows, name, fmt or DataFormat())
    return fit(tokenize_split(tokenizer, split), max_len, name)
