"""Scorer: every failure kind scores without crashing, gold scores 100, empty scores 0."""

import argparse
import json
import time
from pathlib import Path

import pytest

from segback.chunking import extract, inputs, metrics, placement, scorer
from segback.chunking.extract import extract_json
from segback.chunking.prompt import gold_completion
from segback.chunking.scorer import score_case, score_predictions

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
    # the duplicate chunk is not placed, so its label earns nothing either (it used to)
    assert row["components"]["labels"] == 0.75
    assert row["components"]["schema"] == 1
    assert "1 x duplicate anchor" in row["reasons"]
    assert row["score"] == pytest.approx(100 - 25 * 0.25 - 15 * 0.25)
    assert row["boundary"]["recall"] == pytest.approx(2 / 3)


def test_unknown_anchors(case):
    pairs = gold_pairs(case)
    pairs[1] = ("00000000-0000-0000-0000-000000000000", pairs[1][1])
    pairs[3] = ("msg-3", pairs[3][1])
    row = score_case(case, answer(pairs))
    assert row["components"]["anchors"] == 0.5
    assert row["components"]["labels"] == 0.5  # labels of unplaced chunks earn nothing
    assert row["score"] == pytest.approx(30 + 20 + 12.5 + 7.5 + 10)
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


# --- the scoring rules cannot be gamed ---------------------------------------------------------

def test_all_unknown_anchors_earn_only_json_and_schema(case):
    pairs = [(f"msg-{i}", label) for i, (_, label) in enumerate(gold_pairs(case))]
    row = score_case(case, answer(pairs))
    assert row["components"] == {"json": 1, "schema": 1, "anchors": 0, "labels": 0,
                                 "nonempty": 0}
    assert row["score"] == 50  # was 75: labels and a non-empty list of nothing earned points
    assert "4 x unknown anchor" in row["reasons"]
    assert "no chunk placed in the transcript" in row["reasons"]
    assert row["boundary"]["precision"] == 0.0 and row["rouge_l"] == 0.0


def test_reversed_anchors_place_one_chunk(case):
    pairs = gold_pairs(case)[::-1]
    row = score_case(case, answer(pairs))
    assert row["components"]["anchors"] == 0.25 and row["components"]["labels"] == 0.25
    assert row["components"]["nonempty"] == 1
    assert row["score"] == pytest.approx(30 + 20 + 25 / 4 + 15 / 4 + 10)
    assert "3 x anchor out of order" in row["reasons"]
    # the first chunk of the answer (the gold's last) is the one placed
    assert row["boundary"] == {"precision": 1.0, "recall": pytest.approx(1 / 3),
                               "f1": pytest.approx(0.5)}


def test_one_swapped_anchor_loses_one_chunk(case):
    g = gold_pairs(case)
    row = score_case(case, answer([g[0], g[2], g[1], g[3]]))
    assert row["components"]["anchors"] == 0.75 and row["components"]["labels"] == 0.75
    assert "1 x anchor out of order" in row["reasons"]
    assert row["score"] == pytest.approx(100 - 25 / 4 - 15 / 4)
    assert row["boundary"]["precision"] == 1.0
    assert row["boundary"]["recall"] == pytest.approx(2 / 3)


@pytest.mark.parametrize("positions, keep", [
    ([], []),
    ([0, 1, 2], [True, True, True]),
    ([2, 1, 0], [True, False, False]),
    ([3, 1, 2, 2, 5], [False, True, True, False, True]),
    ([0, 5, 1, 2, 3], [True, False, True, True, True]),
    ([1, 1, 1], [True, False, False]),
])
def test_in_order_keeps_longest_increasing_run(positions, keep):
    assert placement.in_order(positions) == keep


@pytest.mark.parametrize("label, problem", [
    ("x" * 5_000_000, "label over 100 characters"),
    ("word " * 3 + "y" * 90, "label over 100 characters"),
    ("one two three four five six seven eight nine", "label over 8 words"),
    ({"title": "Cats"}, "label not a string"),
])
def test_long_labels_are_invalid(case, label, problem):
    pairs = gold_pairs(case)
    pairs[1] = (pairs[1][0], label)
    items = [{"anchor": a, "label": lbl} for a, lbl in pairs]
    row = score_case(case, json.dumps({"chunks": items}))
    assert row["components"]["labels"] == 0.75
    assert f"1 x {problem}" in row["reasons"]
    assert row["components"]["anchors"] == 1 and row["components"]["json"] == 1
    assert 0 <= row["rouge_l"] < 1


def test_label_at_the_character_cap_is_valid(case):
    pairs = gold_pairs(case)
    pairs[1] = (pairs[1][0], "  " + "a" * 100 + "\n")  # stripped length counts
    assert score_case(case, answer(pairs))["score"] == 100


