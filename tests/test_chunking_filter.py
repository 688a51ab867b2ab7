"""Token-length filter on a tiny whitespace tokenizer built offline."""

import argparse
import json
from pathlib import Path

import pytest

from segback.chunking import filter as chunk_filter
from segback.chunking.prompt import build_prompt, gold_completion
from segback.data.tokens import render_plain

FIXTURE = Path(__file__).parent / "fixtures" / "chunking_cases.jsonl"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A WordLevel tokenizer (one token per whitespace-separated word) mlx-lm can load."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = tmp_path_factory.mktemp("tok")
    vocab = {"[UNK]": 0, "<bos>": 1, "<eos>": 2, "User:": 3, "Assistant:": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>",
        "eos_token": "<eos>", "unk_token": "[UNK]"}))
    return path


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(tokenizer_dir)


@pytest.fixture(scope="module")
def cases():
    return [json.loads(line) for line in FIXTURE.read_text().splitlines()]


def expected_tokens(case):
    """<bos> + words of the plain-rendered prompt + words of the completion + <eos>."""
    prompt = render_plain([{"role": "user", "content": build_prompt(case)}], True)
    return 1 + len(prompt.split()) + len(gold_completion(case).split()) + 1


def test_counts_and_threshold(cases, tokenizer):
    lengths = [expected_tokens(c) for c in cases]
    assert len(set(lengths)) == 3
    limit = sorted(lengths)[1]  # keeps exactly the two shortest (the limit is inclusive)
    kept, report = chunk_filter.filter_cases(cases, tokenizer, limit)
    assert [r["id"] for r in kept] == [c["id"] for c, n in zip(cases, lengths) if n <= limit]
    assert [r["n_tokens"] for r in kept] == sorted(lengths)[:2]
    assert report["total"] == 3 and report["kept"] == 2 and report["dropped"] == 1
    assert report["all_tokens"]["max"] == max(lengths)
    assert report["kept_tokens"]["max"] == limit
    for key in ("p10", "p50", "p90", "max"):
        assert key in report["kept_tokens"] and key in report["all_tokens"]


def test_rows_are_trainable_chats(cases, tokenizer):
    kept, _ = chunk_filter.filter_cases(cases, tokenizer, 10**6)
    for row, case in zip(kept, cases):
        assert row["transcript"] == case["messages"]
        assert [m["role"] for m in row["messages"]] == ["user", "assistant"]
        assert row["messages"][1]["content"] == gold_completion(case)
        assert row["gold"] == case["gold"] and row["sources"] == case["sources"]
        assert 0 < row["prompt_tokens"] < row["n_tokens"]
    # filtering a filtered file again is stable (the transcript is read back from `transcript`)
    again, _ = chunk_filter.filter_cases(kept, tokenizer, 10**6)
    assert again == kept


def test_cli(tmp_path, tokenizer_dir, cases):
    args = argparse.Namespace(model=str(tokenizer_dir), data=str(FIXTURE), max_tokens=10**6,
                              out=str(tmp_path / "kept.jsonl"), report=str(tmp_path / "r.json"))
    assert chunk_filter.main(args) == 0
    rows = [json.loads(line) for line in (tmp_path / "kept.jsonl").read_text().splitlines()]
    assert len(rows) == len(cases)
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["kept"] == 3 and report["dropped"] == 0
    args.max_tokens = 5
    assert chunk_filter.main(args) == 1  # nothing fits: a non-zero exit


def test_missing_or_empty_data(tmp_path):
    with pytest.raises(SystemExit, match="not found"):
        chunk_filter.read_cases(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(SystemExit, match="empty"):
        chunk_filter.read_cases(tmp_path / "empty.jsonl")


def test_case_without_id_is_refused_with_file_and_line(tmp_path, cases):
    import json

    import pytest

    from segback.chunking.filter import read_cases

    rows = [dict(c) for c in cases[:2]]
    del rows[1]["id"]
    path = tmp_path / "cases.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(SystemExit, match=rf"{path}:2: the case has no id"):
        read_cases(path)


def test_min_tokens_drops_short_cases(cases, tokenizer):
    lengths = sorted(expected_tokens(c) for c in cases)
    kept, report = chunk_filter.filter_cases(cases, tokenizer, lengths[-1], lengths[1])
    assert sorted(r["n_tokens"] for r in kept) == lengths[1:]  # the bound is inclusive
    assert report["min_tokens"] == lengths[1] and report["too_short"] == 1
    assert "min_tokens" not in chunk_filter.filter_cases(cases, tokenizer, 10**6)[1]
