"""Place an answer's chunks in the transcript: resolve anchors, keep transcript order, check labels.

A chunk is *placed* when its anchor names a transcript message (exactly, or after a repair:
surrounding brackets/quotes/spaces, case, a unique prefix of >= MIN_PREFIX characters, or
exactly one message id inside an anchor of at most MAX_ANCHOR_CHARS characters; repairs are
counted) and it is in transcript order. Order: of the chunks whose anchors resolve, the longest
run (subsequence) with strictly increasing message positions is placed, preferring earlier
chunks on ties; the others fail as 'duplicate anchor' (same message as a placed chunk) or
'anchor out of order'. Unknown and ambiguous anchors fail. Entries after the first MAX_CHUNKS
are not examined.

A label is good when it is a non-empty string of at most MAX_LABEL_WORDS words and
MAX_LABEL_CHARS characters (stripped), distinct (case-insensitively) from the labels before it.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

MAX_LABEL_WORDS = 8
MAX_LABEL_CHARS = 100  # gold labels (8 words from make_label) are well under this
MIN_PREFIX = 4
MAX_ANCHOR_CHARS = 200  # longer anchors are not repaired: a message id is at most 36 characters
MAX_CHUNKS = 1000  # also the schema's maxItems


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
