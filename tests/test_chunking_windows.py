"""Windows of long cases (segback window-data) on real ShareGPT cases and a word tokenizer."""

import argparse
import json

import pytest
from test_chunking_filter import tokenizer, tokenizer_dir  # noqa: F401 (fixtures)

from segback.chunking import filter as chunk_filter
from segback.chunking import windows
from segback.chunking.build import build_dataset
from segback.chunking.prompt import chat_rows
from segback.data.tokens import encode_example

WINDOW = 160  # words: each case of ~400-900 words makes 3-7 windows


@pytest.fixture(scope="module")
def cases(tmp_path_factory, tokenizer):  # noqa: F811
    out = tmp_path_factory.mktemp("data")
    build_dataset(out, seed=3, n_train=6, n_valid=1, n_test=1, min_sources=4, max_sources=8,
                  max_turns=4, max_message_chars=200, max_records=600)
    raw = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    kept, _ = chunk_filter.filter_cases(raw, tokenizer, 10**6)
    return kept


def test_windows_cover_each_case_once_and_fit(cases, tokenizer):  # noqa: F811
    for case in cases:
        rows = windows.cut_case(case, tokenizer, WINDOW)
        assert len(rows) >= 2
        assert [m for r in rows for m in r["transcript"]] == case["transcript"]
        assert [r["id"] for r in rows] == [f"{case['id']}-w{i:02d}" for i in range(len(rows))]
        for i, r in enumerate(rows):
            ids, prompt = encode_example(tokenizer, chat_rows(r))
            assert r["n_tokens"] == len(ids) <= WINDOW and r["prompt_tokens"] == prompt
            if i < len(rows) - 1:  # greedy: the next message would not have fitted
                start, stop = r["window"]["messages"]
                bigger = windows.window_case(case, start, stop + 1, i)
                assert len(encode_example(tokenizer, chat_rows(bigger))[0]) > WINDOW


def test_window_gold_is_the_chunks_inside_it(cases, tokenizer):  # noqa: F811
    case = max(cases, key=lambda c: len(c["gold"]["chunks"]))
    labels = {c["anchor"]: c["label"] for c in case["gold"]["chunks"]}
    position = {m["id"]: i for i, m in enumerate(case["transcript"])}
    starts = sorted(position[a] for a in labels)
    seen = []
    for r in windows.cut_case(case, tokenizer, WINDOW):
        start, stop = r["window"]["messages"]
        chunks = r["gold"]["chunks"]
        assert chunks[0]["anchor"] == r["transcript"][0]["id"]  # every answer starts there
        for c in chunks:
            p = position[c["anchor"]]
            assert start <= p < stop
            owner = case["transcript"][max(s for s in starts if s <= p)]["id"]
            assert c["label"] == labels[owner]  # a continued chunk keeps its label
        seen += [c["anchor"] for c in chunks]
        assert r["messages"][1]["content"] == json.dumps(
            {"chunks": chunks}, ensure_ascii=False, separators=(",", ":"))
    assert set(labels) <= set(seen)  # every gold boundary is a boundary of some window


def test_report_compares_windows_with_whole_cases(cases, tokenizer):  # noqa: F811
    rows, report = windows.cut_cases(cases, tokenizer, WINDOW)
    assert report["cases"] == len(cases) and report["windows"] == len(rows)
    assert report["case_tokens"] == sum(c["n_tokens"] for c in cases)
    assert report["window_tokens"] == sum(r["n_tokens"] for r in rows)
    per_window = report["window_tokens"] / len(rows)
    assert report["windows_per_case_tokens"] == round(
        report["case_tokens"] / len(cases) / per_window, 3)
    # Each window repeats the instruction, so the windows hold more tokens than the cases.
    assert report["window_tokens"] > report["case_tokens"]
    assert report["window_lengths"]["max"] <= WINDOW


def test_a_message_longer_than_the_window_is_named(cases, tokenizer):  # noqa: F811
    case = cases[0]
    with pytest.raises(ValueError, match=case["transcript"][0]["id"]):
        windows.cut_case(case, tokenizer, 60)


def test_cli(tmp_path, cases, tokenizer_dir):  # noqa: F811
    data = tmp_path / "cases.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in cases))
    args = argparse.Namespace(model=str(tokenizer_dir), data=str(data), window=WINDOW,
                              out=str(tmp_path / "w.jsonl"), report=str(tmp_path / "r.json"))
    assert windows.main(args) == 0
    rows = [json.loads(line) for line in (tmp_path / "w.jsonl").read_text().splitlines()]
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["windows"] == len(rows) > len(cases)
    raw = tmp_path / "raw.jsonl"  # rows the length filter has not counted are refused
    raw.write_text(json.dumps({k: v for k, v in cases[0].items() if k != "n_tokens"}) + "\n")
    with pytest.raises(SystemExit, match="filter-data"):
        windows.main(argparse.Namespace(**{**vars(args), "data": str(raw)}))
