"""Score chunking answers against the gold chunks; never crashes on model output.

Per case, a weighted score out of 100 (the weights are WEIGHTS):

    json 30      a JSON object could be extracted from the text (```json fences and prose
                 around it are tolerated; the first object with a "chunks" key wins, else the
                 first complete object). Strict JSON only: NaN, Infinity and numbers that overflow
                 to infinity are invalid, and so is nesting deeper than MAX_DEPTH levels.
    schema 20    it matches chunks.schema.json: {"chunks": [{"anchor": str, "label": str}]}
                 with at most MAX_CHUNKS chunks
    anchors 25   fraction of chunks that are *placed*: the anchor names a transcript message
                 (exactly, or after a repair: surrounding brackets/quotes/spaces, case, a unique
                 prefix of >= 4 characters, or exactly one message id inside an anchor of at most
                 MAX_ANCHOR_CHARS characters; repairs are counted) and the chunk is in transcript
                 order. Order: of the chunks whose anchors resolve, the longest run (subsequence)
                 with strictly increasing message positions is placed, preferring earlier chunks
                 on ties; the others fail as 'duplicate anchor' (same message as a placed chunk)
                 or 'anchor out of order'. Unknown and ambiguous anchors fail.
    labels 15    fraction of chunks that are placed and whose label is a non-empty string of at
                 most MAX_LABEL_WORDS words and MAX_LABEL_CHARS characters (stripped), distinct
                 (case-insensitively) from the labels before it
    nonempty 10  at least one chunk is placed

A label or a non-empty list earns nothing without a chunk of the transcript to go with it, so an
answer whose anchors are all unknown scores 50 (json + schema), not 75. Denominators are all
entries of the list; entries after the first MAX_CHUNKS are not examined and earn nothing. When
no JSON can be extracted every component scores 0; when the schema fails, anchors and labels
still get credit for the well-formed entries.

Bounded work: only the first MAX_TEXT_CHARS characters of an answer are examined, at most
MAX_FENCES fenced blocks and MAX_STARTS '{' positions per block are tried, and the decoder may run
over at most MAX_SCAN_CHARS characters in all; no regular expressions are used on the answer.

Segmentation quality, beside the score (over placed chunks only):
- boundaries: a boundary is the index of a chunk's first message. The first chunk always starts
  at message 0, so index 0 is left out of both gold and prediction (it would reward every
  answer for free). Precision, recall and F1 match exact indices; an empty prediction has
  precision 0 (1 when the gold is empty too).
- Pk and WindowDiff (nltk; lower is better) over the boundary string of message positions
  1..n-1, with k = half the mean gold chunk length in messages (at least 1); cases of fewer
  than 3 messages get null.
- rouge_l: ROUGE-L F (rouge-score, stemmed) between each gold label and the first ROUGE_CHARS
  characters of the label of the placed chunk that starts at the same message (0 when none
  does), averaged over gold chunks.

Summary figures are means over the cases where the figure is defined (null values are left
out; a mean with no values is null). score.json is strict JSON (no NaN or Infinity).

Predictions file: read as bytes, one JSON object per line; a line that is not UTF-8 has its bad
bytes replaced (U+FFFD) and is still scored, a line that is not JSON is skipped; both are reported
as 'file:line' warnings, in the summary's `warnings` and on stderr. Of several rows with the same
id the first is scored and the others are reported; ids that are not gold cases are reported and
ignored; gold cases without a prediction score 0 and count in `n_missing`.

A gold answer scores 100 with boundary F1 = 1; an empty answer scores 0.
"""

from __future__ import annotations

import argparse
import codecs
import gc
import json
import math
import sys
from bisect import bisect_left
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any

from segback.chunking.prompt import transcript
from segback.io import atomic_write_text

