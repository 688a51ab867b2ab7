"""The scorer's two input files: the gold cases and the predictions, both JSONL.

Gold data is ours, so any problem in it is an InputError naming file:line. The predictions file
is model output: read as bytes, one JSON object per line; a line that is not UTF-8 has its bad
bytes replaced (U+FFFD) and is still scored, a line that is not JSON is skipped; both are
reported as 'file:line' warnings.
"""

from __future__ import annotations

import codecs
import json
from pathlib import Path
from typing import Any

CASES_HINT = ("--data must be a cases JSONL file (one JSON object per line) from "
              "`segback build-data` or `segback filter-data`; rebuild it or pass the right path.")
PREDS_HINT = "--pred must be the predictions JSONL written by `segback generate`."


class InputError(ValueError):
    """A bad gold or predictions file; the message names the file (and line) and the fix."""


def show_id(value: Any) -> str:
    """A short printable form of an id for warnings (ids may be megabytes long)."""
    text = str(value)
    return repr(text[:60] + "…") if len(text) > 60 else repr(text)


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
        return f"gold anchor {show_id(unknown[0])} is not a message id of the case"
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
            raise InputError(f"{at}: case id {show_id(key)} repeats line {first_line[key]}; "
                             f"case ids must be unique. {CASES_HINT}")
        first_line[key] = n
        cases.append(case)
    if not cases:
        raise InputError(f"{path}: no cases in the file. {CASES_HINT}")
    return cases
