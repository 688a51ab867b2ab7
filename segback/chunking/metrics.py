"""Segmentation quality beside the score, over placed chunks only.

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

nltk and rouge-score (which loads nltk) are the `experiment` extra's, so they load on first use.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

ROUGE_CHARS = 400


@lru_cache(maxsize=1)
def rouge() -> Any:
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)


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


def rouge_l(gold_label: str, pred_label: Any) -> float:
    if not isinstance(pred_label, str):
        return 0.0
    return rouge().score(gold_label, pred_label[:ROUGE_CHARS])["rougeL"].fmeasure