WEIGHTS = {"json": 30, "schema": 20, "anchors": 25, "labels": 15, "nonempty": 10}
MAX_LABEL_WORDS = 8
MAX_LABEL_CHARS = 100  # gold labels (8 words from make_label) are well under this
MIN_PREFIX = 4
MAX_ANCHOR_CHARS = 200  # longer anchors are not repaired: a message id is at most 36 characters
MAX_CHUNKS = 1000  # also the schema's maxItems
MAX_TEXT_CHARS = 8_000_000
MAX_FENCES = 16
MAX_STARTS = 256  # '{' positions tried per block
MAX_SCAN_CHARS = 16_000_000  # characters the decoder may run over, all attempts together
MAX_DEPTH = 64
ROUGE_CHARS = 400
MAX_WARNINGS = 100  # kept in the summary; the rest are counted
SCHEMA_PATH = Path(__file__).with_name("chunks.schema.json")
CASES_HINT = ("--data must be a cases JSONL file (one JSON object per line) from "
              "`segback build-data` or `segback filter-data`; rebuild it or pass the right path.")
PREDS_HINT = "--pred must be the predictions JSONL written by `segback generate`."


class InputError(ValueError):
    """A bad gold or predictions file; the message names the file (and line) and the fix."""


@lru_cache(maxsize=1)
def validator() -> Any:
    import jsonschema

    schema = json.loads(SCHEMA_PATH.read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


@lru_cache(maxsize=1)
def rouge() -> Any:
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    """JSON numbers like 1e999 would become inf, which strict JSON cannot hold."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:20]} is out of range")
    return value


_DECODER = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float)


def deeper_than(obj: Any, limit: int) -> bool:
    """Whether containers nest more than `limit` levels; level by level, without recursion."""
    level = [obj] if type(obj) in (dict, list) else []
    for _ in range(limit):
        level = [c for v in level for c in (v.values() if type(v) is dict else v)
                 if type(c) is dict or type(c) is list]
        if not level:
            return False
    return bool(level)


def fenced_blocks(text: str) -> list[str]:
    """Contents of the first MAX_FENCES ``` blocks (str.find, so linear in the text)."""
    blocks, pos = [], 0
    while len(blocks) < MAX_FENCES:
        start = text.find("```", pos)
        end = text.find("```", start + 3) if start >= 0 else -1
        if end < 0:
            break
        blocks.append(text[start + 3:end])
        pos = end + 3
    return blocks


def _decode_at(text: str, start: int) -> tuple[Any, int, str | None]:
    """(object, end, None) for the JSON value at `start`, or (None, how far it got, why)."""
    try:
        obj, end = _DECODER.raw_decode(text, start)
    except json.JSONDecodeError as e:
        return None, e.pos, e.msg
    except RecursionError:
        return None, len(text), f"nested deeper than {MAX_DEPTH} levels"
    except ValueError as e:  # NaN/Infinity, out-of-range numbers, over-long integers
        return None, len(text), str(e)[:120]
    return obj, end, None


def _scan(text: str, budget: list[int]) -> tuple[Any, str | None]:
    """(object, None) for the first object with "chunks" in `text`, else the object at its
    first '{'; (None, first error) when neither parses. `budget` is shared across blocks."""
    fallback, first_error = None, None
    start = text.find("{")
    for n in range(MAX_STARTS):
        if start < 0 or budget[0] <= 0:
            break
        obj, end, error = _decode_at(text, start)
        budget[0] -= max(end - start, 1)
        if error is None and "chunks" in obj:
            return obj, None
        if error is None and n == 0:  # an inner object of a broken outer one does not count
            fallback = obj
        first_error = first_error or error
        start = text.find("{", start + 1)
    return fallback, first_error


@contextmanager
def gc_paused() -> Iterator[None]:
    """Parsing can allocate millions of containers, which the cyclic GC would rescan again and
    again (5x slower on a 5 MB answer); parsed JSON holds no cycles, so pausing it is safe."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def extract_json(text: Any) -> tuple[Any, str | None]:
    """(object, None) for the answer's JSON object, or (None, why not); bounded work."""
    if text is None or (isinstance(text, str) and not text.strip()):
        return None, "empty output"
    if not isinstance(text, str):
        return None, f"text is not a string: {type(text).__name__}"
    text = text[:MAX_TEXT_CHARS]
    budget = [MAX_SCAN_CHARS]
    first_error = None
    for block in [*fenced_blocks(text), text]:
        with gc_paused():
            obj, error = _scan(block, budget)
            too_deep = obj is not None and deeper_than(obj, MAX_DEPTH)
        if too_deep:
            return None, f"invalid JSON (nested deeper than {MAX_DEPTH} levels)"
        if obj is not None:
            return obj, None
        first_error = first_error or error
    if "{" not in text:
        return None, "no JSON object"
    if first_error is None:
        first_error = "too much text to search"
    return None, f"invalid or truncated JSON ({first_error})"


def resolve_anchor(anchor: Any, ids: list[str], index: dict[str, int]
                   ) -> tuple[int | None, str]:
    """(message index or None, 'exact' | 'repaired' | why it failed)."""
    if not isinstance(anchor, str):
        return None, "anchor not a string"
    if anchor in index:
        return index[anchor], "exact"
    if len(anchor) > MAX_ANCHOR_CHARS:
        return None, f"anchor over {MAX_ANCHOR_CHARS} characters"
    a = anchor.strip().strip("[]<>()\"'` ").strip().lower()
    if a in index:
        return index[a], "repaired"
    if len(a) >= MIN_PREFIX:
        hits = [i for i in ids if i.startswith(a)]
        if len(hits) == 1:
            return index[hits[0]], "repaired"
        if len(hits) > 1:
            return None, "ambiguous anchor"
        inside = [i for i in ids if i in a]
        if len(inside) == 1:
            return index[inside[0]], "repaired"
    return None, "unknown anchor"


def label_problem(label: Any, seen: set[str]) -> str | None:
    """Why `label` is not a short, distinct title (None when it is); adds it to `seen`."""
    if not isinstance(label, str):
        return "label not a string"
    stripped = label.strip()
    if not stripped:
        return "empty label"
    if len(stripped) > MAX_LABEL_CHARS:
        return f"label over {MAX_LABEL_CHARS} characters"
    words = stripped.split()
    if len(words) > MAX_LABEL_WORDS:
        return f"label over {MAX_LABEL_WORDS} words"
    key = " ".join(words).lower()
    if key in seen:
        return "duplicate label"
    seen.add(key)
    return None


def in_order(positions: list[int]) -> list[bool]:
    """Which positions form the longest strictly increasing subsequence, preferring earlier
    entries on ties: the chunks that can stand in transcript order together. O(n log n)."""
    longest_from = [0] * len(positions)  # longest increasing run that starts at i
    tails: list[int] = []
    for i in range(len(positions) - 1, -1, -1):
        k = bisect_left(tails, -positions[i])
        tails[k:k + 1] = [-positions[i]]
        longest_from[i] = k + 1
    keep, need, last = [False] * len(positions), len(tails), -1
    for i, pos in enumerate(positions):
        if need and pos > last and longest_from[i] == need:
            keep[i], need, last = True, need - 1, pos
    return keep


def place_chunks(items: list, ids: list[str], index: dict[str, int]
                 ) -> tuple[dict[int, int], dict[str, int], int]:
    """({message index: item index} of placed chunks, failure counts, repairs among them)."""
    counts: dict[str, int] = {}
    resolved: list[tuple[int, int, str]] = []  # (item index, message index, how)
    for i, item in enumerate(items[:MAX_CHUNKS]):
        if not isinstance(item, dict):
            counts["chunk not an object"] = counts.get("chunk not an object", 0) + 1
            continue
        pos, how = resolve_anchor(item.get("anchor"), ids, index)
        if pos is None:
            counts[how] = counts.get(how, 0) + 1
        else:
            resolved.append((i, pos, how))
    if len(items) > MAX_CHUNKS:
        counts[f"chunk after the first {MAX_CHUNKS}"] = len(items) - MAX_CHUNKS
    keep = in_order([pos for _, pos, _ in resolved])
    placed = {pos: i for (i, pos, _), k in zip(resolved, keep) if k}
    repairs = sum(how == "repaired" for (_, _, how), k in zip(resolved, keep) if k)
    for (_, pos, _), k in zip(resolved, keep):
        if not k:
            why = "duplicate anchor" if pos in placed else "anchor out of order"
            counts[why] = counts.get(why, 0) + 1
    return placed, counts, repairs


def schema_problem(obj: Any) -> str | None:
    """The first schema error as a reason, or None; over-long lists are caught before
    jsonschema so it never walks or prints them."""
    chunks = obj.get("chunks") if isinstance(obj, dict) else None
    if isinstance(chunks, list) and len(chunks) > MAX_CHUNKS:
        return f"schema: {len(chunks)} chunks, more than the {MAX_CHUNKS} allowed at chunks"
    try:
        error = next(validator().iter_errors(obj), None)
    except RecursionError:  # not reached for objects within MAX_DEPTH; belt and braces
        return "schema: nested too deeply to check"
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path) or "root"
    return f"schema: {error.message[:200]} at {where}"


