"""Scorer: every failure kind scores without crashing, gold scores 100, empty scores 0."""

import json
from pathlib import Path

import pytest

from segback.chunking.prompt import gold_completion
from segback.chunking.scorer import extract_json, score_case, score_predictions

FIXTURE = Path(__file__).parent / "fixtures" / "chunking_cases.jsonl"


@pytest.fixture(scope="module")
def cases():
    return [json.loads(line) for line in FIXTURE.read_text().splitlines()]


@pytest.fixture(scope="module")
def case(cases):
    return cases[2]  # 4 gold chunks over 9 messages


def answer(chunks):
    return json.dumps({"chunks": [{"anchor": a, "label": lbl} for a, lbl in chunks]})


def gold_pairs(case):
    return [(c["anchor"], c["label"]) for c in case["gold"]["chunks"]]


def test_gold_scores_100_with_f1_1(cases):
    for c in cases:
        row = score_case(c, gold_completion(c))
        assert row["score"] == 100
        assert row["boundary"]["f1"] == 1.0
        assert row["pk"] == 0.0 and row["windowdiff"] == 0.0
        assert row["rouge_l"] == pytest.approx(1.0)
        assert row["reasons"] == []


@pytest.mark.parametrize("text", ["", "   \n", None])
def test_empty_scores_0(case, text):
    row = score_case(case, text)
    assert row["score"] == 0
    assert row["reasons"] == ["empty output"]
    assert row["boundary"]["f1"] == 0.0
    assert row["rouge_l"] == 0.0


def test_garbage(case):
    row = score_case(case, "I think the conversation is about bread and cats.")
    assert row["score"] == 0 and row["reasons"] == ["no JSON object"]
    row = score_case(case, "}{ ]] {{ not json at all }")
    assert row["score"] == 0 and row["reasons"][0].startswith("invalid or truncated JSON")


def test_truncated_json_is_invalid(case):
    text = gold_completion(case)[:-20]
    row = score_case(case, text)
    assert row["components"]["json"] == 0 and row["score"] == 0
    assert "truncated" in row["reasons"][0]


def test_fenced_json_with_prose(case):
    text = f"Sure! Here are the chunks:\n```json\n{gold_completion(case)}\n```\nHope this helps."
    row = score_case(case, text)
    assert row["score"] == 100 and row["boundary"]["f1"] == 1.0


def test_nan_is_not_json(case):
    row = score_case(case, '{"chunks": NaN}')
    assert row["score"] == 0 and "NaN is not valid JSON" in row["reasons"][0]


def test_first_object_with_chunks_wins():
    obj, why = extract_json('note {"a": 1} then {"chunks": []} and {"chunks": [1]}')
    assert why is None and obj == {"chunks": []}


def test_wrong_types(case):
    row = score_case(case, json.dumps({"chunks": "several"}))
    assert row["components"] == {"json": 1, "schema": 0, "anchors": 0, "labels": 0,
                                 "nonempty": 0}
    assert row["score"] == 30
    assert row["reasons"][0].startswith("schema:")
    anchors = [a for a, _ in gold_pairs(case)]
    items = [{"anchor": anchors[0], "label": "Cats"}, {"anchor": 7, "label": ["x"]}, "chunk"]
    row = score_case(case, json.dumps({"chunks": items}))
    assert row["components"]["schema"] == 0
    assert row["components"]["anchors"] == pytest.approx(1 / 3)
    assert row["components"]["labels"] == pytest.approx(1 / 3)
    assert row["components"]["nonempty"] == 1
    row = score_case(case, json.dumps([{"anchor": anchors[0], "label": "x"}]))
    assert row["components"]["json"] == 1 and row["components"]["schema"] == 0


def test_duplicate_anchors(case):
    pairs = gold_pairs(case)
    pairs[2] = (pairs[1][0], "Another title")
    row = score_case(case, answer(pairs))
    assert row["components"]["anchors"] == 0.75
    assert row["components"]["schema"] == 1
    assert "1 x duplicate anchor" in row["reasons"]
    assert row["score"] == pytest.approx(100 - 25 * 0.25)
    assert row["boundary"]["recall"] == pytest.approx(2 / 3)


