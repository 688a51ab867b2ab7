"""The long-context experiment's DAG (config/long.yaml): three arms in one sweep.

The GPU config is checked by dry run (its commands: the length filters, the window cut, both
trainings with the same steps and learning rate); config/long_smoke.yaml runs the same DAG with
the real stages at tiny sizes, down to the table of the arms by conversation length.
"""

from __future__ import annotations

import json
import re
import time

import pytest
import yaml
from test_sweep import shell_commands
from test_workflow import REPO, STAGE_MODULES, job_counts, snakemake, write_yaml

LONG = REPO / "config" / "long.yaml"
LONG_SMOKE = REPO / "config" / "long_smoke.yaml"
CONFIG_SCHEMA = REPO / "workflow" / "schemas" / "config.schema.json"

# The model, data, test set and baseline once; the filtered train/valid data once (both arms
# train on the same conversations), cut into windows for the window arm; everything trained
# once per arm; the table of the arms last.
LONG_RULES = {
    "prepare_model": 1, "build_dataset": 1, "filter_test": 1, "filter_data": 2,
    "window_data": 2, "baseline_eval": 1, "plan_segments": 2, "train_lora": 2,
    "export_adapter": 2, "finetuned_eval": 2, "score": 3, "plots": 2, "summarize_branch": 2,
    "config_stamp": 4, "compare_arms": 1, "sweep_summary": 1, "all": 1,
}
METRICS = ("mean_score", "valid_json_rate", "label_rate", "boundary_f1", "pk", "windowdiff",
           "rouge_l")


@pytest.mark.parametrize("path", [LONG, LONG_SMOKE], ids=["long", "long_smoke"])
def test_long_configs_match_schema(path):
    import jsonschema

    schema = json.loads(CONFIG_SCHEMA.read_text())
    jsonschema.Draft202012Validator(schema).validate(yaml.safe_load(path.read_text()))


def test_long_dry_run_trains_both_arms_alike(tmp_path):
    out = snakemake(tmp_path, "-n", "-p", "--cores", "16", "--configfile", str(LONG)).stdout
    assert job_counts(out) == LONG_RULES, out[-3000:]
    filters = shell_commands(out, "filter_test") + shell_commands(out, "filter_data")
    assert len(filters) == 3
    assert all("--max-tokens 32768 --min-tokens 8192 " in c for c in filters)
    cuts = shell_commands(out, "window_data")
    assert {re.search(r"--data (\S+)", c).group(1) for c in cuts} == {
        "results/gemma3/seq32768/data/train.jsonl", "results/gemma3/seq32768/data/valid.jsonl"}
    assert all("--window 2048 " in c for c in cuts)
    train = {re.search(r"--adapter-path (\S+)", c).group(1): c
             for c in shell_commands(out, "train_lora")}
    whole = train["results/gemma3/seq32768/adapter"]
    windows = train["results/gemma3/seq32768-w2048/adapter"]
    assert "--data results/gemma3/seq32768/data " in whole
    assert "--max-seq-length 32768 " in whole and "--batch-size 1 " in whole
    assert "--data results/gemma3/seq32768-w2048/data " in windows
    assert "--max-seq-length 2048 " in windows and "--batch-size 11 " in windows
    for flag in ("--iters 200 ", "--learning-rate 5e-05 ", "--warmup 10 ", "--lora-rank 8 "):
        assert flag in whole and flag in windows
    plans = shell_commands(out, "plan_segments")
    assert any("--seq 32768 --batch 1 " in c for c in plans)
    assert any("--seq 2048 --batch 11 " in c for c in plans)
    (cmp,) = shell_commands(out, "compare_arms")
    assert "--buckets 8192,16384,24576,32768 " in cmp
    assert all(f'"name": "{n}"' in cmp for n in ("baseline", "whole 32768", "windows 2048"))
    assert out.count("--prefill-step-size 8192") == 3  # the baseline and both arms
    assert out.count("--max-tokens 800") == 3