def boundary_prf(gold: set[int], pred: set[int]) -> dict[str, float]:
    tp = len(gold & pred)
    p = tp / len(pred) if pred else float(not gold)
    r = tp / len(gold) if gold else float(not pred)
    f1 = 2 * p * r / (p + r) if p + r else 0.0
    return {"precision": p, "recall": r, "f1": f1}


def finite(value: Any) -> int | float | None:
    """`value` if it is a finite number, else None: keeps NaN, inf and ints too big for a float
    (which would overflow a mean) out of score.json."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return value if math.isfinite(float(value)) else None
    except OverflowError:
        return None


def window_metrics(n: int, gold: set[int], pred: set[int]) -> tuple[float | None, float | None]:
    """(Pk, WindowDiff) over message positions 1..n-1; None for degenerate short cases."""
    from nltk.metrics.segmentation import pk, windowdiff

    if n < 3:
        return None, None
    ref = "".join("1" if i in gold else "0" for i in range(1, n))
    hyp = "".join("1" if i in pred else "0" for i in range(1, n))
    k = min(len(ref), max(1, round(n / (2 * (len(gold) + 1)))))
    return finite(pk(ref, hyp, k=k)), finite(windowdiff(ref, hyp, k))


def _rouge_l(gold_label: str, pred_label: Any) -> float:
    if not isinstance(pred_label, str):
        return 0.0
    return rouge().score(gold_label, pred_label[:ROUGE_CHARS])["rougeL"].fmeasure


def score_case(case: dict, text: Any) -> dict:
    """The score row of one case: components, total, reasons and segmentation metrics."""
    messages = transcript(case)
    ids = [m["id"] for m in messages]
    index = {mid: i for i, mid in enumerate(ids)}
    gold_chunks = case["gold"]["chunks"]
    gold_at = {index[c["anchor"]]: c["label"] for c in gold_chunks if c["anchor"] in index}
    comp = dict.fromkeys(WEIGHTS, 0.0)
    reasons: list[str] = []
    pred_at: dict[int, Any] = {}
    repairs, n_pred = 0, 0

    obj, why = extract_json(text)
    if why is not None:
        reasons.append(why)
    else:
        comp["json"] = 1.0
        problem = schema_problem(obj)
        if problem:
            reasons.append(problem)
        else:
            comp["schema"] = 1.0
        chunks = obj.get("chunks") if isinstance(obj, dict) else None
        items = chunks if isinstance(chunks, list) else []
        n_pred = len(items)
        placed, counts, repairs = place_chunks(items, ids, index)
        placed_items = set(placed.values())
        good_labels = 0
        seen_labels: set[str] = set()
        for i, item in enumerate(items[:MAX_CHUNKS]):
            if not isinstance(item, dict):
                continue
            problem = label_problem(item.get("label"), seen_labels)
            if problem:
                counts[problem] = counts.get(problem, 0) + 1
            elif i in placed_items:
                good_labels += 1
        pred_at = {pos: items[i].get("label") for pos, i in sorted(placed.items())}
        if items:
            comp["anchors"] = len(placed) / len(items)
            comp["labels"] = good_labels / len(items)
            comp["nonempty"] = float(bool(placed))
            if not placed:
                reasons.append("no chunk placed in the transcript")
        else:
            reasons.append("no chunks")
        reasons += [f"{v} x {k}" for k, v in counts.items()]
        if repairs:
            reasons.append(f"{repairs} x anchor repaired")

    gold_b, pred_b = set(gold_at) - {0}, set(pred_at) - {0}
    pk_v, wd_v = window_metrics(len(messages), gold_b, pred_b)
    rl = [_rouge_l(label, pred_at.get(pos)) for pos, label in gold_at.items()]
    return {
        "id": case["id"],
        "score": round(sum(WEIGHTS[k] * v for k, v in comp.items()), 4),
        "components": comp,
        "reasons": reasons,
        "n_messages": len(messages),
        "n_gold_chunks": len(gold_chunks),
        "n_pred_chunks": n_pred,
        "anchor_repairs": repairs,
        "boundary": boundary_prf(gold_b, pred_b),
        "pk": pk_v,
        "windowdiff": wd_v,
        "rouge_l": sum(rl) / len(rl) if rl else 0.0,
    }


def _mean(values: list[Any], digits: int = 4) -> float | None:
    """Mean of the finite numbers in `values` (None, NaN and non-numbers left out)."""
    vals = [v for v in map(finite, values) if v is not None]
    return round(sum(vals) / len(vals), digits) if vals else None


def _show(value: Any) -> str:
    """A short printable form of an id for warnings (ids may be megabytes long)."""
    text = str(value)
    return repr(text[:60] + "…") if len(text) > 60 else repr(text)


def index_predictions(preds: list[Any], where: list[str], case_ids: set[str],
                      warnings: list[str]) -> tuple[dict[str, Any], int]:
    """({case id: first prediction row}, duplicate rows); reports odd, duplicate and unknown
    rows in `warnings`."""
    lines: dict[str, list[int]] = {}
    for i, p in enumerate(preds):
        pid = p.get("id") if isinstance(p, dict) else None
        if not isinstance(p, dict):
            warnings.append(f"{where[i]}: prediction is not a JSON object; ignored")
        elif isinstance(pid, bool) or not isinstance(pid, (str, int)):
            warnings.append(f"{where[i]}: prediction has no string or integer id; ignored")
        else:
            lines.setdefault(str(pid), []).append(i)
    n_duplicates = 0
    for pid, rows in lines.items():
        if len(rows) > 1:
            n_duplicates += len(rows) - 1
            warnings.append(f"duplicate prediction id {_show(pid)} at "
                            f"{', '.join(where[i] for i in rows[:10])}"
                            f"{' …' if len(rows) > 10 else ''}; the first is scored")
        if pid not in case_ids:
            warnings.append(f"{where[rows[0]]}: prediction id {_show(pid)} is not a gold case; "
                            "ignored")
    return {pid: preds[rows[0]] for pid, rows in lines.items()}, n_duplicates


def _cap(warnings: list[str]) -> list[str]:
    if len(warnings) <= MAX_WARNINGS:
        return warnings
    return [*warnings[:MAX_WARNINGS], f"… and {len(warnings) - MAX_WARNINGS} more warnings"]


def score_predictions(cases: list[dict], preds: list[Any], where: list[str] | None = None,
                      warnings: list[str] | None = None) -> dict:
    """Summary over all cases; a case without a prediction scores 0 ('missing prediction').

    `where[i]` says where preds[i] came from (e.g. 'file:line') for warnings; `warnings` are
    earlier ones (from reading the file) to report with the summary's own."""
    where = where if where is not None else [f"prediction {i + 1}" for i in range(len(preds))]
    warnings = list(warnings or [])
    case_ids = {str(c["id"]) for c in cases}
    by_id, n_duplicates = index_predictions(preds, where, case_ids, warnings)
    rows = []
    for case in cases:
        pred = by_id.get(str(case["id"]))
        row = score_case(case, pred.get("text") if pred else None)
        if pred is None:
            row["reasons"] = ["missing prediction"]
        row["generated_tokens"] = finite(pred.get("generated_tokens")) if pred else None
        rows.append(row)
    missing = [str(c["id"]) for c in cases if str(c["id"]) not in by_id]
    if missing:
        shown = ", ".join(_show(m) for m in missing[:10]) + (" …" if len(missing) > 10 else "")
        warnings.append(f"{len(missing)} gold case(s) have no prediction and score 0: {shown}")
    comp = {k: [r["components"][k] for r in rows] for k in WEIGHTS}
    return {
        "n": len(rows),
        "n_missing": len(missing),
        "n_extra_predictions": sum(i not in case_ids for i in by_id),
        "n_duplicate_predictions": n_duplicates,
        "weights": WEIGHTS,
        "mean_score": _mean([r["score"] for r in rows], 2),
        "valid_json_rate": _mean(comp["json"]),
        "schema_rate": _mean(comp["schema"]),
        "anchor_rate": _mean(comp["anchors"]),
        "label_rate": _mean(comp["labels"]),
        "nonempty_rate": _mean(comp["nonempty"]),
        "boundary_precision": _mean([r["boundary"]["precision"] for r in rows]),
        "boundary_recall": _mean([r["boundary"]["recall"] for r in rows]),
        "boundary_f1": _mean([r["boundary"]["f1"] for r in rows]),
        "pk": _mean([r["pk"] for r in rows]),
        "windowdiff": _mean([r["windowdiff"] for r in rows]),
        "rouge_l": _mean([r["rouge_l"] for r in rows]),
        "mean_generated_tokens": _mean([r["generated_tokens"] for r in rows], 1),
        "anchor_repairs": sum(r["anchor_repairs"] for r in rows),
        "warnings": _cap(warnings),
        "cases": rows,
    }


