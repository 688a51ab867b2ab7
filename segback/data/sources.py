"""Training data, read as `mlx_lm.lora` reads it, and a resumable batch order.

Sources (`load_dataset`), as mlx-lm's `tuner.datasets.load_dataset` takes them:
- a directory with train.jsonl (+ valid.jsonl, test.jsonl): read line by line with `json.loads`
  as mlx-lm does (so rows reach the chat template as written, and errors name file:line);
- a Hugging Face dataset name: `datasets.load_dataset(name)`, from the Hub or its Arrow cache;
- mlx-lm's `hf_dataset` config (a dict or a list of them: path, train_split, valid_split,
  test_split, config, *_feature);
- beyond mlx-lm: a directory saved by `datasets` (`save_to_disk`), a directory of parquet/JSONL
  files `datasets` splits by name, or a single data file (the train split only).

Rows are chat (`messages`, optional `tools`), completions (`prompt`/`completion`) or text
(`text`), field names configurable (`DataFormat`). Each becomes (ids, offset) exactly as mlx-lm's
ChatDataset / CompletionsDataset / TextDataset `.process()` makes it, up to the `<bos>` rule in
`segback.data.tokens`; only tokens from `offset` on count in the loss. Differences, each for a
reason:
- rows mlx-lm would train on silently wrong (`"content": null`, `"prompt": null` -> "None") or
  crash on are refused with a DataError naming file:line and what to do;
- `mask_prompt` is on by default (mlx-lm: off); with it on, text rows still count whole (mlx-lm
  refuses a text dataset) and a chat must end with the assistant's reply;
- JSONL may mix formats and hold blank lines; a `validation` split counts as `valid`;
- Arrow rows lose the nulls Arrow fills into absent struct fields (every message would get
  `tool_calls: None`, every tool schema the union of all parameters) before the template sees
  them;
- examples are truncated to `max_len` when loaded (mlx-lm: when batched), and those left with no
  token to train on are dropped.

Batch order differs from `mlx_lm.tuner.trainer.iterate_batches` in one way: it is a pure function
of (seed, index), so resuming at step k needs no RNG state. Like mlx-lm, examples are sorted by
length into fixed batches (less padding) and each epoch visits those batches in a permutation drawn
from `numpy.random.default_rng([seed, epoch])`.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from segback.data.tokens import encode_example, encode_text

PAD_TO = 32  # batch widths are 1 + a multiple of this, as in mlx-lm
SPLITS = ("train", "valid", "test")
SPLIT_NAMES = {"train": ("train",), "valid": ("valid", "validation"), "test": ("test",)}
FILE_BUILDERS = {".parquet": "parquet", ".json": "json", ".csv": "csv", ".arrow": "arrow"}
DATA_SUFFIXES = (".jsonl", *FILE_BUILDERS)
HUB_NAME = re.compile(r"\w[\w.-]*(/\w[\w.-]*)?")
HUB_HELP = (
    "A local directory (train.jsonl, valid.jsonl, test.jsonl, or a `datasets` save_to_disk "
    "copy) or a single JSONL file works without the Hub: download the dataset where there is "
    "network (`hf download {name} --repo-type dataset --local-dir DIR`) and pass DIR as the "
    "data. Set HF_HUB_OFFLINE=1 to read the local datasets cache without trying the network."
)


class DataError(ValueError):
    """A data source is missing or empty, or a row is malformed; the message says what to do."""


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

    def batch(self, indices: Sequence[int], max_len: int) -> tuple[mx.array, Any]:
        """The batch of these examples: `collate` (a packed dataset makes packed rows)."""
        return collate([self.examples[i] for i in indices], max_len)


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


def _one_line(e: Exception) -> str:
    """An exception as one line, to quote inside a one-paragraph DataError."""
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


# ---- rows -> (ids, offset) ------------------------------------------------------------------


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


def _unknown_format(row: Any, fmt: DataFormat, where: str) -> DataError:
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
        raise _unknown_format(row, fmt, where)
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
        raise DataError(f"{where}: the chat template failed on this row ({_one_line(e)}): "
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


# ---- sources -> raw splits ------------------------------------------------------------------


def read_jsonl(path: Path) -> tuple[list[dict], list[int]]:
    """(rows, line numbers) of a JSONL file, parsed with `json.loads` per line as mlx-lm does.

    Blank lines are skipped and a UTF-8 BOM is allowed (mlx-lm fails on both).
    """
    rows, lines = [], []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if n == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{n}: not UTF-8 (byte 0x{raw[e.start]:02x} at column "
                                f"{e.start + 1}): re-save the file as UTF-8 (e.g. `iconv -f "
                                "latin1 -t utf-8`).") from e
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: not valid JSON ({e.msg}, column {e.colno}): each "
                                "line holds one JSON object.") from e
            lines.append(n)
    if not rows:
        raise DataError(f"{path} is empty: it holds no JSON rows; write one JSON object per "
                        "line.")
    return rows, lines


def jsonl_split(path: Path, fmt: DataFormat) -> RawSplit:
    rows, lines = read_jsonl(path)
    return RawSplit(rows, str(path), fmt, lines=lines)


def _drop_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def from_arrow(row: dict, fmt: DataFormat) -> dict:
    """A row as JSONL would have held it: Arrow gives each struct every field seen in its column,
    None where absent (a `tool_calls: None` on every message, each tool's schema padded with all
    parameters of all tools). Content stays, null or not, to be checked."""
    row = dict(row)
    messages = row.get(fmt.chat_feature)
    if isinstance(messages, list):
        row[fmt.chat_feature] = [{**_drop_nulls(m), "content": m.get("content")}
                                 if isinstance(m, dict) else m for m in messages]
    if row.get("tools") is not None:
        row["tools"] = _drop_nulls(row["tools"])
    return row


def arrow_split(ds: Any, name: str, fmt: DataFormat) -> RawSplit:
    """A `datasets.Dataset` as a RawSplit; its format follows from its columns, as in mlx-lm."""
    if len(ds) == 0:
        raise DataError(f"{name} is empty: it holds no rows; give the split some data.")
    kind = row_format(dict.fromkeys(ds.column_names), fmt)
    if kind is None:
        raise _unknown_format(dict.fromkeys(ds.column_names), fmt, name)
    return RawSplit([from_arrow(r, fmt) for r in ds], name, fmt, kind=kind)


def arrow_splits(data: Any, name: str, splits: Sequence[str], fmt: DataFormat
                 ) -> dict[str, list[RawSplit]]:
    """{split: [RawSplit]} of a DatasetDict (or a Dataset: the train split)."""
    import datasets

    found = {"train": data} if isinstance(data, datasets.Dataset) else dict(data)
    out: dict[str, list[RawSplit]] = {}
    for split in splits:
        key = next((k for k in SPLIT_NAMES[split] if k in found), None)
        out[split] = [] if key is None else [arrow_split(found[key], f"{name}[{key}]", fmt)]
    if "train" in splits and not out["train"]:
        raise DataError(f"{name} has no train split (it has: {sorted(found)}): name the training "
                        "split 'train' (or use hf_dataset with train_split).")
    return out


def _offline() -> bool:
    import datasets

    from segback.models.prepare import _offline as hub_offline

    return bool(datasets.config.HF_HUB_OFFLINE) or hub_offline()


def load_hub(name: str, **kwargs: Any) -> Any:
    """`datasets.load_dataset(name, **kwargs)`: from the Hub, or its Arrow cache when offline.

    When the Hub cannot be reached, read the cache only (a request there can hang for minutes).
    """
    import datasets

    from segback.models.prepare import _unreachable

    unreachable = None if _offline() else _unreachable(5.0)
    print(f"segback: loading Hugging Face dataset {name}", file=sys.stderr)
    was = datasets.config.HF_HUB_OFFLINE
    try:
        if unreachable:
            datasets.config.HF_HUB_OFFLINE = True
        return datasets.load_dataset(name, **kwargs)
    except Exception as e:  # not found, gated, offline and not cached, ...
        why = f"{unreachable}; " if unreachable else ""
        raise DataError(f"cannot load dataset {name!r} from the Hugging Face Hub or the local "
                        f"datasets cache ({why}{_one_line(e)}). "
                        + HUB_HELP.format(name=name)) from e
    finally:
        datasets.config.HF_HUB_OFFLINE = was


def _read_with_datasets(load: Any, name: str) -> Any:
    try:
        return load()
    except Exception as e:  # a file `datasets` cannot parse
        raise DataError(f"{name}: `datasets` could not read it ({_one_line(e)}): fix the "
                        "file, or use train.jsonl / valid.jsonl.") from e


def read_dir(path: Path, splits: Sequence[str], fmt: DataFormat) -> dict[str, list[RawSplit]]:
    """mlx-lm's {train,valid,test}.jsonl; else a `save_to_disk` copy; else data files."""
    import datasets

    files = {s: path / f"{s}.jsonl" for s in SPLITS}
    if any(f.exists() for f in files.values()):
        if "train" in splits and not files["train"].exists():
            raise DataError(f"{files['train']} not found: a data directory holds train.jsonl "
                            "(and optionally valid.jsonl, test.jsonl).")
        return {s: [jsonl_split(files[s], fmt)] if files[s].exists() else [] for s in splits}
    if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
        data = _read_with_datasets(lambda: datasets.load_from_disk(str(path)), str(path))
        return arrow_splits(data, str(path), splits, fmt)
    if any(p.suffix in DATA_SUFFIXES for p in path.rglob("*") if p.is_file()):
        data = _read_with_datasets(lambda: datasets.load_dataset(str(path)), str(path))
        return arrow_splits(data, str(path), splits, fmt)
    raise DataError(f"{path / 'train.jsonl'} not found: {path} holds no data; a data directory "
                    "holds train.jsonl (and optionally valid.jsonl, test.jsonl), a `datasets` "
                    "save_to_disk copy, or parquet/JSONL files named by split.")