def test_unknown_anchors(case):
    pairs = gold_pairs(case)
    pairs[1] = ("00000000-0000-0000-0000-000000000000", pairs[1][1])
    pairs[3] = ("msg-3", pairs[3][1])
    row = score_case(case, answer(pairs))
    assert row["components"]["anchors"] == 0.5
    assert "2 x unknown anchor" in row["reasons"]
    assert row["boundary"]["precision"] == 1.0
    assert row["boundary"]["recall"] == pytest.approx(1 / 3)
    assert row["rouge_l"] == pytest.approx(0.5)


def test_prefix_and_bracket_repairs(case):
    pairs = gold_pairs(case)
    pairs[1] = (pairs[1][0][:8], pairs[1][1])
    pairs[2] = (f"[{pairs[2][0].upper()}]", pairs[2][1])
    row = score_case(case, answer(pairs))
    assert row["score"] == 100 and row["anchor_repairs"] == 2
    assert "2 x anchor repaired" in row["reasons"]
    assert row["boundary"]["f1"] == 1.0


def test_too_short_prefix_is_not_repaired(case):
    pairs = gold_pairs(case)
    pairs[1] = (pairs[1][0][:2], pairs[1][1])
    row = score_case(case, answer(pairs))
    assert row["components"]["anchors"] == 0.75


def test_long_empty_and_duplicate_labels(case):
    pairs = gold_pairs(case)
    pairs[0] = (pairs[0][0], "one two three four five six seven eight nine")
    pairs[1] = (pairs[1][0], "  ")
    pairs[3] = (pairs[3][0], pairs[2][1].upper())
    row = score_case(case, answer(pairs))
    assert row["components"]["labels"] == 0.25
    assert {"1 x label over 8 words", "1 x empty label", "1 x duplicate label"} <= set(
        row["reasons"])
    assert row["score"] == pytest.approx(100 - 15 * 0.75)


def test_empty_chunk_list(case):
    row = score_case(case, '{"chunks": []}')
    assert row["components"] == {"json": 1, "schema": 1, "anchors": 0, "labels": 0,
                                 "nonempty": 0}
    assert row["score"] == 50 and "no chunks" in row["reasons"]
    assert row["boundary"]["precision"] == 0.0 and row["pk"] is not None


def test_single_chunk_prediction_has_window_metrics(case):
    row = score_case(case, answer(gold_pairs(case)[:1]))
    assert row["score"] == 100  # well-formed, just under-segmented
    assert row["boundary"]["recall"] == 0.0
    assert row["pk"] > 0 and row["windowdiff"] > 0


def test_degenerate_short_case():
    short = {"id": "s", "messages": [{"id": "m0", "role": "user", "content": "hi"}],
             "gold": {"chunks": [{"anchor": "m0", "label": "Greeting"}]}}
    row = score_case(short, '{"chunks": [{"anchor": "m0", "label": "Greeting"}]}')
    assert row["score"] == 100 and row["pk"] is None and row["boundary"]["f1"] == 1.0


def test_summary(cases):
    preds = [
        {"id": cases[0]["id"], "text": gold_completion(cases[0]), "generated_tokens": 10},
        {"id": cases[1]["id"], "text": "garbage", "generated_tokens": 30},
        {"id": "not-a-case", "text": ""},
        "not a row",
    ]
    s = score_predictions(cases, preds)
    assert s["n"] == 3 and s["n_missing"] == 1 and s["n_extra_predictions"] == 1
    assert s["mean_score"] == pytest.approx(100 / 3, abs=0.01)
    assert s["valid_json_rate"] == pytest.approx(1 / 3, abs=1e-4)
    assert s["mean_generated_tokens"] == 20
    assert s["cases"][2]["reasons"] == ["missing prediction"]
    for key in ("schema_rate", "anchor_rate", "label_rate", "nonempty_rate", "boundary_precision",
                "boundary_recall", "boundary_f1", "pk", "windowdiff", "rouge_l"):
        assert key in s
    json.dumps(s)  # serialisable
