"""Training data sources, read as `mlx_lm.lora` reads them (`load_dataset`).

Sources, as mlx-lm's `tuner.datasets.load_dataset` takes them:
- a directory with train.jsonl (+ valid.jsonl, test.jsonl): read line by line with `json.loads`
  as mlx-lm does (so rows reach the chat template as written, and errors name file:line);
- a Hugging Face dataset name: `datasets.load_dataset(name)`, from the Hub or its Arrow cache;
- mlx-lm's `hf_dataset` config (a dict or a list of them: path, train_split, valid_split,
  test_split, config, *_feature);
- beyond mlx-lm: a directory saved by `datasets` (`save_to_disk`), a directory of parquet/JSONL
  files `datasets` splits by name, or a single data file (the train split only).

Differences from mlx-lm, each for a reason:
- JSONL may mix formats and hold blank lines or a UTF-8 BOM; a `validation` split counts as
  `valid`;
- Arrow rows lose the nulls Arrow fills into absent struct fields (every message would get
  `tool_calls: None`, every tool schema the union of all parameters) before the template sees
  them.
Rows become examples in `segback.data.formats`.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from segback.data.dataset import DataError, TokenDataset, one_line
from segback.data.formats import (DataFormat, RawSplit, fit, row_format, tokenize_split,
                                  unknown_format)
from segback.models import hub

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
        raise unknown_format(dict.fromkeys(ds.column_names), fmt, name)
    return RawSplit([from_arrow(r, fmt) for r in ds], name, fmt, kind=kind)


def arrow_splits(data: Any, name: str, splits: Sequence[str], fmt: DataFormat
                 ) -> dict[str, list[RawSplit]]:
    """{split: [RawSplit]} of a DatasetDict (or a Dataset: the train split)."""
    datasets = _datasets()
    found = {"train": data} if isinstance(data, datasets.Dataset) else dict(data)
    out: dict[str, list[RawSplit]] = {}
    for split in splits:
        key = next((k for k in SPLIT_NAMES[split] if k in found), None)
        out[split] = [] if key is None else [arrow_split(found[key], f"{name}[{key}]", fmt)]
    if "train" in splits and not out["train"]:
        raise DataError(f"{name} has no train split (it has: {sorted(found)}): name the training "
                        "split 'train' (or use hf_dataset with train_split).")
    return out


def _datasets() -> Any:
    """The `datasets` package, imported only for the sources that need it (it takes seconds)."""
    import datasets

    return datasets


def _offline() -> bool:
    return bool(_datasets().config.HF_HUB_OFFLINE) or hub.offline()


def load_hub(name: str, **kwargs: Any) -> Any:
    """`datasets.load_dataset(name, **kwargs)`: from the Hub, or its Arrow cache when offline.

    When the Hub cannot be reached, read the cache only (a request there can hang for minutes).
    """
    datasets = _datasets()
    unreachable = None if _offline() else hub.unreachable(5.0)
    print(f"segback: loading Hugging Face dataset {name}", file=sys.stderr)
    was = datasets.config.HF_HUB_OFFLINE
    try:
        if unreachable:
            datasets.config.HF_HUB_OFFLINE = True
        return datasets.load_dataset(name, **kwargs)
    except Exception as e:  # not found, gated, offline and not cached, ...
        why = f"{unreachable}; " if unreachable else ""
        raise DataError(f"cannot load dataset {name!r} from the Hugging Face Hub or the local "
                        f"datasets cache ({why}{one_line(e)}). "
                        + HUB_HELP.format(name=name)) from e
    finally:
        datasets.config.HF_HUB_OFFLINE = was


def _read_with_datasets(load: Any, name: str) -> Any:
    try:
        return load()
    except Exception as e:  # a file `datasets` cannot parse
        raise DataError(f"{name}: `datasets` could not read it ({one_line(e)}): fix the "
                        "file, or use train.jsonl / valid.jsonl.") from e


def read_dir(path: Path, splits: Sequence[str], fmt: DataFormat) -> dict[str, list[RawSplit]]:
    """mlx-lm's {train,valid,test}.jsonl; else a `save_to_disk` copy; else data files."""
    datasets = _datasets()
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
    datasets = _datasets()
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
