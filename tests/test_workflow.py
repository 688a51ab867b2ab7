"""The Snakemake workflow: config schema, DAG shape, caching and rerun semantics, and the smoke run.

Three levels, fastest first:
- schema and dry-run checks (seconds);
- the whole DAG with a stand-in `segback` (SEGBACK env var) that writes contract-shaped outputs,
  so caching and rerun-on-change are checked without running a model (seconds);
- THE SMOKE RUN: the whole DAG on config/smoke.yaml with the real stages (a few minutes on CPU).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from segback.experiment.chunk_result import build_result
from segback.experiment.result_parts import METRICS, ResultError, validate_result

REPO = Path(__file__).resolve().parents[1]
SNAKEFILE = REPO / "Snakefile"
CONFIG = REPO / "config" / "config.yaml"
SMOKE = REPO / "config" / "smoke.yaml"
E4B_GPU = REPO / "config" / "e4b_gpu.yaml"
CONFIG_SCHEMA = REPO / "workflow" / "schemas" / "config.schema.json"
RESULT_SCHEMA = REPO / "segback" / "experiment" / "result.schema.json"

ALL_RULES = {
    "prepare_model": 1, "build_dataset": 1, "filter_test": 1, "filter_data": 2,
    "baseline_eval": 1, "plan_segments": 1, "train_lora": 1, "export_adapter": 1,
    "finetuned_eval": 1, "score": 2, "plots": 1, "summarize": 1, "all": 1, "config_stamp": 3,
}
# What a change of `seq` must re-run: nothing upstream of the seq-dependent stages.
SEQ_RULES = {
    "filter_data": 2, "plan_segments": 1, "train_lora": 1, "export_adapter": 1,
    "finetuned_eval": 1, "score": 1, "plots": 1, "summarize": 1, "all": 1, "config_stamp": 1,
}
# Data-flow edges the DAG must have (producer -> consumer).
EDGES = {
    ("prepare_model", "filter_test"), ("build_dataset", "filter_test"),
    ("prepare_model", "filter_data"), ("build_dataset", "filter_data"),
    ("filter_test", "baseline_eval"), ("prepare_model", "plan_segments"),
    ("filter_data", "train_lora"), ("plan_segments", "train_lora"),
    ("train_lora", "export_adapter"), ("export_adapter", "finetuned_eval"),
    ("filter_test", "finetuned_eval"), ("baseline_eval", "score"), ("finetuned_eval", "score"),
    ("train_lora", "plots"), ("score", "summarize"), ("plots", "summarize"),
    ("train_lora", "summarize"), ("plan_segments", "summarize"), ("summarize", "all"),
}
STAGE_MODULES = (
    "segback.models.prepare", "segback.chunking.build", "segback.chunking.filter",
    "segback.chunking.generate", "segback.chunking.scorer", "segback.planner",
    "segback.trainer.cli", "segback.models.export",
)


# ---- helpers ---------------------------------------------------------------------------------

def snakemake(workdir: Path, *args: str, env: dict | None = None, check: bool = True,
              timeout: float = 900) -> subprocess.CompletedProcess:
    """Run the repo's workflow in `workdir` (results land there); stdout+stderr in `.stdout`."""
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(SNAKEFILE),
           "--directory", str(workdir), *args]
    full_env = {k: v for k, v in os.environ.items() if k != "SEGBACK"}
    full_env.update(env or {})
    proc = subprocess.run(cmd, cwd=workdir, env=full_env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        logs = "\n".join(f"--- {p}\n{p.read_text()[-3000:]}"
                         for p in sorted((workdir / "results" / "logs").rglob("*.log"))
                         ) if (workdir / "results" / "logs").exists() else ""
        pytest.fail(f"snakemake {' '.join(args)} failed ({proc.returncode}):\n"
                    f"{proc.stdout[-6000:]}\n{logs[-12000:]}")
    return proc


def job_counts(output: str) -> dict[str, int]:
    """The 'Job stats' table of a snakemake run/dry-run as {rule: count} (empty if none)."""
    m = re.search(r"Job stats:\s*\n\s*job\s+count\s*\n[-\s]+\n(.*?)\n\s*total\s+\d+", output,
                  re.S)
    if not m:
        return {}
    return {name: int(n) for name, n in re.findall(r"^\s*(\w+)\s+(\d+)\s*$", m.group(1), re.M)}


def rule_edges(workdir: Path, *args: str) -> set[tuple[str, str]]:
    """(producer, consumer) rule pairs from `snakemake --rulegraph`."""
    out = snakemake(workdir, "--rulegraph", *args).stdout
    names = dict(re.findall(r"^\s*(\d+)\[label = \"(\w+)\"", out, re.M))
    return {(names[a], names[b]) for a, b in re.findall(r"^\s*(\d+) -> (\d+)", out, re.M)}


def write_yaml(path: Path, obj: dict) -> Path:
    path.write_text(yaml.safe_dump(obj))
    return path


def result_path(workdir: Path, config: Path) -> Path:
    model = yaml.safe_load(config.read_text())["model"]
    return workdir / "results" / f"{model}_chunk_score.json"


def assert_seq_change_reruns_only_seq_rules(workdir: Path, config: Path, env=None) -> None:
    seq = yaml.safe_load(config.read_text())["seq"]
    out = snakemake(workdir, "-n", "--cores", "2", "--configfile", str(config),
                    "--config", f"seq={seq * 2}", env=env).stdout
    assert job_counts(out) == SEQ_RULES, out[-3000:]


# ---- config schema -----------------------------------------------------------------------------

@pytest.mark.parametrize("path", [CONFIG, SMOKE, E4B_GPU], ids=["config", "smoke", "e4b_gpu"])
def test_configs_match_schema(path):
    import jsonschema

    schema = json.loads(CONFIG_SCHEMA.read_text())
    jsonschema.Draft202012Validator(schema).validate(yaml.safe_load(path.read_text()))


def test_config_schema_errors_name_the_key(tmp_path):
    bad = write_yaml(tmp_path / "bad.yaml", {"train": {"iterz": 3}})
    out = snakemake(tmp_path, "-n", "--configfile", str(CONFIG), str(bad), check=False)
    assert out.returncode != 0
    assert "unknown key `train.iterz`: did you mean `iters`?" in out.stdout, out.stdout[-2000:]
    assert "additionalProperties" not in out.stdout  # one line per key, no schema dump
    out = snakemake(tmp_path, "-n", "--configfile", str(CONFIG), "--config", "seq=long",
                    check=False)
    assert out.returncode != 0 and "'long' is not of type 'integer'" in out.stdout
    out = snakemake(tmp_path, "-n", "--configfile", str(CONFIG), "--config", "model=nope",
                    check=False)
    assert out.returncode != 0 and "`model`: 'nope' is not an entry of `models`" in out.stdout


# ---- DAG ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("config", [CONFIG, SMOKE], ids=["config", "smoke"])
def test_dry_run_has_every_stage(tmp_path, config):
    out = snakemake(tmp_path, "-n", "--cores", "1", "--configfile", str(config)).stdout
    assert job_counts(out) == ALL_RULES, out[-3000:]


def test_e4b_gpu_dry_run_passes_quantization_and_prefill(tmp_path):
    """config/e4b_gpu.yaml: the whole DAG; the random model is prepared 4-bit, generation
    prefills in chunks, and the planner gets the memory target and the tiled engine."""
    out = snakemake(tmp_path, "-n", "-p", "results/e4b_random_chunk_score.json", "--cores", "1",
                    "--configfile", str(E4B_GPU)).stdout
    assert job_counts(out) == {k: v for k, v in ALL_RULES.items() if k != "all"}, out[-3000:]
    assert "--ref e4b " in out and "--quant-bits 4 " in out
    assert out.count("--prefill-step-size 2048") == 2
    assert "--target-gb 10 " in out and "--tile auto" in out and "--offload auto" in out
    assert "--measure auto " in out  # train.measure_plan: the planner times candidates there


def test_measure_plan_reaches_the_planner(tmp_path):
    """train.measure_plan is `segback plan --measure`; a config without it (smoke.yaml) gets
    auto, the planner's own default."""
    out = snakemake(tmp_path, "-n", "-p", "--cores", "1", "--configfile", str(SMOKE)).stdout
    assert "--measure auto " in out, out[-3000:]
    over = write_yaml(tmp_path / "over.yaml", {"train": {"measure_plan": 0}})
    out = snakemake(tmp_path, "-n", "-p", "--cores", "1", "--configfile", str(SMOKE),
                    str(over)).stdout
    assert "--measure 0 " in out and "--measure auto" not in out, out[-3000:]


def test_quant_bits_is_for_random_models(tmp_path):
    bad = write_yaml(tmp_path / "bad.yaml", {"models": {"e4b": {"source": "hub", "ref": "x/y",
                                                                "quant_bits": 4}}})
    out = snakemake(tmp_path, "-n", "--configfile", str(CONFIG), str(bad), check=False)
    assert out.returncode != 0
    assert "`models.e4b.quant_bits`: for source: random only" in out.stdout, out.stdout[-2000:]


def test_rule_graph_order(tmp_path):
    edges = rule_edges(tmp_path, "--configfile", str(SMOKE))
    assert EDGES <= edges, sorted(EDGES - edges)
    # Nothing the baseline needs depends on training.
    upstream = {"baseline_eval"}
    while True:
        more = {a for a, b in edges if b in upstream} - upstream
        if not more:
            break
        upstream |= more
    assert upstream == {"baseline_eval", "filter_test", "prepare_model", "build_dataset"}


# ---- summarize / plots units -------------------------------------------------------------------

def fake_score(mean: float) -> dict:
    s = {k: 0.5 for k in METRICS}
    s.update(n=3, mean_score=mean, mean_generated_tokens=20.0, cases=[{"id": "x"}])
    return s


def test_summarize_builds_valid_result_and_table(tmp_path):
    paths = {}
    for name, obj in {
        "base": fake_score(10.0), "tuned": fake_score(80.5),
        "summary": {"steps": 4, "seq": 512, "batch_size": 1, "segments": [[0, 6], [6, 12]],
                    "peak_gb": 0.4, "seconds": 3.2, "tokens": 900, "first_loss": 5.0,
                    "final_loss": 3.0, "val_loss": 3.5, "tokens_per_second": 280.0,
                    "lora_parameters": {"rank": 4}},
        "plan": {"segments": [[0, 6], [6, 12]], "predicted_peak_gb": 0.5, "seq": 512,
                 "inputs": {"seq": 512}},
    }.items():
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(obj))
    bench = tmp_path / "train_lora.tsv"
    bench.write_text("s\th:m:s\tmax_rss\tmax_vms\n3.5\t0:00:03\t812.5\t900\n")
    out, table = tmp_path / "r.json", tmp_path / "r.html"
    from segback.cli import main

    rc = main(["summarize", "--model-name", "tiny", "--baseline", str(paths["base"]),
               "--finetuned", str(paths["tuned"]), "--train-summary", str(paths["summary"]),
               "--plan", str(paths["plan"]), "--benchmarks", f"train_lora={bench}",
               f"missing={tmp_path / 'nope.tsv'}", "--artifact", "loss_plot=p/loss.png",
               "--out", str(out), "--table", str(table)])
    assert rc == 0
    r = json.loads(out.read_text())
    validate_result(r, RESULT_SCHEMA)
    assert r["delta"]["mean_score"] == pytest.approx(70.5)
    assert "n" not in r["delta"] and "cases" not in r["finetuned"]
    assert r["training"]["segments"] == [[0, 6], [6, 12]]
    assert r["stages"] == {"train_lora": {"seconds": 3.5, "max_rss_mb": 812.5}}
    assert r["artifacts"]["loss_plot"] == "p/loss.png"
    html = table.read_text()
    assert "mean_score" in html and "+70.50" in html