def _read_bytes(path: str | Path, what: str, hint: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise InputError(f"{what} file {path} does not exist. {hint}") from None
    except OSError as e:
        raise InputError(f"cannot read {what} file {path} ({e.strerror or e}). {hint}") from None


def _lines(data: bytes) -> list[tuple[int, bytes]]:
    """(1-based line number, bytes) of the non-blank lines; a leading BOM is dropped."""
    if data.startswith(codecs.BOM_UTF8):
        data = data[len(codecs.BOM_UTF8):]
    return [(n, raw) for n, raw in enumerate(data.split(b"\n"), 1) if raw.strip()]


def load_predictions(path: str | Path) -> tuple[list[Any], list[str], list[str]]:
    """(rows, 'file:line' of each row, warnings). Bad bytes are replaced and reported, lines
    that are not JSON are skipped and reported: one bad line never loses the other scores."""
    rows, where, warnings = [], [], []
    lines = _lines(_read_bytes(path, "predictions", PREDS_HINT))
    for n, raw in lines:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            text = raw.decode("utf-8", errors="replace")
            warnings.append(f"{path}:{n}: not valid UTF-8 (byte {e.start}); bad bytes replaced "
                            "by U+FFFD and the line scored")
        try:
            rows.append(json.loads(text))
        except (ValueError, RecursionError) as e:
            why = getattr(e, "msg", None) or type(e).__name__
            warnings.append(f"{path}:{n}: not a JSON line ({why}); skipped")
            continue
        where.append(f"{path}:{n}")
    if not lines:
        warnings.append(f"{path}: no predictions; every case counts as missing")
    return rows, where, warnings


def read_predictions(path: str | Path) -> list[Any]:
    """Prediction rows; unreadable lines are skipped (their cases then count as missing)."""
    return load_predictions(path)[0]


def case_problem(case: Any) -> str | None:
    """Why `case` is not a gold case the scorer can use, or None."""
    if not isinstance(case, dict):
        return f"expected a JSON object, got {type(case).__name__}"
    if isinstance(case.get("id"), bool) or not isinstance(case.get("id"), (str, int)):
        return "the case has no string or integer `id`"
    messages = case.get("transcript", case.get("messages"))
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("id"), str) for m in messages):
        return "`transcript` (or `messages`) must be a list of messages with string ids"
    chunks = case.get("gold", {}).get("chunks") if isinstance(case.get("gold"), dict) else None
    if not isinstance(chunks, list) or not all(
            isinstance(c, dict) and isinstance(c.get("anchor"), str)
            and isinstance(c.get("label"), str) for c in chunks):
        return "`gold.chunks` must be a list of {anchor, label} strings"
    ids = {m["id"] for m in messages}
    unknown = [c["anchor"] for c in chunks if c["anchor"] not in ids]
    if unknown:
        return f"gold anchor {_show(unknown[0])} is not a message id of the case"
    return None


