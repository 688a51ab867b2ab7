"""The workflow on the user's own data (`task: generic`): config, DAG, `segback evaluate`, the
generic result, and a smoke run.

Fastest first: config and dry-run checks (seconds); the whole DAG through the stand-in
`segback` of test_workflow.py plus a stand-in `evaluate` (seconds); `segback evaluate` and
`segback summarize --task generic` as units (a tiny random model, seconds); THE GENERIC SMOKE
RUN of config/generic_smoke.yaml with the real stages (a few minutes on CPU).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml
from test_workflow import (
    CONFIG,
    CONFIG_SCHEMA,
    FAKE_SEGBACK,
    REPO,
    RESULT_SCHEMA,
    SMOKE,
    STAGE_MODULES,
    job_counts,
    rule_edges,
    snakemake,
    write_yaml,
)

from segback.experiment.result_parts import ResultError, validate_result

GENERIC_SMOKE = REPO / "config" / "generic_smoke.yaml"
GENERIC_SCHEMA = REPO / "segback" / "experiment" / "generic_result.schema.json"
DATA = REPO / "tests" / "data" / "generic"

GENERIC_RULES = {
    "prepare_model": 1, "filter_test": 1, "filter_data": 2, "baseline_eval": 1,
    "plan_segments": 1, "train_lora": 1, "export_adapter": 1, "finetuned_eval": 1, "plots": 1,
    "summarize": 1, "all": 1, "config_stamp": 3,
}
SCORER_RULES = {"baseline_generate": 1, "finetuned_generate": 1, "score": 2}
# What a change of `seq` re-runs: the test set and the baseline do not depend on it.
GENERIC_SEQ_RULES = {
    "filter_data": 2, "plan_segments": 1, "train_lora": 1, "export_adapter": 1,
    "finetuned_eval": 1, "plots": 1, "summarize": 1, "all": 1, "config_stamp": 1,
}
GENERIC_EDGES = {
    ("prepare_model", "filter_test"), ("prepare_model", "filter_data"),
    ("filter_test", "baseline_eval"), ("prepare_model", "plan_segments"),
    ("filter_data", "train_lora"), ("plan_segments", "train_lora"),
    ("train_lora", "export_adapter"), ("export_adapter", "finetuned_eval"),
    ("filter_test", "finetuned_eval"), ("baseline_eval", "summarize"),
    ("finetuned_eval", "summarize"), ("train_lora", "plots"), ("plots", "summarize"),
    ("train_lora", "summarize"), ("plan_segments", "summarize"),
    ("config_stamp", "summarize"), ("summarize", "all"),
}
RESULT = "results/tiny_generic_eval.json"


def generic_cfg(tmp_path: Path, name: str = "abs", **dataset) -> list[str]:
    """--configfile args: config/generic_smoke.yaml with the data at its absolute path (runs
    happen in a temporary working directory), plus `dataset` keys on top."""
    over = write_yaml(tmp_path / f"{name}.yaml",
                      {"dataset": {"path": str(DATA), **dataset}})
    return ["--configfile", str(GENERIC_SMOKE), str(over)]


# ---- config ------------------------------------------------------------------------------------

def test_generic_configs_match_schema():
    import jsonschema

    validator = jsonschema.Draft202012Validator(json.loads(CONFIG_SCHEMA.read_text()))
    generic = yaml.safe_load(GENERIC_SMOKE.read_text())
    validator.validate(generic)
    assert "data" not in generic  # the chunking builder's section is not needed
    default = yaml.safe_load(CONFIG.read_text())
    assert default.get("task", "chunking") == "chunking"
    validator.validate(default | {"task": "generic", "dataset": {"hf": "org/name"}})
    # task: generic needs `dataset`; task: chunking needs `data`
    errors = list(validator.iter_errors({k: v for k, v in generic.items() if k != "dataset"}))
    assert any("'dataset' is a required property" in e.message for e in errors)
    errors = list(validator.iter_errors({k: v for k, v in default.items() if k != "data"}))
    assert any("'data' is a required property" in e.message for e in errors)


def test_config_overrides_validate(tmp_path):
    """`--config` values are strings (YAML's base loader): a dataset given on the command line
    on top of the default config validates and reaches the commands."""
    out = snakemake(tmp_path, "-n", "-p", "--cores", "1", "--configfile", str(CONFIG),
                    "--config", "task=generic",
                    f'dataset={{"path": "{DATA}", "mask_prompt": false, "seed": 3, '
                    '"test_fraction": 0.2, "scorer": null}').stdout
    counts = job_counts(out)
    assert counts["baseline_eval"] == 1 and "build_dataset" not in counts, out[-3000:]
    assert "results/gemma3_generic_eval.json" in out
    assert "--no-mask-prompt" in out and "--seed 3" in out and "--test-fraction 0.2" in out
    train = next(line for line in out.splitlines() if line.startswith("Shell command: segback "
                                                                       "train"))
    assert " --no-mask-prompt " in train
    # `dataset=PATH`: short for {path: PATH}
    out = snakemake(tmp_path, "-n", "--cores", "1", "--configfile", str(GENERIC_SMOKE),
                    "--config", f"dataset={DATA}").stdout
    assert job_counts(out) == GENERIC_RULES


@pytest.mark.parametrize("dataset, message", [
    ({"path": str(DATA), "hf": "org/name"}, "give `path`"),
    ({"path": "no/such/dir"}, "`dataset.path`: no/such/dir not found"),
    ({"path": str(DATA), "name": "baseline"}, "`dataset.name`: 'baseline'"),
    ({"path": str(DATA), "mask_promt": True}, "unknown key `dataset.mask_promt`: did you mean "
                                               "`mask_prompt`?"),
    ({"path": str(DATA), "scorer": "bleu"}, "`dataset.scorer`"),
], ids=["both", "missing", "reserved", "misspelt", "scorer"])
def test_bad_dataset_configs_name_the_key(tmp_path, dataset, message):
    # the smoke config's dataset section replaced, not merged with (a second file would merge)
    cfg = yaml.safe_load(GENERIC_SMOKE.read_text())
    cfg["dataset"] = dataset
    full = write_yaml(tmp_path / "full.yaml", cfg)
    out = snakemake(tmp_path, "-n", "--configfile", str(full), check=False)
    assert out.returncode != 0 and message in out.stdout, out.stdout[-2000:]
    assert "Traceback" not in out.stdout


def test_generic_without_dataset_says_so(tmp_path):
    out = snakemake(tmp_path, "-n", "--configfile", str(SMOKE), "--config", "task=generic",
                    check=False)
    assert out.returncode != 0 and "'dataset' is a required property" in out.stdout


# ---- DAG ---------------------------------------------------------------------------------------

def test_generic_dry_run_has_every_stage(tmp_path):
    out = snakemake(tmp_path, "-n", "--cores", "1", *generic_cfg(tmp_path)).stdout
    assert job_counts(out) == GENERIC_RULES, out[-3000:]
    assert f"output: {RESULT}" in out
    # the data-dependent outputs live under results/{model}/{name}/, the model is shared
    assert "output: results/tiny/model\n" in out
    assert "output: results/tiny/generic/seq256/adapter" in out
    assert "output: results/tiny/generic/baseline/eval.json" in out


def test_generic_rule_graph(tmp_path):
    edges = rule_edges(tmp_path, *generic_cfg(tmp_path))
    assert GENERIC_EDGES <= edges, sorted(GENERIC_EDGES - edges)
    upstream = {"baseline_eval"}
    while more := {a for a, b in edges if b in upstream} - upstream:
        upstream |= more
    assert upstream == {"baseline_eval", "filter_test", "prepare_model"}


def test_generic_dry_run_with_a_scorer(tmp_path):
    out = snakemake(tmp_path, "-n", "-p", "--cores", "1",
                    *generic_cfg(tmp_path, scorer="chunking")).stdout
    assert job_counts(out) == GENERIC_RULES | SCORER_RULES, out[-3000:]
    assert "--scorer chunking --baseline results/tiny/generic/baseline/score.json" in out


def test_generic_sweep_dry_run(tmp_path):
    over = write_yaml(tmp_path / "sweep.yaml", {"seq": [128, 256]})
    out = snakemake(tmp_path, "-n", "--cores", "1", *generic_cfg(tmp_path), str(over)).stdout
    counts = job_counts(out)
    assert counts["train_lora"] == 2 and counts["baseline_eval"] == 1, counts
    assert counts["summarize_branch"] == 2 and counts["sweep_summary"] == 1
    assert "results/generic_sweep_summary.json" in out
    assert "results/tiny/generic/seq128/result.json" in out


# ---- the whole DAG with a stand-in segback -----------------------------------------------------

FAKE_EVALUATE = textwrap.dedent('''
    """Stand-in for `segback evaluate`; every other command goes to test_workflow's stand-in."""
    import json, math, os, sys
    from pathlib import Path

    FAKE = os.environ["FAKE_SEGBACK_SCRIPT"]
    if sys.argv[1] != "evaluate":
        os.execv(sys.executable, [sys.executable, FAKE, *sys.argv[1:]])
    with open(os.environ["FAKE_SEGBACK_CALLS"], "a") as f:
        f.write("evaluate\\n")
    rest, a, i = sys.argv[2:], {}, 0
    while i < len(rest):
        key = rest[i][2:].replace("-", "_")
        if i + 1 < len(rest) and not rest[i + 1].startswith("--"):
            a[key], i = rest[i + 1], i + 2
        else:
            a[key], i = True, i + 1

    def rows(path):
        return [json.loads(line) for line in open(path) if line.strip()]

    def dump(path, text):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)

    if "rows" in a:  # the filter: the source's split as it is
        src = Path(a["data"])
        kept = rows(src / (a["split"] + ".jsonl") if src.is_dir() else src)
        dump(a["rows"], "".join(json.dumps(r) + "\\n" for r in kept))
        dump(a["out"], json.dumps({"split": a["split"], "kept": len(kept),
                                   "max_tokens": int(a["max_tokens"])}))
    else:  # loss: lower with the adapter
        n = len(rows(a["data"]))
        loss = 1.0 if "adapter" in a else 2.5
        dump(a["out"], json.dumps({"loss": loss, "ppl": math.exp(loss), "tokens": 10 * n,
                                   "examples": n, "dropped": 0, "truncated": 0,
                                   "max_seq_length": int(a["max_seq_length"]),
                                   "mask_prompt": "no_mask_prompt" not in a}))