# --- bounded time ------------------------------------------------------------------------------

N = 5_000_000


def _big_label(case):
    obj = json.loads(gold_completion(case))
    obj["chunks"][1]["label"] = "x" * N
    return json.dumps(obj)


def _many_chunks(case):
    return json.dumps({"chunks": json.loads(gold_completion(case))["chunks"][:1] * (N // 60)})


# name: (answer of about 5 MB for the case, expected score or None)
PATHOLOGICAL = {
    "unterminated string": (lambda c: '{"a": "' + "{" * N, 0),
    "nested objects": (lambda c: '{"a":' * (N // 5), 0),
    "open brackets": (lambda c: "[" * N, 0),
    "open braces": (lambda c: "{" * N, 0),
    "fences": (lambda c: "```" * (N // 3), 0),
    "unclosed fence": (lambda c: '```json\n{"chunks": [' + '{"anchor": "x", ' * (N // 16), 0),
    "many small objects": (lambda c: '{"x": 1} ' * (N // 9), 30),
    "five megabyte label": (_big_label, 100 - 15 / 4),
    "many chunks": (_many_chunks, None),
    "many lists": (lambda c: '{"chunks":[' + "[]," * (N // 3) + "[]]}", 30),
    "escaped quotes": (lambda c: '{"a": "' + '\\"' * (N // 2), 0),
}


@pytest.mark.parametrize("kind", list(PATHOLOGICAL))
def test_five_megabyte_answers_score_fast(case, kind):
    score_case(case, gold_completion(case))  # load jsonschema, rouge and nltk first
    build, expected = PATHOLOGICAL[kind]
    text = build(case)
    assert len(text) >= 4_800_000
    tic = time.perf_counter()
    row = score_case(case, text)
    seconds = time.perf_counter() - tic
    assert seconds < 2.0, f"{kind}: {seconds:.2f} s"  # 0.01-0.5 s here; 'many lists' took 73 s
    if expected is not None:
        assert row["score"] == pytest.approx(expected)
    assert 0 <= row["score"] <= 100


def test_many_chunks_fail_schema_and_are_not_all_examined(case):
    g = gold_pairs(case)
    row = score_case(case, answer(g * 300))  # 1,200 chunks, only the first 4 can be placed
    assert row["components"]["schema"] == 0
    assert row["reasons"][0].startswith("schema: 1200 chunks, more than the 1000 allowed")
    assert "200 x chunk after the first 1000" in row["reasons"]
    assert row["components"]["anchors"] == pytest.approx(4 / 1200)
    assert row["boundary"]["f1"] == 1.0


def test_schema_max_items_matches_scorer():
    schema = json.loads(scorer.SCHEMA_PATH.read_text())
    assert schema["properties"]["chunks"]["maxItems"] == placement.MAX_CHUNKS


def test_fenced_blocks_are_bounded():
    blocks = extract.fenced_blocks("```a``` ``` b ```" * 100 + "```open")
    assert len(blocks) == extract.MAX_FENCES and blocks[:2] == ["a", " b "]
    assert extract.fenced_blocks("no fences ``` here") == []


# --- malformed answers get the points their parts earn ------------------------------------------

def test_deep_nesting_does_not_recurse(case):
    for text in ["[" * 100_000, "{" + '"a":[' * 100_000, '{"chunks": ' + "[" * 100_000 + "]"]:
        row = score_case(case, text)
        assert row["score"] == 0
    row = score_case(case, '{"chunks": [' + "[" * 100_000 + "]" * 100_000 + "]}")
    assert row["score"] == 0 and "nested deeper" in row["reasons"][0]
    obj, why = extract_json('{"chunks": ' + "[" * 64 + "]" * 64 + "}")
    assert obj is None and why == "invalid JSON (nested deeper than 64 levels)"
    row = score_case(case, '{"chunks": ' + "[" * 62 + "]" * 62 + "}")  # 63 levels: parsed
    assert row["components"]["json"] == 1 and row["components"]["schema"] == 0
    assert row["score"] == 30


@pytest.mark.parametrize("extra", ["NaN", "Infinity", "-Infinity", "1e999", "1" * 5000])
def test_non_finite_numbers_are_invalid_json(case, extra):
    text = gold_completion(case)[:-1] + f', "confidence": {extra}}}'
    row = score_case(case, text)
    assert row["components"]["json"] == 0 and row["score"] == 0
    assert row["reasons"][0].startswith("invalid or truncated JSON")
    json.dumps(row, allow_nan=False)


def test_json_with_prose_around_it(case):
    text = f"The chunks are {gold_completion(case)} -- done. {{not json}}"
    assert score_case(case, text)["score"] == 100


def test_wrong_types_everywhere(case):
    anchors = [a for a, _ in gold_pairs(case)]
    row = score_case(case, json.dumps({"chunks": {"anchor": anchors[0], "label": "x"}}))
    assert row["score"] == 30 and row["n_pred_chunks"] == 0
    items = [{"anchor": anchors[0], "label": {"t": "Cats"}}, {"anchor": 12, "label": "Bread"},
             {"anchor": None}, [anchors[1]], {"anchor": anchors[2], "label": "Fine"}]
    row = score_case(case, json.dumps({"chunks": items}))
    assert row["components"] == {"json": 1, "schema": 0, "anchors": pytest.approx(2 / 5),
                                 "labels": pytest.approx(1 / 5), "nonempty": 1}
    assert {"2 x anchor not a string", "1 x chunk not an object", "2 x label not a string",
            } <= set(row["reasons"])
    assert score_case(case, 12345)["reasons"] == ["text is not a string: int"]


def test_megabyte_anchor(case):
    pairs = gold_pairs(case)
    pairs[1] = (pairs[1][0] + " " * 1_000_000, pairs[1][1])
    row = score_case(case, answer(pairs))
    assert row["components"]["anchors"] == 0.75
    assert "1 x anchor over 200 characters" in row["reasons"]


# --- predictions files and the CLI --------------------------------------------------------------

def _run(tmp_path, cases, pred_bytes, capsys):
    data, pred, out = tmp_path / "test.jsonl", tmp_path / "pred.jsonl", tmp_path / "score.json"
    data.write_text("".join(json.dumps(c) + "\n" for c in cases))
    pred.write_bytes(pred_bytes)
    assert scorer.main(argparse.Namespace(data=str(data), pred=str(pred), out=str(out))) == 0
    text = out.read_text()
    summary = json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in score.json"))
    return summary, capsys.readouterr().err, str(pred)


def _line(case, text, **extra):
    return (json.dumps({"id": case["id"], "text": text, **extra}) + "\n").encode()


def test_non_utf8_bytes_lose_nothing_but_are_reported(tmp_path, cases, capsys):
    bad = _line(cases[1], "X " + gold_completion(cases[1])).replace(b'"X ', b'"\xff ', 1)
    latin1 = _line(cases[2], "caf\u00e9 " + gold_completion(cases[2])).replace(
        b"caf\\u00e9", "café".encode("latin-1"))  # a Latin-1 byte in a UTF-8 file
    lines = _line(cases[0], gold_completion(cases[0])) + bad + latin1
    summary, err, pred = _run(tmp_path, cases, lines, capsys)
    assert [r["score"] for r in summary["cases"]] == [100, 100, 100]
    assert summary["n_missing"] == 0
    assert summary["warnings"] == [
        f"{pred}:{n}: not valid UTF-8 (byte {line.index(byte)}); bad bytes replaced by U+FFFD "
        "and the line scored" for n, line, byte in [(2, bad, b"\xff"), (3, latin1, b"\xe9")]]
    assert all(w in err for w in summary["warnings"])


def test_non_utf8_byte_in_a_key_scores_that_case_as_empty(tmp_path, cases, capsys):
    bad = _line(cases[1], gold_completion(cases[1])).replace(b'"text"', b'"te\xffxt"', 1)
    summary, err, pred = _run(tmp_path, cases, bad, capsys)
    assert summary["cases"][1]["reasons"] == ["empty output"]  # the row has no "text" now
    assert f"{pred}:1: not valid UTF-8" in err and summary["n_missing"] == 2


def test_duplicate_unknown_and_missing_predictions(tmp_path, cases, capsys):
    c0, c1 = cases[0], cases[1]
    lines = (_line(c0, gold_completion(c0), generated_tokens=10) + b"not json\n"
             + _line(c0, "garbage") + _line({"id": "nope"}, "")
             + _line(c1, "garbage", generated_tokens=float("nan")) + _line(c0, "x")
             + b"[1, 2]\n")
    summary, err, pred = _run(tmp_path, cases, lines, capsys)
    assert summary["cases"][0]["score"] == 100  # the first of the duplicates is scored
    assert summary["n_duplicate_predictions"] == 2
    assert summary["n_extra_predictions"] == 1 and summary["n_missing"] == 1
    assert summary["mean_generated_tokens"] == 10  # the NaN is left out, not written
    assert summary["cases"][1]["generated_tokens"] is None
    assert summary["cases"][2]["score"] == 0
    expected = [
        f"{pred}:2: not a JSON line (Expecting value); skipped",
        f"{pred}:7: prediction is not a JSON object; ignored",
        f"duplicate prediction id '{c0['id']}' at {pred}:1, {pred}:3, {pred}:6; "
        "the first is scored",
        f"{pred}:4: prediction id 'nope' is not a gold case; ignored",
        f"1 gold case(s) have no prediction and score 0: '{cases[2]['id']}'",
    ]
    assert summary["warnings"] == expected
    assert all(w in err for w in expected)


def test_empty_predictions_file(tmp_path, cases, capsys):
    summary, err, pred = _run(tmp_path, cases, b"", capsys)
    assert summary["n_missing"] == 3 and summary["mean_score"] == 0
    assert summary["warnings"][0] == f"{pred}: no predictions; every case counts as missing"
    assert summary["boundary_f1"] == 0 and summary["rouge_l"] == 0
    assert all(r["reasons"] == ["missing prediction"] for r in summary["cases"])


def test_summary_is_strict_json_and_means_skip_undefined(cases):
    short = {"id": "s", "messages": [{"id": "m0", "role": "user", "content": "hi"}],
             "gold": {"chunks": [{"anchor": "m0", "label": "Greeting"}]}}
    preds = [{"id": "s", "text": gold_completion(short), "generated_tokens": 10 ** 400},
             {"id": cases[2]["id"], "text": gold_completion(cases[2]), "generated_tokens": 7}]
    s = score_predictions([short, cases[2]], preds)
    assert s["cases"][0]["pk"] is None and s["pk"] == 0.0  # mean over the defined case only
    assert s["mean_generated_tokens"] == 7 and s["cases"][0]["generated_tokens"] is None
    assert [metrics.finite(v) for v in (3, 2.5, float("inf"), float("nan"), True, "1")] == [
        3, 2.5, None, None, None, None]
    scorer.to_json(s)  # raises on NaN/Infinity
    with pytest.raises(ValueError):
        scorer.to_json({"x": float("nan")})


def test_warnings_are_capped():
    cases = [{"id": "c", "messages": [{"id": "m0", "role": "user", "content": "hi"}],
              "gold": {"chunks": [{"anchor": "m0", "label": "Hi"}]}}]
    s = score_predictions(cases, [{"id": f"x{i}"} for i in range(150)])
    assert len(s["warnings"]) == scorer.MAX_WARNINGS + 1
    assert s["warnings"][-1] == "… and 51 more warnings"


@pytest.mark.parametrize("content, message", [
    (None, "gold cases file {data} does not exist."),
    (b'{"id": "a"}\nnot json\n', "{data}:1: `transcript` (or `messages`) must be a list"),
    (b"\n\nnot json\n", "{data}:3: not a JSON line (Expecting value)."),
    (b"\xff\n", "{data}:1: not UTF-8 (byte 0)."),
    (b"", "{data}: no cases in the file."),
])
def test_bad_gold_file_exits_with_a_message(tmp_path, cases, content, message):
    data, pred = tmp_path / "test.jsonl", tmp_path / "pred.jsonl"
    if content is not None:
        data.write_bytes(content)
    pred.write_text("")
    args = argparse.Namespace(data=str(data), pred=str(pred), out=str(tmp_path / "s.json"))
    with pytest.raises(SystemExit) as e:
        scorer.main(args)
    text = str(e.value.code)
    assert text.startswith("segback score: " + message.format(data=data))
    assert "segback build-data" in text and "\n" not in text
    assert not (tmp_path / "s.json").exists()


def test_bad_gold_case_content(tmp_path, cases):
    bad = dict(cases[0], gold={"chunks": [{"anchor": "nope", "label": "x"}]})
    data = tmp_path / "test.jsonl"
    data.write_text(json.dumps(cases[1]) + "\n" + json.dumps(bad) + "\n" + json.dumps(cases[1]))
    with pytest.raises(inputs.InputError, match=r"test.jsonl:2: gold anchor 'nope' is not"):
        inputs.read_cases(data)
    data.write_text(json.dumps(cases[1]) + "\n" + json.dumps(cases[1]) + "\n")
    with pytest.raises(inputs.InputError, match=r"test.jsonl:2: case id .* repeats line 1"):
        inputs.read_cases(data)


def test_missing_predictions_file_exits_with_a_message(tmp_path, cases):
    data = tmp_path / "test.jsonl"
    data.write_text(json.dumps(cases[0]) + "\n")
    args = argparse.Namespace(data=str(data), pred=str(tmp_path / "none.jsonl"),
                              out=str(tmp_path / "s.json"))
    with pytest.raises(SystemExit, match=r"predictions file .*none.jsonl does not exist. "
                                         r"--pred must be"):
        scorer.main(args)