def read_cases(path: str | Path) -> list[dict]:
    """The gold cases; any problem is an InputError naming file:line (gold data is ours, so
    it must be right, unlike model output)."""
    cases, first_line = [], {}
    for n, raw in _lines(_read_bytes(path, "gold cases", CASES_HINT)):
        at = f"{path}:{n}"
        try:
            case = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise InputError(f"{at}: not UTF-8 (byte {e.start}). {CASES_HINT}") from None
        except (ValueError, RecursionError) as e:
            why = getattr(e, "msg", None) or type(e).__name__
            raise InputError(f"{at}: not a JSON line ({why}). {CASES_HINT}") from None
        problem = case_problem(case)
        if problem:
            raise InputError(f"{at}: {problem}. {CASES_HINT}")
        key = str(case["id"])
        if key in first_line:
            raise InputError(f"{at}: case id {_show(key)} repeats line {first_line[key]}; "
                             f"case ids must be unique. {CASES_HINT}")
        first_line[key] = n
        cases.append(case)
    if not cases:
        raise InputError(f"{path}: no cases in the file. {CASES_HINT}")
    return cases


def to_json(summary: dict) -> str:
    """Strict JSON: a NaN or Infinity here is a bug, so it raises instead of being written."""
    return json.dumps(summary, indent=2, allow_nan=False) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", required=True, help="cases JSONL (raw or filtered)")
    parser.add_argument("--pred", required=True, help="predictions JSONL from `segback generate`")
    parser.add_argument("--out", required=True, help="summary JSON")


def main(args: argparse.Namespace) -> int:
    try:
        cases = read_cases(args.data)
        preds, where, warnings = load_predictions(args.pred)
    except InputError as e:
        raise SystemExit(f"segback score: {e}") from None
    summary = score_predictions(cases, preds, where, warnings)
    for warning in summary["warnings"]:
        print(f"segback score: warning: {warning}", file=sys.stderr)
    try:
        atomic_write_text(args.out, to_json(summary))
    except OSError as e:
        raise SystemExit(f"segback score: cannot write {args.out} ({e.strerror or e}); "
                         "check that --out names a writable path.") from None
    print(f"segback score: {summary['n']} cases, mean score {summary['mean_score']}, "
          f"valid JSON {summary['valid_json_rate']}, boundary F1 {summary['boundary_f1']}",
          file=sys.stderr)
    return 0
