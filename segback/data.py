"""Training data: mlx-lm's JSONL formats, prompt masking, and a resumable batch order.

Rows are tokenized once (`segback.tokens.encode_example`, the one place prompts are rendered) into
(ids, offset) pairs: only tokens from `offset` on count in the loss (mlx-lm's `--mask-prompt`).

Batch order differs from `mlx_lm.tuner.trainer.iterate_batches` in one way: it is a pure function
of (seed, index), so resuming at step k needs no RNG state. Like mlx-lm, examples are sorted by
length into fixed batches (less padding) and each epoch visits those batches in a permutation drawn
from `numpy.random.default_rng([seed, epoch])`.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Iterator, Sequence

import mlx.core as mx
import numpy as np

from segback.tokens import _with_bos, encode_example

FORMATS = (
    '{"messages": [{"role": ..., "content": ...}, ...]} (chat; the last message is the completion)',
    '{"prompt": ..., "completion": ...}',
    '{"text": ...} (every token counts)',
)
PAD_TO = 32  # batch widths are 1 + a multiple of this, as in mlx-lm


class DataError(ValueError):
    """A data file is missing, empty or holds rows of an unknown format."""


@dataclass
class TokenDataset:
    """Tokenized examples: `examples[i] = (ids, offset)`; loss counts ids[offset:]."""

    examples: list[tuple[list[int], int]]
    name: str = "data"
    dropped: int = 0  # examples with no loss token left after truncation
    truncated: int = 0  # kept examples cut to max_len
    _order: list[list[int]] | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> tuple[list[int], int]:
        return self.examples[i]

    @property
    def loss_tokens(self) -> int:
        return sum(len(ids) - max(off, 1) for ids, off in self.examples)


class ByteTokenizer:
    """UTF-8 bytes as token ids, EOS = 0: lets random-geometry models (vocab >= 256) train.

    Only for smoke runs and benchmarks on `segback.models.geometry` models, which ship no tokenizer.
    """

    eos_token_id = 0
    bos_token_id = None
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 < int(i) < 256).decode("utf-8", errors="replace")


def row_messages(row: Any, where: str = "row") -> list[dict] | None:
    """The chat messages of a row, or None for a `text` row; DataError for anything else."""
    if isinstance(row, dict):
        if "messages" in row:
            msgs = row["messages"]
            if not isinstance(msgs, list) or not msgs:
                raise DataError(f"{where}: 'messages' must be a non-empty list")
            return [{"role": m["role"], "content": m["content"]} for m in msgs]
        if "prompt" in row and "completion" in row:
            return [{"role": "user", "content": row["prompt"]},
                    {"role": "assistant", "content": row["completion"]}]
        if "text" in row:
            return None
    keys = sorted(row) if isinstance(row, dict) else type(row).__name__
    raise DataError(f"{where}: unknown format (keys: {keys}); expected one of:\n  "
                    + "\n  ".join(FORMATS))


def encode_row(tokenizer: Any, row: dict, where: str = "row") -> tuple[list[int], int]:
    """(ids, offset) for one JSONL row, before truncation."""
    messages = row_messages(row, where)
    if messages is None:
        ids = list(tokenizer.encode(row["text"]))
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is not None and (not ids or ids[-1] != eos):
            ids.append(eos)
        return _with_bos(tokenizer, ids), 0
    try:
        return encode_example(tokenizer, messages)
    except ValueError as e:
        raise DataError(f"{where}: {e}") from e


def encode_rows(tokenizer: Any, rows: Sequence[dict], max_len: int, name: str = "data"
                ) -> TokenDataset:
    """Tokenize, truncate to `max_len` tokens, and drop examples left with no loss token."""
    if max_len < 2:
        raise ValueError("max_len must be at least 2 tokens")
    examples, dropped, truncated = [], 0, 0
    for i, row in enumerate(rows):
        ids, offset = encode_row(tokenizer, row, f"{name} row {i + 1}")
        cut = len(ids) > max_len
        ids = ids[:max_len]
        if len(ids) < 2 or offset > len(ids) - 1:
            dropped += 1
            continue
        truncated += cut
        examples.append((ids, offset))
    if not examples:
        raise DataError(f"{name}: none of {len(rows)} examples has a completion token within "
                        f"{max_len} tokens (raise --seq or shorten the prompts)")
    if dropped:
        print(f"segback: {name}: dropped {dropped} of {len(rows)} examples whose prompt fills "
              f"all {max_len} tokens", file=sys.stderr)
    if truncated:
        print(f"segback: {name}: truncated {truncated} examples to {max_len} tokens "
              "(their completions are cut short)", file=sys.stderr)
    return TokenDataset(examples, name=name, dropped=dropped, truncated=truncated)


def read_rows(path: Path) -> list[dict]:
    """JSONL rows with errors that name the file and line."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: not valid JSON ({e.msg})") from e
    if not rows:
        raise DataError(f"{path} is empty")
    return rows