def test_summarize_reports_schema_mismatch(tmp_path, capsys):
    good = fake_score(1.0)
    bad = dict(good, valid_json_rate=1.7)  # a rate above 1
    result = build_result("m", good, bad, {"steps": 1, "seq": 8, "segments": [[0, 2]],
                                           "peak_gb": 0.1, "seconds": 1.0},
                          {"segments": [[0, 2]]})
    with pytest.raises(ResultError, match=r"finetuned/valid_json_rate"):
        validate_result(result, RESULT_SCHEMA)
    del good["pk"]
    with pytest.raises(ResultError, match=r"missing score field\(s\) pk"):
        build_result("m", good, good, {}, {})


def test_plots_write_pngs(tmp_path):
    rows = [{"step": s, "loss": 3.0 / s, "lr": 1e-4, "tokens": 100, "seconds": 0.1,
             "peak_gb": 0.3, "active_gb": 0.1, "cache_gb": 0.05} for s in range(1, 6)]
    rows.append({"step": 5, "val_loss": 1.0})
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    from segback.cli import main

    assert main(["plots", "--log", str(log), "--out-dir", str(tmp_path / "p")]) == 0
    for name in ("loss.png", "memory.png"):
        assert (tmp_path / "p" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- the whole DAG with a stand-in segback ------------------------------------------------------

FAKE_SEGBACK = textwrap.dedent('''
    """Stand-in for `segback`: writes contract-shaped outputs instantly (see docs/CONTRACTS.md).
    summarize, plots and stamp are the real ones: they are part of what is tested."""
    import json, os, shutil, sys
    from pathlib import Path

    cmd, rest = sys.argv[1], sys.argv[2:]
    with open(os.environ["FAKE_SEGBACK_CALLS"], "a") as f:
        f.write(cmd + "\\n")
    if cmd in ("summarize", "plots", "stamp"):
        from segback.cli import main
        sys.exit(main(sys.argv[1:]))
    a, i = {}, 0
    while i < len(rest):
        key = rest[i][2:].replace("-", "_")
        if i + 1 < len(rest) and not rest[i + 1].startswith("--"):
            a[key], i = rest[i + 1], i + 2
        else:
            a[key], i = True, i + 1

    def dump(path, obj):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(obj))

    def rows(path):
        return [json.loads(line) for line in open(path) if line.strip()]

    def dump_rows(path, rs):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text("".join(json.dumps(r) + "\\n" for r in rs))

    if cmd == "prepare-model":
        dump(Path(a["out"]) / "config.json", a)
    elif cmd == "build-data":
        for split in ("train", "valid", "test"):
            n = int(a["n_" + split])
            dump_rows(Path(a["out"]) / f"{split}.jsonl", [{"id": f"{split}{k}"} for k in range(n)])
        dump(Path(a["out"]) / "stats.json", a)
    elif cmd == "filter-data":
        kept = rows(a["data"])
        dump_rows(a["out"], kept)
        dump(a["report"], {"kept": len(kept), "max_tokens": int(a["max_tokens"])})
    elif cmd == "generate":
        dump_rows(a["out"], [{"id": r["id"], "text": "[]", "parsed": [], "prompt_tokens": 9,
                              "generated_tokens": 2, "seconds": 0.0} for r in rows(a["data"])])
    elif cmd == "score":
        n = len(rows(a["pred"]))
        good = "finetuned" in a["pred"]
        s = dict(n=n, mean_score=60.0 if good else 10.0, valid_json_rate=1.0 if good else 0.2,
                 schema_rate=1.0, anchor_rate=0.9, label_rate=1.0, nonempty_rate=1.0,
                 boundary_precision=0.5, boundary_recall=0.5, boundary_f1=0.5, pk=0.3,
                 windowdiff=0.35, rouge_l=0.4, mean_generated_tokens=2.0, cases=[])
        dump(a["out"], s)
    elif cmd == "plan":
        dump(a["out"], {"segments": [[0, 6], [6, 12]], "predicted_peak_gb": 0.2,
                        "seq": int(a["seq"])})
    elif cmd == "train":
        if os.environ.get("FAKE_TRAIN_FAILS"):
            sys.exit("train failed (FAKE_TRAIN_FAILS)")
        out = Path(a["adapter_path"])
        dump(out / "adapter_config.json", {"fine_tune_type": "lora"})
        (out / "adapters.safetensors").write_bytes(b"")
        steps = int(a["iters"])
        dump(out / "train_summary.json", {
            "steps": steps, "seq": int(a["max_seq_length"]), "batch_size": 1,
            "segments": json.load(open(a["plan"]))["segments"], "peak_gb": 0.25,
            "seconds": 1.0, "tokens": 100, "first_loss": 5.0, "final_loss": 4.0,
            "val_loss": 4.2, "tokens_per_second": 100.0})
        log = [{"step": s, "loss": 5.0 - s / steps, "lr": 1e-3, "tokens": 25, "seconds": 0.25,
                "peak_gb": 0.25, "active_gb": 0.1, "cache_gb": 0.05} for s in range(1, steps + 1)]
        dump_rows(a["log"], log + [{"step": steps, "val_loss": 4.2}])
    elif cmd == "export":
        shutil.copytree(a["adapter"], Path(a["out"]) / "mlx")
        dump(Path(a["out"]) / "peft" / "adapter_config.json", {"peft_type": "LORA"})
    else:
        sys.exit(f"fake segback: unknown command {cmd}")
''')


def test_fake_run_caches_and_reruns_exactly_what_changed(tmp_path, fake_env):
    env, calls = fake_env
    work = tmp_path / "work"
    work.mkdir()
    cfg = ["--cores", "2", "--configfile", str(SMOKE)]

    out = snakemake(work, *cfg, env=env).stdout
    assert job_counts(out) == ALL_RULES
    result = json.loads(result_path(work, SMOKE).read_text())
    validate_result(result, RESULT_SCHEMA)
    assert result["delta"]["mean_score"] == pytest.approx(50.0)
    assert result["training"]["seq"] == 512
    assert {"prepare_model", "train_lora", "baseline_eval", "score_finetuned"} <= set(
        result["stages"])
    assert (work / "results" / "tiny" / "seq512" / "plots" / "loss.png").exists()
    for rule in ("prepare_model", "build_dataset", "train_lora", "summarize"):
        assert list((work / "results" / "logs").rglob(f"*{rule}*.log")), rule
        assert list((work / "results" / "benchmarks").rglob(f"*{rule}*.tsv")), rule

    n_calls = len(calls.read_text().split())
    out = snakemake(work, *cfg, env=env).stdout
    assert "Nothing to be done" in out, out[-2000:]
    snakemake(work, *cfg, "--report", "results/report.html", env=env)
    assert (work / "results" / "report.html").stat().st_size > 100_000
    assert len(calls.read_text().split()) == n_calls

    # seq: only the seq-dependent rules (the test set and the baseline do not depend on it).
    assert_seq_change_reruns_only_seq_rules(work, SMOKE, env=env)

    smoke = yaml.safe_load(SMOKE.read_text())

    def changed(name: str, section: str, key: str, value) -> dict:
        over = write_yaml(tmp_path / f"{name}.yaml", {section: {**smoke[section], key: value}})
        return job_counts(snakemake(work, "-n", *cfg, str(over), env=env).stdout)

    # A training option: params trigger on train_lora, not the data or the baseline.
    assert changed("iters", "train", "iters", 5) == {
        "train_lora": 1, "export_adapter": 1, "finetuned_eval": 1, "score": 1, "plots": 1,
        "summarize": 1, "all": 1, "config_stamp": 1}
    # The test-set filter: both evaluations, never training.
    assert changed("evalmax", "eval", "max_prompt_tokens", 400) == {
        "filter_test": 1, "baseline_eval": 1, "finetuned_eval": 1, "score": 2, "summarize": 1,
        "all": 1, "config_stamp": 1}
    # A data option: everything but the model preparation and the plan.
    assert set(changed("data", "data", "seed", 1)) == set(ALL_RULES) - {"prepare_model",
                                                                        "plan_segments"}
    assert changed("data2", "data", "seed", 1)["config_stamp"] == 1  # only the data stamp

    # Actually run the seq change: the new result carries the new seq; the baseline is reused.
    n_calls = len(calls.read_text().split())
    out = snakemake(work, *cfg, "--config", "seq=256", env=env).stdout
    assert job_counts(out) == SEQ_RULES
    ran = calls.read_text().split()[n_calls:]
    assert "prepare-model" not in ran and "build-data" not in ran
    assert json.loads(result_path(work, SMOKE).read_text())["training"]["seq"] == 256


def test_result_follows_the_config_after_a_failed_training_job(tmp_path, fake_env):
    """Run to the end; change train.iters; the training job fails (Snakemake deletes its
    adapter); fix it and run again: the result must carry the new number of steps, never
    "Nothing to be done" over the old result."""
    env, _ = fake_env
    work = tmp_path / "work"
    work.mkdir()
    cfg = ["--cores", "2", "--configfile", str(SMOKE)]
    snakemake(work, *cfg, env=env)
    assert json.loads(result_path(work, SMOKE).read_text())["training"]["steps"] == 4
    smoke = yaml.safe_load(SMOKE.read_text())
    over = write_yaml(tmp_path / "iters.yaml", {"train": {**smoke["train"], "iters": 6}})
    failed = snakemake(work, *cfg, str(over), env={**env, "FAKE_TRAIN_FAILS": "1"},
                       check=False)
    assert failed.returncode != 0
    out = snakemake(work, *cfg, str(over), env=env).stdout
    assert "Nothing to be done" not in out
    result = json.loads(result_path(work, SMOKE).read_text())
    assert result["training"]["steps"] == 6
    assert snakemake(work, *cfg, str(over), env=env).stdout.count("Nothing to be done") == 1


# ---- THE SMOKE RUN -------------------------------------------------------------------------------

def test_smoke_run(tmp_path):
    """The whole DAG on config/smoke.yaml with the real stages, then caching and seq rerun."""
    for module in STAGE_MODULES:
        pytest.importorskip(module, reason=f"stage module {module} not written yet")
    work = tmp_path / "work"
    work.mkdir()
    cfg = ["--cores", "2", "--configfile", str(SMOKE)]

    tic = time.perf_counter()
    out = snakemake(work, *cfg).stdout
    wall = time.perf_counter() - tic
    print(f"smoke run: {wall:.0f} s")
    assert job_counts(out) == ALL_RULES
    path = result_path(work, SMOKE)
    result = json.loads(path.read_text())
    validate_result(result, RESULT_SCHEMA)
    assert result["model"] == "tiny" and result["training"]["seq"] == 512
    assert result["baseline"]["n"] == result["finetuned"]["n"] > 0
    export = work / "results" / "tiny" / "seq512" / "export"
    assert (export / "mlx" / "adapters.safetensors").exists()
    assert (export / "peft" / "adapter_model.safetensors").exists()

    out = snakemake(work, *cfg).stdout
    assert "Nothing to be done" in out, out[-2000:]
    assert_seq_change_reruns_only_seq_rules(work, SMOKE)
    # Budget: 300 s on an idle 2-core CPU; the guard allows for a machine shared with other work.
    assert wall < 600, f"smoke run took {wall:.0f} s (budget 300 s)"


# Interrupts of the real workflow (Ctrl-C, Snakemake or the trainer killed, a power loss) and
# the one command that resumes after each: tests/test_workflow_interrupts.py.