def test_window_configs_that_cannot_run_are_refused(tmp_path):
    bad = write_yaml(tmp_path / "bad.yaml", {"train": {"window": 4096}, "seq": 2048})
    out = snakemake(tmp_path, "-n", "--configfile", str(LONG_SMOKE), str(bad), check=False)
    assert out.returncode != 0
    assert "`train.window`: 4096 is not shorter than `seq` 2048" in out.stdout, out.stdout[-2000:]


def test_a_single_window_branch_is_a_single_result(tmp_path):
    """train.window as one number: one branch, seq{L}-w{W}, with the usual single result."""
    over = write_yaml(tmp_path / "one.yaml", {"train": {
        **yaml.safe_load(LONG_SMOKE.read_text())["train"], "window": 384}})
    out = snakemake(tmp_path, "-n", "-p", "--cores", "2", "--configfile", str(LONG_SMOKE),
                    str(over)).stdout
    counts = job_counts(out)
    assert counts["train_lora"] == 1 and counts["summarize"] == 1 and "sweep_summary" not in counts
    (train,) = shell_commands(out, "train_lora")
    assert "--adapter-path results/tiny/seq1024-w384/adapter " in train
    assert "--max-seq-length 384 " in train and "--batch-size 2 " in train


def test_long_smoke_run(tmp_path):
    """The whole long-context DAG with the real stages at tiny sizes: the table has the three
    arms, each with the metrics in every length bucket, and a rerun does nothing."""
    for module in STAGE_MODULES:
        pytest.importorskip(module, reason=f"stage module {module} not written yet")
    work = tmp_path / "work"
    work.mkdir()
    cfg = ["--cores", "2", "--configfile", str(LONG_SMOKE)]
    tic = time.perf_counter()
    out = snakemake(work, *cfg).stdout
    wall = time.perf_counter() - tic
    print(f"long smoke run: {wall:.0f} s")
    assert job_counts(out) == LONG_RULES
    res = work / "results"
    table = json.loads((res / "tiny_by_length.json").read_text())
    assert [a["name"] for a in table["arms"]] == ["baseline", "whole 1024", "windows 384"]
    assert [b["name"] for b in table["buckets"]] == ["512–768", "768–1K"]
    assert sum(b["n"] for b in table["buckets"]) == table["cases"] > 0
    for arm in table["arms"]:
        assert arm["all"]["n"] == table["cases"]
        for bucket in table["buckets"]:
            figures = arm["by_length"][bucket["name"]]
            assert figures["n"] == bucket["n"]
            if bucket["n"]:
                assert all(isinstance(figures[k], float) for k in METRICS), figures
    base, whole, win = table["arms"]
    assert "training" not in base
    assert whole["training"]["steps"] == win["training"]["steps"] == 3
    assert (whole["training"]["seq"], win["training"]["seq"]) == (1024, 384)
    assert (whole["training"]["batch_size"], win["training"]["batch_size"]) == (1, 2)
    assert table["paired"]["a"] == "whole 1024" and table["paired"]["b"] == "windows 384"
    sweep = json.loads((res / "sweep_summary.json").read_text())
    assert sweep["swept"] == ["window"] and sweep["by_length"] == ["results/tiny_by_length.json"]
    assert sorted(str(r["window"]) for r in sweep["rows"]) == ["384", "None"]
    md = (res / "sweep_summary.md").read_text()
    assert "| tiny | 1024 | 4 | whole |" in md and "Scores by conversation length" in md
    assert md.count("| windows 384 |") == 4  # two buckets, all, and the training table
    out = snakemake(work, *cfg, "-n").stdout
    assert "Nothing to be done" in out, out[-2000:]
    assert wall < 600, f"long smoke run took {wall:.0f} s (about 250 s on a loaded 2-core CPU)"


def test_window_problems():
    from segback.experiment.config_check import _window_problems

    assert _window_problems({"seq": [4096, 8192], "train": {"window": [None, 2048]}}) == []
    assert _window_problems({"seq": 2048, "train": {}}) == []
    (generic,) = _window_problems({"task": "generic", "seq": 4096, "train": {"window": 1024}})
    assert "task: chunking" in generic
    (long,) = _window_problems({"seq": [1024, 4096], "train": {"window": [None, 2048]}})
    assert long.startswith("`train.window`: 2048 is not shorter than `seq` 1024")