''')


@pytest.fixture
def generic_env(tmp_path):
    fake = tmp_path / "fake_segback.py"
    fake.write_text(FAKE_SEGBACK)
    script = tmp_path / "fake_generic.py"
    script.write_text(FAKE_EVALUATE)
    calls = tmp_path / "calls.txt"
    return {"SEGBACK": f"{sys.executable} {script}", "FAKE_SEGBACK_SCRIPT": str(fake),
            "FAKE_SEGBACK_CALLS": str(calls)}, calls


def test_generic_fake_run_reaches_the_result(tmp_path, generic_env):
    env, calls = generic_env
    work = tmp_path / "work"
    work.mkdir()
    cfg = ["--cores", "2", *generic_cfg(tmp_path)]

    out = snakemake(work, *cfg, env=env).stdout
    assert job_counts(out) == GENERIC_RULES
    result = json.loads((work / RESULT).read_text())
    validate_result(result, GENERIC_SCHEMA)
    assert (result["task"], result["dataset"], result["model"]) == ("generic", "generic", "tiny")
    assert result["baseline"]["loss"] == 2.5 and result["finetuned"]["loss"] == 1.0
    assert result["delta"]["loss"] == pytest.approx(-1.5)
    assert result["baseline"]["examples"] == 3 and result["training"]["seq"] == 256
    assert "scores" not in result and set(result["config"]) == {"data", "train", "eval"}
    assert {"prepare_model", "filter_test", "baseline_eval", "train_lora",
            "finetuned_eval"} <= set(result["stages"])
    assert "test loss" in (work / "results/tiny_generic_eval.html").read_text()
    filtered = work / "results/tiny/generic/seq256/data/train.jsonl"
    assert filtered.read_text() == (DATA / "train.jsonl").read_text()

    n_calls = len(calls.read_text().split())
    out = snakemake(work, *cfg, env=env).stdout
    assert "Nothing to be done" in out, out[-2000:]
    assert len(calls.read_text().split()) == n_calls
    # seq: only the seq-dependent rules
    out = snakemake(work, "-n", *cfg, "--config", "seq=128", env=env).stdout
    assert job_counts(out) == GENERIC_SEQ_RULES, out[-3000:]
    # mask_prompt: the data, training and both evaluations, never the model or the plan
    over = write_yaml(tmp_path / "mask.yaml", {"dataset": {"mask_prompt": False}})
    counts = job_counts(snakemake(work, "-n", *cfg, str(over), env=env).stdout)
    assert set(counts) == set(GENERIC_RULES) - {"prepare_model", "plan_segments"}, counts

    # The chunking experiment in the same directory shares the prepared model only.
    out = snakemake(work, "--cores", "2", "--configfile", str(SMOKE), env=env).stdout
    counts = job_counts(out)
    assert "prepare_model" not in counts and counts["build_dataset"] == 1, counts
    validate_result(json.loads((work / "results/tiny_chunk_score.json").read_text()), RESULT_SCHEMA)
    out = snakemake(work, *cfg, env=env).stdout
    assert "Nothing to be done" in out, out[-2000:]  # nothing of the generic run was touched


def test_generic_fake_run_with_a_scorer(tmp_path, generic_env):
    env, _ = generic_env
    work = tmp_path / "work"
    work.mkdir()
    out = snakemake(work, "--cores", "2", *generic_cfg(tmp_path, scorer="chunking"),
                    env=env).stdout
    assert job_counts(out) == GENERIC_RULES | SCORER_RULES
    result = json.loads((work / RESULT).read_text())
    validate_result(result, GENERIC_SCHEMA)
    assert result["scorer"] == "chunking"
    assert result["scores"]["delta"]["mean_score"] == pytest.approx(50.0)
    assert "score_finetuned" in result["stages"]


def test_generic_fake_sweep(tmp_path, generic_env):
    env, _ = generic_env
    work = tmp_path / "work"
    work.mkdir()
    over = write_yaml(tmp_path / "sweep.yaml", {"seq": [128, 256]})
    snakemake(work, "--cores", "2", *generic_cfg(tmp_path), str(over), env=env)
    sweep = json.loads((work / "results/generic_sweep_summary.json").read_text())
    assert sweep["task"] == "generic" and sweep["best_by"] == "loss"
    assert sorted(r["seq"] for r in sweep["rows"]) == [128, 256]
    for r in sweep["rows"]:
        assert r["loss"] == 1.0 and r["baseline_loss"] == 2.5 and r["delta_loss"] == -1.5
        validate_result(json.loads((work / r["result"]).read_text()), GENERIC_SCHEMA)
    md = (work / "results/generic_sweep_summary.md").read_text()
    assert "test loss" in md and "Lowest fine-tuned test loss" in md


# ---- segback evaluate and summarize --task generic --------------------------------------------

def evaluate_args(*argv: str) -> argparse.Namespace:
    from segback.experiment import evaluate

    parser = argparse.ArgumentParser()
    evaluate.add_arguments(parser)
    return parser.parse_args(list(argv))


def run_evaluate(*argv: str) -> int:
    """`segback evaluate` in this process (cli.main would re-exec it with OpenBLAS)."""
    from segback.experiment import evaluate

    return evaluate.main(evaluate_args(*argv))


def test_carving_is_seeded_and_disjoint():
    from segback.experiment.evaluate import carve

    a = carve(20, True, True, 0.1, 0.2, seed=0, source="x")
    assert a == carve(20, True, True, 0.1, 0.2, seed=0, source="x")
    assert (len(a["valid"]), len(a["test"]), len(a["train"])) == (2, 4, 14)
    assert sorted(a["train"] + a["valid"] + a["test"]) == list(range(20))
    assert carve(20, True, True, 0.1, 0.2, seed=1, source="x") != a
    assert len(carve(3, True, True, 0.1, 0.1, 0, "x")["train"]) == 1  # at least one each
    from segback.data.dataset import DataError

    with pytest.raises(DataError, match="cannot spare"):
        carve(2, True, True, 0.1, 0.1, 0, "x")


def test_rows_are_written_with_standard_fields(tmp_path):
    src = tmp_path / "qa.jsonl"
    rows = [{"id": k, "question": f"What is {k} + {k}?", "answer": f"{2 * k}.", "x": 1}
            for k in range(10)]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    outs = {}
    for split in ("train", "valid", "test"):
        rc = run_evaluate("--model", "tiny-e4b", "--data", str(src), "--split", split,
                          "--prompt-feature", "question", "--completion-feature", "answer",
                          "--max-tokens", "200", "--rows", str(tmp_path / f"{split}.jsonl"),
                          "--out", str(tmp_path / f"{split}.report.json"))
        assert rc == 0
        outs[split] = [json.loads(x) for x in (tmp_path / f"{split}.jsonl").open()]
    assert [len(outs[s]) for s in ("train", "valid", "test")] == [8, 1, 1]
    assert sorted(r["id"] for s in outs.values() for r in s) == list(range(10))
    assert outs["test"][0].keys() == {"id", "prompt", "completion", "x"}
    report = json.loads((tmp_path / "test.report.json").read_text())
    assert report["carved"] == ["valid", "test"] and report["kept"] == 1
    # too long for the limit: dropped, and none left is an error
    assert run_evaluate("--model", "tiny-e4b", "--data", str(src), "--split", "train",
                        "--prompt-feature", "question", "--completion-feature", "answer",
                        "--max-tokens", "5", "--rows", str(tmp_path / "x.jsonl"),
                        "--out", str(tmp_path / "x.json")) == 1
    assert run_evaluate("--model", "tiny-e4b", "--data", str(src), "--max-tokens", "5",
                        "--out", str(tmp_path / "x.json")) == 2  # --rows missing


def test_evaluate_is_the_token_weighted_default_loss(tmp_path):
    """loss = sum of mlx-lm's default_loss x its token count over the examples / all tokens;
    mask_prompt decides which tokens count; ppl = exp(loss)."""
    import mlx.core as mx
    from mlx_lm.tuner.trainer import default_loss

    from segback.data.dataset import collate
    from segback.data.formats import DataFormat, encode_rows
    from segback.data.tokens import ByteTokenizer
    from segback.models.load import load

    rows = [json.loads(x) for x in (DATA / "test.jsonl").open()]
    model, _ = load("tiny-e4b")
    for mask in (True, False):
        out = tmp_path / f"eval-{mask}.json"
        assert run_evaluate("--model", "tiny-e4b", "--data", str(DATA / "test.jsonl"),
                            "--max-seq-length", "256", "--batch-size", "2",
                            "--mask-prompt" if mask else "--no-mask-prompt",
                            "--out", str(out)) == 0
        got = json.loads(out.read_text())
        ds = encode_rows(ByteTokenizer(), rows, 256, fmt=DataFormat(mask_prompt=mask))
        total, count = 0.0, 0
        for ex in ds.examples:
            loss, ntoks = default_loss(model, *collate([ex], 256))
            mx.eval(loss, ntoks)
            total += loss.item() * ntoks.item()
            count += int(ntoks.item())
        assert got["tokens"] == count and got["examples"] == 3
        assert got["loss"] == pytest.approx(total / count, rel=1e-4)
        assert got["ppl"] == pytest.approx(math.exp(got["loss"]))
        assert got["mask_prompt"] is mask
    full = json.loads((tmp_path / "eval-False.json").read_text())
    masked = json.loads((tmp_path / "eval-True.json").read_text())
    assert full["tokens"] > masked["tokens"]


def test_summarize_generic_unit(tmp_path, capsys):
    from segback.cli import main

    def dump(name, obj):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(obj))
        return str(path)

    ev = {"loss": 2.0, "ppl": math.exp(2.0), "tokens": 40, "examples": 3, "seconds": 0.5}
    summary = {"steps": 3, "seq": 256, "segments": [[0, 2]], "peak_gb": 0.1, "seconds": 1.0}
    args = ["summarize", "--task", "generic", "--model-name", "tiny", "--dataset", "mine",
            "--baseline-eval", dump("b", ev),
            "--finetuned-eval", dump("f", ev | {"loss": 1.5, "ppl": math.exp(1.5)}),
            "--train-summary", dump("s", summary), "--plan", dump("p", {"segments": [[0, 2]]}),
            "--out", str(tmp_path / "r.json"), "--table", str(tmp_path / "r.html")]
    assert main(args) == 0
    r = json.loads((tmp_path / "r.json").read_text())
    validate_result(r, GENERIC_SCHEMA)
    assert r["delta"]["loss"] == pytest.approx(-0.5) and r["dataset"] == "mine"
    assert "test loss" in (tmp_path / "r.html").read_text()
    # a chunking result is not a generic one, and the reverse
    with pytest.raises(ResultError):
        validate_result(r, RESULT_SCHEMA)
    # a scorer needs both scores
    assert main([*args, "--scorer", "chunking"]) == 2
    assert "--baseline, --finetuned" in capsys.readouterr().err
    bad = dump("bad", {"loss": 2.0, "ppl": 7.4})
    assert main([*args[:8], bad, *args[9:]]) == 1
    assert "missing evaluation field(s) tokens, examples" in capsys.readouterr().err


# ---- THE GENERIC SMOKE RUN -----------------------------------------------------------------------

def test_generic_smoke_run(tmp_path):
    """The whole generic DAG on config/generic_smoke.yaml with the real stages: the tiny random
    model fine-tuned on tests/data/generic, test loss and perplexity before and after."""
    for module in (*STAGE_MODULES, "segback.experiment.evaluate"):
        pytest.importorskip(module, reason=f"stage module {module} not written yet")
    work = tmp_path / "work"
    work.mkdir()
    cfg = ["--cores", "2", *generic_cfg(tmp_path)]

    tic = time.perf_counter()
    out = snakemake(work, *cfg).stdout
    wall = time.perf_counter() - tic
    print(f"generic smoke run: {wall:.0f} s")
    assert job_counts(out) == GENERIC_RULES
    result = json.loads((work / RESULT).read_text())
    validate_result(result, GENERIC_SCHEMA)
    assert result["training"]["seq"] == 256 and result["training"]["steps"] == 3
    for side in ("baseline", "finetuned"):
        ev = result[side]
        assert ev["examples"] == 3 and ev["tokens"] > 0
        assert ev["ppl"] == pytest.approx(math.exp(ev["loss"]))
    assert result["baseline"]["tokens"] == result["finetuned"]["tokens"]
    assert result["finetuned"]["loss"] != result["baseline"]["loss"]  # the adapter was used
    export = work / "results/tiny/generic/seq256/export"
    assert (export / "mlx" / "adapters.safetensors").exists()

    out = snakemake(work, *cfg).stdout
    assert "Nothing to be done" in out, out[-2000:]
    assert wall < 600, f"generic smoke run took {wall:.0f} s"