def load_dataset(data_dir: str | Path, tokenizer: Any, max_len: int, splits=("train", "valid")
                 ) -> dict[str, TokenDataset | None]:
    """Tokenized {split: dataset} from DIR/{split}.jsonl; `train` is required, others optional."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise DataError(f"data directory not found: {data_dir}")
    out: dict[str, TokenDataset | None] = {}
    for split in splits:
        path = data_dir / f"{split}.jsonl"
        if not path.exists():
            if split == "train":
                raise DataError(f"{path} not found: a data dir holds train.jsonl "
                                "(and optionally valid.jsonl)")
            out[split] = None
            continue
        out[split] = encode_rows(tokenizer, read_rows(path), max_len, name=str(path))
    return out


# ---- batching -------------------------------------------------------------------------------


def batch_groups(dataset: TokenDataset, batch_size: int, drop_last: bool = True
                 ) -> list[list[int]]:
    """Example indices per batch, length-sorted so a batch pads little (ties keep file order)."""
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    if drop_last and len(dataset) < batch_size:
        raise DataError(f"{dataset.name} has {len(dataset)} usable examples, fewer than "
                        f"batch_size={batch_size}")
    order = sorted(range(len(dataset)), key=lambda i: (len(dataset[i][0]), i))
    stop = len(order) - len(order) % batch_size if drop_last else len(order)
    return [order[i:i + batch_size] for i in range(0, stop, batch_size)]


def epoch_permutation(n_batches: int, seed: int, epoch: int) -> np.ndarray:
    """The batch visiting order of one epoch: a pure function of (seed, epoch)."""
    return np.random.default_rng([int(seed), int(epoch)]).permutation(n_batches)


def collate(examples: Sequence[tuple[list[int], int]], max_len: int, pad_to: int = PAD_TO
            ) -> tuple[mx.array, mx.array]:
    """Pad to [B, T] and build `lengths` [B, 2] for `mlx_lm.tuner.trainer.default_loss`.

    default_loss counts target j (token j+1) where offset <= j+1 <= lengths[:, 1]; so the second
    column is the index of the last real token, len(ids) - 1. (mlx-lm's own iterate_batches puts
    len(ids) there, which also counts the first padding token as a target.)
    """
    longest = max(len(ids) for ids, _ in examples)
    width = min(1 + pad_to * -(-(longest - 1) // pad_to), max_len)
    arr = np.zeros((len(examples), width), np.int32)
    lengths = np.zeros((len(examples), 2), np.int32)
    for j, (ids, offset) in enumerate(examples):
        ids = ids[:width]
        arr[j, :len(ids)] = ids
        lengths[j] = (offset, len(ids) - 1)
    return mx.array(arr), mx.array(lengths)


def batch_at(dataset: TokenDataset, index: int, batch_size: int, seed: int, max_len: int
             ) -> tuple[mx.array, mx.array]:
    """The `index`-th (0-based) training batch: epochs of permuted length-sorted batches."""
    if dataset._order is None or len(dataset._order[0]) != batch_size:
        dataset._order = batch_groups(dataset, batch_size)
    groups = dataset._order
    epoch, pos = divmod(int(index), len(groups))
    group = groups[epoch_permutation(len(groups), seed, epoch)[pos]]
    return collate([dataset[i] for i in group], max_len)


def iterate_batches(dataset: TokenDataset, batch_size: int, seed: int, max_len: int,
                    start: int = 0) -> Iterator[tuple[mx.array, mx.array]]:
    """Endless training batches from batch index `start` on (resume = start at k)."""
    index = start
    while True:
        yield batch_at(dataset, index, batch_size, seed, max_len)
        index += 1


def validation_batches(dataset: TokenDataset, batch_size: int, num_batches: int, seed: int,
                       max_len: int) -> Iterator[tuple[mx.array, mx.array]]:
    """The same validation batches every time (all of them when num_batches is -1)."""
    groups = batch_groups(dataset, min(batch_size, len(dataset)), drop_last=False)
    order = epoch_permutation(len(groups), seed, 0)
    if num_batches >= 0:
        order = order[:num_batches]
    for g in order:
        yield collate([dataset[i] for i in groups[g]], max_len)
