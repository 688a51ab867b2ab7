"""segback compare: arms' per-case scores grouped by conversation length, and paired."""

import json

import pytest

from segback.chunking import compare
from segback.chunking.prompt import gold_completion
from segback.chunking.scorer import score_predictions
from segback.cli import main

FIXTURE_CASES = [json.loads(line) for line in open(
    __file__.rsplit("/", 1)[0] + "/fixtures/chunking_cases.jsonl")]
LENGTHS = {"fixture-0": 900, "fixture-1": 1500, "fixture-2": 2048}  # made-up token counts
BUCKETS = compare.buckets_of([512, 1024, 2048])


def scores(answers: dict) -> dict:
    preds = [{"id": cid, "text": text, "generated_tokens": 7} for cid, text in answers.items()]
    return score_predictions(FIXTURE_CASES, preds)


def gold(cid):
    return gold_completion(next(c for c in FIXTURE_CASES if c["id"] == cid))


GOOD = scores({c["id"]: gold(c["id"]) for c in FIXTURE_CASES})  # F1 1, score 100
FIRST_ONLY = scores({c["id"]: json.dumps({"chunks": [json.loads(gold(c["id"]))["chunks"][0]]})
                     for c in FIXTURE_CASES})  # one chunk: right start, no boundary
EMPTY = scores({})


def test_buckets():
    assert [b["name"] for b in BUCKETS] == ["512–1K", "1K–2K"]
    assert compare.bucket_index(900, BUCKETS) == 0 and compare.bucket_index(1024, BUCKETS) == 1
    assert compare.bucket_index(2048, BUCKETS) == 1  # the last bucket is closed
    assert compare.bucket_index(2049, BUCKETS) is None
    assert compare.bucket_index(100, BUCKETS) is None
    with pytest.raises(compare.CompareError):
        compare.buckets_of([1024, 512])


def test_metrics_by_length_and_paired():
    files = {"good": GOOD, "first": FIRST_ONLY, "empty": EMPTY}
    arms = [{"name": "baseline", "score": "empty"},
            {"name": "whole", "score": "good", "train_summary": "ts"},
            {"name": "windows", "score": "first", "train_summary": "ts"}]
    summary = {"steps": 4, "seq": 1024, "input_tokens": 999, "tokens": 50, "seconds": 1.5}
    c = compare.build_comparison(arms, LENGTHS, BUCKETS,
                                 read=lambda p: summary if p == "ts" else files[p])
    assert [b["n"] for b in c["buckets"]] == [1, 2] and c["outside_buckets"] == 0
    base, whole, win = c["arms"]
    assert "training" not in base and whole["training"]["input_tokens"] == 999
    assert whole["all"]["mean_score"] == 100.0 and whole["all"]["boundary_f1"] == 1.0
    assert whole["all"]["pk"] == 0.0 and whole["all"]["chunks_per_gold"] == 1.0
    assert base["all"]["valid_json_rate"] == 0.0 and base["all"]["mean_score"] == 0.0
    assert base["all"]["mean_generated_tokens"] is None  # no prediction, no count
    # one bucket holds fixture-0 alone: its figures are that case's
    row0 = next(r for r in FIRST_ONLY["cases"] if r["id"] == "fixture-0")
    assert win["by_length"]["512–1K"]["n"] == 1
    assert win["by_length"]["512–1K"]["mean_score"] == pytest.approx(row0["score"], abs=1e-4)
    assert win["by_length"]["512–1K"]["boundary_f1"] == row0["boundary"]["f1"] == 0.0
    gold_chunks = [len(c["gold"]["chunks"]) for c in FIXTURE_CASES]
    assert win["all"]["chunks_per_gold"] == round(sum(1 / n for n in gold_chunks) / 3, 4)
    p = c["paired"]
    assert (p["a"], p["b"]) == ("whole", "windows")
    f1 = next(m for m in p["metrics"] if m["metric"] == "boundary_f1")
    assert f1["n"] == 3 and f1["mean_diff"] == 1.0 and f1["ci95"] == [1.0, 1.0]
    assert (f1["better"], f1["worse"], f1["equal"]) == (3, 0, 0)
    pk = next(m for m in p["metrics"] if m["metric"] == "pk")
    assert pk["lower_is_better"] and pk["mean_diff"] < 0 and pk["better"] == 3
    md = compare.render_markdown(c)
    assert md.count("\n| 512–1K | ") == 3 and md.count("\n| all | ") == 3
    assert "| whole | 3 | 100.0 | 100% |" in md and "Paired by case: whole minus windows" in md


def test_every_arm_must_score_the_same_cases():
    short = score_predictions(FIXTURE_CASES[:2], [])
    arms = [{"name": "a", "score": "x"}, {"name": "b", "score": "y"}]
    with pytest.raises(compare.CompareError, match="same test set"):
        compare.build_comparison(arms, LENGTHS, BUCKETS,
                                 read=lambda p: GOOD if p == "x" else short)


def test_cli(tmp_path, capsys):
    data = tmp_path / "test.jsonl"
    data.write_text("".join(json.dumps({**c, "n_tokens": LENGTHS[c["id"]]}) + "\n"
                            for c in FIXTURE_CASES))
    for name, s in (("good", GOOD), ("empty", EMPTY)):
        (tmp_path / f"{name}.json").write_text(json.dumps(s))
    arms = json.dumps([{"name": "baseline", "score": str(tmp_path / "empty.json")},
                       {"name": "tuned", "score": str(tmp_path / "good.json")}])
    out = tmp_path / "c.json"
    assert main(["compare", "--data", str(data), "--arms", arms, "--buckets", "512,1024,2048",
                 "--out", str(out), "--markdown", str(tmp_path / "c.md"),
                 "--table", str(tmp_path / "c.html")]) == 0
    c = json.loads(out.read_text())
    assert [a["name"] for a in c["arms"]] == ["baseline", "tuned"] and "paired" not in c
    assert (tmp_path / "c.html").read_text().count("<tr>") == 1 + 3 * 2  # header + rows
    assert main(["compare", "--data", str(data), "--arms", arms, "--buckets", "512",
                 "--out", str(out)]) == 1
    assert "two or more ascending" in capsys.readouterr().err
