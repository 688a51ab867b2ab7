"""Dataset build: deterministic bytes, no source shared across splits, well-formed gold."""

import json

import pytest

from segback.chunking.build import build_dataset, make_label, read_sharegpt
from segback.chunking.prompt import build_prompt, chat_rows, gold_completion
from segback.chunking.scorer import score_case

FILES = ("train.jsonl", "valid.jsonl", "test.jsonl", "stats.json")
SMALL = dict(n_train=6, n_valid=3, n_test=3, min_sources=2, max_sources=3, max_turns=4,
             max_message_chars=300, max_records=400)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    a, b = tmp_path_factory.mktemp("a"), tmp_path_factory.mktemp("b")
    stats = build_dataset(a, seed=7, **SMALL)
    build_dataset(b, seed=7, **SMALL)
    return a, b, stats


def load(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_same_seed_same_bytes(built):
    a, b, _ = built
    for name in FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_other_seed_differs(built, tmp_path):
    build_dataset(tmp_path, seed=8, **SMALL)
    assert (tmp_path / "test.jsonl").read_bytes() != (built[0] / "test.jsonl").read_bytes()


def test_test_split_does_not_depend_on_n_train(built, tmp_path):
    build_dataset(tmp_path, seed=7, **{**SMALL, "n_train": 2})
    assert (tmp_path / "test.jsonl").read_bytes() == (built[0] / "test.jsonl").read_bytes()


def test_splits_share_no_source(built):
    a, _, stats = built
    seen = {}
    for split in ("train", "valid", "test"):
        rows = load(a / f"{split}.jsonl")
        assert len(rows) == SMALL[f"n_{split}"] == stats["splits"][split]["cases"]
        groups = {s.rsplit("_", 1)[0] for r in rows for s in r["sources"]}
        for other, other_groups in seen.items():
            assert not groups & other_groups, (split, other)
        seen[split] = groups


def test_cases_are_well_formed(built):
    a, _, stats = built
    assert stats["records_kept"] == SMALL["max_records"]
    for split in ("train", "valid", "test"):
        for case in load(a / f"{split}.jsonl"):
            ids = [m["id"] for m in case["messages"]]
            assert len(set(ids)) == len(ids)
            assert all(len(i) == 8 and int(i, 16) >= 0 for i in ids)  # ID_CHARS hex
            chunks = case["gold"]["chunks"]
            assert 2 <= len(chunks) == len(case["sources"]) <= 3
            assert chunks[0]["anchor"] == ids[0]
            assert [ids.index(c["anchor"]) for c in chunks] == sorted(
                ids.index(c["anchor"]) for c in chunks)
            starts = {ids.index(c["anchor"]) for c in chunks}
            assert all(case["messages"][i]["role"] == "user" for i in starts)
            # every source ends with a reply: the message before each chunk is the assistant's
            assert all(case["messages"][i - 1]["role"] == "assistant" for i in starts if i)
            assert case["messages"][-1]["role"] == "assistant"
            labels = [c["label"].lower() for c in chunks]
            assert len(set(labels)) == len(labels)
            assert all(1 <= len(c["label"].split()) <= 8 for c in chunks)
            assert all(len(m["content"]) <= 300 + 6 for m in case["messages"])
            # the gold answer is a perfect answer for the scorer
            assert score_case(case, gold_completion(case))["score"] == 100
            prompt = build_prompt(case)
            assert all(f"[{i}]" in prompt for i in ids)
            assert chat_rows(case)[1]["content"] == gold_completion(case)


def test_reads_truncated_json(tmp_path):
    rec = {"id": "x_0", "conversations": [{"from": "human", "value": "hi"}]}
    path = tmp_path / "cut.json"
    path.write_text(json.dumps([rec, rec, rec])[:-30])
    records, info = read_sharegpt(path)
    assert len(records) == 2 and info["truncated"] and info["records_kept"] == 2


def test_make_label():
    assert make_label("## How do I **bake** bread? I have flour.") == "How do I bake bread"
    assert make_label("Write a code in Javascript to sign a PDF file with a key") == (
        "Write a code in Javascript to sign")
    assert len(make_label("word " * 30).split()) == 8
    # a markdown escape's backslash is not part of the title (the model copied it unescaped
    # into its JSON answer, which made the answer invalid)
    assert make_label("if object id (TLA\\_Mov\\_Access) is set") == (
        "if object id (TLA Mov Access) is set")
    assert make_label("```python\nprint(1)\n```\nFix this code please") == (
        "Fix this code please")


def test_label_words_cuts_gold_labels(tmp_path):
    stats = build_dataset(tmp_path, seed=7, **SMALL, label_words=4)
    assert stats["knobs"]["label_words"] == 4
    cases = [c for s in ("train", "valid", "test") for c in load(tmp_path / f"{s}.jsonl")]
    words = [len(c["label"].split()) for case in cases for c in case["gold"]["chunks"]]
    assert words and max(words) == 4  # long first sentences are cut at exactly 4 words
    assert all(score_case(c, gold_completion(c))["score"] == 100 for c in cases)


@pytest.mark.parametrize("label_words", [1, 9])
def test_label_words_outside_the_scorer_limit_is_refused(tmp_path, label_words):
    with pytest.raises(ValueError, match="label_words must be between 2 and 8"):
        build_dataset(tmp_path, seed=7, **SMALL, label_words=label_words)


def test_max_reply_chars_cuts_replies_only(tmp_path):
    build_dataset(tmp_path, seed=7, **SMALL, max_reply_chars=120)
    msgs = [m for s in ("train", "valid", "test") for c in load(tmp_path / f"{s}.jsonl")
            for m in c["messages"]]
    replies = [len(m["content"]) for m in msgs if m["role"] == "assistant"]
    questions = [len(m["content"]) for m in msgs if m["role"] == "user"]
    assert max(replies) <= 120 + 6 < max(questions) <= 300 + 6
