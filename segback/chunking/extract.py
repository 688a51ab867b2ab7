"""Pull the answer's JSON object out of model text; never crashes, bounded work.

```json fences and prose around the object are tolerated; the first object with a "chunks" key
wins, else the first complete object. Strict JSON only: NaN, Infinity and numbers that overflow
to infinity are invalid, and so is nesting deeper than MAX_DEPTH levels.

Only the first MAX_TEXT_CHARS characters of an answer are examined, at most MAX_FENCES fenced
blocks and MAX_STARTS '{' positions per block are tried, and the decoder may run over at most
MAX_SCAN_CHARS characters in all; no regular expressions are used on the answer.
"""

from __future__ import annotations

import gc
import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

MAX_TEXT_CHARS = 8_000_000
MAX_FENCES = 16
MAX_STARTS = 256  # '{' positions tried per block
MAX_SCAN_CHARS = 16_000_000  # characters the decoder may run over, all attempts together
MAX_DEPTH = 64


def reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    """JSON numbers like 1e999 would become inf, which strict JSON cannot hold."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:20]} is out of range")
    return value


_DECODER = json.JSONDecoder(parse_constant=reject_constant, parse_float=_finite_float)


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
