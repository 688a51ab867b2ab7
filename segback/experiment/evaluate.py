"""`segback evaluate`: held-out loss and perplexity, and the token filter of the workflow's
generic task (a user's own data in place of the chunking dataset).

    # mean loss over the split's trained tokens, and ppl = exp(loss); the base model, or with
    # the adapter mounted
    segback evaluate --model DIR [--adapter DIR] --data SRC --max-seq-length L --out EVAL.json
    # the data stage: SRC's split as JSONL, only the rows whose example fits in N tokens of the
    # model's tokenizer (its weights are not loaded), and a report of what was kept
    segback evaluate --model DIR --data SRC --split test --max-tokens N --rows OUT.jsonl \\
        --out REPORT.json

SRC is what `segback train --data` reads (`segback.data`): a directory with
{train,valid,test}.jsonl (or a `datasets` save_to_disk copy, or data files named by split), a
single data file, a Hugging Face dataset name, or mlx-lm's `hf_dataset` config as JSON. Rows
are chat (`messages`), completions (`prompt`/`completion`) or text (`text`), field names set
with the `--*-feature` options.

Loss: what `mlx_lm.lora --test` reports and `mlx_lm.tuner.trainer.default_loss` computes, over
every example of the split: examples tokenized as in training (`segback.data`; with
`--mask-prompt`, the default, only completion tokens count), cut to `--max-seq-length`, and the
cross-entropy summed over every counted token divided by their number (a token-weighted mean,
not a mean of batch means), by the trainer's own `evaluate` (`segback.trainer.loop`, dropout
off). `ppl = exp(loss)`.

Rows (`--rows`): each row is written with the standard field names (`messages`, `prompt` and
`completion`, or `text`; other fields kept), so later stages need no `--*-feature` options. A
row is kept when its whole example (prompt and completion) fits in `--max-tokens` and has a
token to train on. A source without a valid or test split (a single JSONL file, a Hub dataset
with only `train`) gets one carved out of train: `--valid-fraction` / `--test-fraction` of its
rows (at least one each), drawn with `--seed`, the same rows on every call.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
from mlx_lm.utils import load_tokenizer as mlx_load_tokenizer

from segback.data.dataset import DataError
from segback.data.formats import DataFormat, encode_row, fit, RawSplit, row_format, tokenize_split
from segback.data.sources import SPLITS, read_splits
from segback.data.tokens import ByteTokenizer
from segback.io import atomic_write_json, atomic_write_jsonl
from segback.models.load import load
from segback.trainer import distributed, loop

STANDARD = DataFormat()  # the field names rows are written with
FEATURES = ("prompt_feature", "completion_feature", "chat_feature", "text_feature")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


# ---- sources ---------------------------------------------------------------------------------


def parse_source(data: str) -> Any:
    """--data as `segback.data` takes it: a JSON object or list is an `hf_dataset` config."""
    text = data.strip()
    if text[:1] in "{[":
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"--data {data!r} looks like JSON but is not ({e.msg})") from e
    return data


def _is_file(source: Any) -> bool:
    return isinstance(source, str) and Path(source).expanduser().is_file()


def eval_parts(source: Any, split: str, fmt: DataFormat) -> list[RawSplit]:
    """The rows to evaluate: a data file's rows, or the source's `split`."""
    if _is_file(source):
        return read_splits(source, ("train",), fmt)["train"]
    parts = read_splits(source, (split,), fmt)[split]
    if not parts:
        raise DataError(f"{source}: no {split} split (for a directory: {split}.jsonl); give "
                        "one, or pass the file to evaluate as --data.")
    return parts


def standard_row(row: dict, fmt: DataFormat, kind: str | None, where: str) -> dict:
    """The row with the standard field names (its format's fields renamed, others kept)."""
    kind = kind or row_format(row, fmt)
    if kind is None:
        encode_row(None, row, fmt, where)  # raises the DataError naming the expected fields
    fields = {"completions": (("prompt", fmt.prompt_feature),
                              ("completion", fmt.completion_feature)),
              "chat": (("messages", fmt.chat_feature),),
              "text": (("text", fmt.text_feature),)}[kind]
    named = {getattr(fmt, f) for f in FEATURES} | {getattr(STANDARD, f) for f in FEATURES}
    out = {k: v for k, v in row.items() if k not in named}
    out.update({std: row[key] for std, key in fields})
    return out


def carve(n: int, valid: bool, test: bool, valid_fraction: float, test_fraction: float,
          seed: int, source: str) -> dict[str, list[int]]:
    """Train row indices per split when valid and/or test are cut out of train (seeded)."""
    sizes = {s: max(1, round(f * n)) for s, f, want in (("valid", valid_fraction, valid),
                                                      ("test", test_fraction, test)) if want}
    if n - sum(sizes.values()) < 1:
        raise DataError(f"{source}: {n} training rows cannot spare {sum(sizes.values())} for "
                        f"{' and '.join(sizes)}: add rows, or give the splits as files.")
    order = np.random.default_rng([int(seed), n]).permutation(n)
    out, start = {}, 0
    for split in ("test", "valid"):
        if split in sizes:
            out[split] = sorted(int(i) for i in order[start:start + sizes[split]])
            start += sizes[split]
    taken = {i for idx in out.values() for i in idx}
    out["train"] = [i for i in range(n) if i not in taken]
    return out


def source_rows(source: Any, split: str, fmt: DataFormat, valid_fraction: float = 0.1,
                test_fraction: float = 0.1, seed: int = 0
                ) -> tuple[list[dict], list[str], dict]:
    """(standard rows, where each came from, how the split was obtained) for `split` of any
    source, carving a missing valid or test split out of train."""
    splits = ("train",) if _is_file(source) else SPLITS
    raw = read_splits(source, splits, fmt)
    rows: dict[str, list[dict]] = {}
    where: dict[str, list[str]] = {}
    for s in SPLITS:
        rows[s], where[s] = [], []
        for part in raw.get(s, []):
            for i, row in enumerate(part.rows):
                w = part.where(i)
                rows[s].append(standard_row(row, part.fmt, part.kind, w))
                where[s].append(w)
    missing = [s for s in ("valid", "test") if not rows[s]]
    info = {"source": source if isinstance(source, str) else json.dumps(source),
            "carved": missing}
    if split in missing or (split == "train" and missing):
        if not rows["train"]:
            raise DataError(f"{source}: no train split to read or to carve {split} from.")
        idx = carve(len(rows["train"]), "valid" in missing, "test" in missing, valid_fraction,
                    test_fraction, seed, str(source))
        info.update(seed=seed, valid_fraction=valid_fraction, test_fraction=test_fraction)
        return ([rows["train"][i] for i in idx[split]], [where["train"][i] for i in idx[split]],
                info)
    return rows[split], where[split], info


# ---- the filter ------------------------------------------------------------------------------


def percentiles(values: list[int]) -> dict:
    if not values:
        return {"n": 0}
    v = sorted(values)

    def at(q: float) -> int:
        return v[min(len(v) - 1, int(q * (len(v) - 1) + 0.5))]

    return {"n": len(v), "min": v[0], "p10": at(0.1), "p50": at(0.5), "p90": at(0.9),
            "max": v[-1]}


def fits(rows: list[dict], where: list[str], tokenizer: Any, max_tokens: int, mask_prompt: bool
         ) -> tuple[list[dict], dict]:
    """(rows whose example fits in `max_tokens` and has a token to train on, counts)."""
    fmt = DataFormat(mask_prompt=mask_prompt)
    kept, lengths, kept_lengths, too_long, no_target = [], [], [], 0, 0
    for row, w in zip(rows, where):
        ids, offset = encode_row(tokenizer, row, fmt, w)
        lengths.append(len(ids))
        if len(ids) > max_tokens:
            too_long += 1
        elif len(ids) < 2 or offset > len(ids) - 1:
            no_target += 1
        else:
            kept.append(row)
            kept_lengths.append(len(ids))
    report = {"max_tokens": max_tokens, "total": len(rows), "kept": len(kept),
              "dropped": len(rows) - len(kept), "too_long": too_long,
              "no_loss_tokens": no_target, "kept_tokens": percentiles(kept_lengths),
              "all_tokens": percentiles(lengths)}
    return kept, report


def load_tokenizer(model: str) -> Any:
    """The tokenizer `segback train` uses for `model`, without its weights: the checkpoint's,
    or bytes (`ByteTokenizer`) for a model that ships none."""
    path = Path(model)
    if path.is_dir() and any((path / f).exists() for f in TOKENIZER_FILES):
        return mlx_load_tokenizer(path)
    return ByteTokenizer()


def rows_main(args: argparse.Namespace, fmt: DataFormat) -> int:
    source = parse_source(args.data)
    rows, where, info = source_rows(source, args.split, fmt, args.valid_fraction,
                                    args.test_fraction, args.seed)
    kept, report = fits(rows, where, load_tokenizer(args.model), args.max_tokens,
                        fmt.mask_prompt)
    report = {"split": args.split, **report, **info, "mask_prompt": fmt.mask_prompt,
              "model": str(args.model)}
    t = report["all_tokens"]
    print(f"segback evaluate: {args.split}: kept {report['kept']}/{report['total']} rows of "
          f"<= {args.max_tokens} tokens (all: p50 {t.get('p50')}, max {t.get('max')})"
          + (f"; carved {'/'.join(info['carved'])} out of train" if info["carved"] else ""),
          file=sys.stderr)
    if not kept:
        print(f"segback evaluate: no {args.split} row fits in {args.max_tokens} tokens: raise "
              "the limit (seq, eval.max_prompt_tokens) or shorten the rows", file=sys.stderr)
        return 1
    atomic_write_jsonl(args.rows, kept)
    atomic_write_json(args.out, report)
    return 0


# ---- loss and perplexity ---------------------------------------------------------------------


def perplexity(loss: float | None) -> float | None:
    if loss is None or not math.isfinite(loss):
        return None
    try:
        return math.exp(loss)
    except OverflowError:
        return None


def evaluate_loss(model: Any, dataset: Any, max_seq_length: int, batch_size: int = 1) -> float:
    """Token-weighted mean loss over every example (the trainer's `evaluate`, one process)."""
    args = SimpleNamespace(batch_size=batch_size, seed=0, max_seq_length=max_seq_length)
    return loop.evaluate(model, dataset, args, -1, distributed.SINGLE)


def loss_main(args: argparse.Namespace, fmt: DataFormat) -> int:
    source = parse_source(args.data)
    parts = eval_parts(source, args.split, fmt)  # before the model: a bad source fails fast
    tic = time.perf_counter()
    model, tokenizer = load(args.model, adapter_path=args.adapter)
    if tokenizer is None:
        tokenizer = ByteTokenizer()
    examples = [ex for part in parts for ex in tokenize_split(tokenizer, part)]
    dataset = fit(examples, args.max_seq_length, " + ".join(p.name for p in parts))
    loss = evaluate_loss(model, dataset, args.max_seq_length, args.batch_size)
    result = {
        "loss": loss if math.isfinite(loss) else None,
        "ppl": perplexity(loss),
        "tokens": dataset.loss_tokens,
        "examples": len(dataset),
        "dropped": dataset.dropped,
        "truncated": dataset.truncated,
        "model": str(args.model),
        "adapter": args.adapter,
        "data": args.data,
        "split": None if _is_file(source) else args.split,
        "max_seq_length": args.max_seq_length,
        "mask_prompt": fmt.mask_prompt,
        "batch_size": args.batch_size,
        "seconds": round(time.perf_counter() - tic, 3),
    }
    atomic_write_json(args.out, result)
    ppl = result["ppl"]
    print(f"segback evaluate: {'adapter ' + args.adapter if args.adapter else 'base model'}: "
          f"loss {loss:.4f}, ppl {ppl if ppl is None else f'{ppl:.3f}'} over "
          f"{result['tokens']} tokens of {result['examples']} examples -> {args.out}",
          file=sys.stderr)
    return 0


# ---- command line ----------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="model dir (mlx_lm.load layout); --rows reads only its tokenizer")
    parser.add_argument("--adapter", default=None,
                        help="adapter dir (mlx-lm layout) to mount; loss mode only")
    parser.add_argument("--data", required=True,
                        help="data directory, data file, Hugging Face dataset name, or an "
                             "hf_dataset config as JSON (segback.data)")
    parser.add_argument("--split", choices=SPLITS, default="test",
                        help="the split to read (a data file given as --data is the rows "
                             "to evaluate, whatever the split)")
    parser.add_argument("--out", required=True,
                        help="loss mode: loss/ppl JSON; with --rows: the filter's report JSON")
    parser.add_argument("--max-seq-length", type=int, default=2048,
                        help="loss mode: tokens per example (longer ones are cut, as in "
                             "training)")
    parser.add_argument("--batch-size", type=int, default=1,
                        help="loss mode: examples per forward pass")
    parser.add_argument("--mask-prompt", action=argparse.BooleanOptionalAction, default=True,
                        help="count only completion tokens (chat and prompt/completion rows); "
                             "default on, as segback train")
    for name in FEATURES:
        default = getattr(STANDARD, name)
        parser.add_argument(f"--{name.replace('_', '-')}", default=default,
                            help=f"field of the rows' {name.split('_')[0]} (default {default})")
    parser.add_argument("--rows", default=None, metavar="OUT.jsonl",
                        help="filter mode: write the split's rows that fit in --max-tokens")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="filter mode: keep rows whose whole example fits in this many "
                             "tokens")
    parser.add_argument("--valid-fraction", type=float, default=0.1,
                        help="filter mode: share of train carved out as valid when the source "
                             "has no valid split")
    parser.add_argument("--test-fraction", type=float, default=0.1,
                        help="filter mode: share of train carved out as test when the source "
                             "has no test split")
    parser.add_argument("--seed", type=int, default=0, help="filter mode: carving seed")


def check_args(args: argparse.Namespace) -> str | None:
    if (args.rows is None) != (args.max_tokens is None):
        return "--rows and --max-tokens go together (the filter mode)"
    if args.rows is not None and args.adapter is not None:
        return "--adapter has no use with --rows (the filter reads only the tokenizer)"
    if args.max_tokens is not None and args.max_tokens < 2:
        return "--max-tokens must be at least 2"
    if args.max_seq_length < 2 or args.batch_size < 1:
        return "--max-seq-length must be at least 2 and --batch-size at least 1"
    for name in ("valid_fraction", "test_fraction"):
        if not 0 < getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be between 0 and 1"
    return None


def main(args: argparse.Namespace) -> int:
    problem = check_args(args)
    if problem:
        print(f"segback evaluate: error: {problem}", file=sys.stderr)
        return 2
    fmt = DataFormat(mask_prompt=args.mask_prompt,
                     **{name: getattr(args, name) for name in FEATURES})
    try:
        return rows_main(args, fmt) if args.rows is not None else loss_main(args, fmt)
    except (DataError, FileNotFoundError, ValueError) as e:
        print(f"segback evaluate: error: {e}", file=sys.stderr)
        return 2