def read_file(path: Path, splits: Sequence[str], fmt: DataFormat) -> dict[str, list[RawSplit]]:
    """A single data file: the train split only."""
    import datasets

    if "valid" in splits:
        print(f"segback: {path} is a single file: it is the train split, and there is no "
              "validation (put train.jsonl and valid.jsonl in a directory for one)",
              file=sys.stderr)
    if path.suffix in FILE_BUILDERS:
        data = _read_with_datasets(lambda: datasets.load_dataset(
            FILE_BUILDERS[path.suffix], data_files=str(path), split="train"), str(path))
        train = arrow_split(data, str(path), fmt)
    else:
        train = jsonl_split(path, fmt)
    return {s: [train] if s == "train" else [] for s in splits}


def read_hf_config(spec: dict | list[dict], splits: Sequence[str], fmt: DataFormat
                   ) -> dict[str, list[RawSplit]]:
    """mlx-lm's `hf_dataset` config: each entry's splits (train[:80%], train[-10%:] by default),
    concatenated across entries; an entry's *_feature keys override the global ones."""
    out: dict[str, list[RawSplit]] = {s: [] for s in splits}
    for entry in [spec] if isinstance(spec, dict) else spec:
        if "path" not in entry:
            raise DataError(f"hf_dataset entry {entry} has no 'path': give the dataset's name.")
        entry_fmt = DataFormat.from_config({**entry, "mask_prompt": None}, fmt)
        defaults = {"train": "train[:80%]", "valid": "train[-10%:]", "test": None}
        for split in splits:
            expr = entry.get(f"{split}_split", defaults[split])
            if expr is None:
                raise DataError(f"hf_dataset {entry['path']}: no test_split given: name the "
                                "split to test on.")
            ds = load_hub(entry["path"], split=expr, **entry.get("config", {}))
            out[split].append(arrow_split(ds, f"{entry['path']}[{expr}]", entry_fmt))
    return out


def read_splits(data: Any, splits: Sequence[str] = ("train", "valid"),
                fmt: DataFormat | None = None) -> dict[str, list[RawSplit]]:
    """{split: [RawSplit]} from any source mlx-lm accepts (see the module docstring)."""
    fmt = fmt or DataFormat()
    if unknown := set(splits) - set(SPLITS):
        raise ValueError(f"unknown splits {sorted(unknown)}; splits are {SPLITS}")
    if isinstance(data, (dict, list)):
        return read_hf_config(data, splits, fmt)
    if not data:
        raise DataError("no data given: pass a directory with train.jsonl, a data file, a "
                        "Hugging Face dataset name, or an hf_dataset config.")
    path = Path(data).expanduser()
    if path.is_dir():
        return read_dir(path, splits, fmt)
    if path.is_file():
        return read_file(path, splits, fmt)
    if HUB_NAME.fullmatch(str(data)) and path.suffix not in DATA_SUFFIXES:
        return arrow_splits(load_hub(str(data)), str(data), splits, fmt)
    raise DataError(f"data directory or file not found: {path}; give a directory with "
                    "train.jsonl (and optionally valid.jsonl), a data file, or a Hugging Face "
                    "dataset name (org/name).")


def load_dataset(data: Any, tokenizer: Any, max_len: int,
                 splits: Sequence[str] = ("train", "valid"), fmt: DataFormat | None = None
                 ) -> dict[str, TokenDataset | None]:
    """Tokenized {split: dataset or None} from any source mlx-lm accepts; `train` is required.

    `data`: a directory, a data file, a Hugging Face dataset name, or mlx-lm's `hf_dataset`
    config (a dict or list of dicts). `fmt`: mask_prompt and field names (`DataFormat`).
    """
    raw = read_splits(data, splits, fmt)
    out: dict[str, TokenDataset | None] = {}
    for split, parts in raw.items():
        if not parts:
            out[split] = None
            continue
        examples = [ex for part in parts for ex in tokenize_split(tokenizer, part)]
        out[split] = fit(examples, max_len, " + ".join(p.name for p in parts))
    return out


# ---- batching -------------------------------------------------------------------------------


def batch_groups(dataset: TokenDataset, batch_size: int, drop_last: bool = True
                 ) -> list[list[int]]:
    """Example indices per batch, length-sorted so a batch pads little (ties keep file order)."""
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    if drop_last and len(dataset) < batch_size:
        raise DataError(f"{dataset.name} has {len(dataset)} usable examples, fewer than "
                        f"batch_size={batch_size}: add examples or lower the batch size.")
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
    return dataset.batch(group, max_len)


def validation_batches(dataset: TokenDataset, batch_size: int, num_batches: int, seed: int,
                       max_len: int) -> Iterator[tuple[mx.array, mx.array]]:
    """The same validation batches every time (all of them when num_batches is -1)."""
    groups = batch_groups(dataset, min(batch_size, len(dataset)), drop_last=False)
    order = epoch_permutation(len(groups), seed, 0)
    if num_batches >= 0:
        order = order[:num_batches]
    for g in order:
        yield dataset.batch(groups[g], max_len)
