# Shared definitions: the segback command, config shortcuts, wildcard constraints, and small
# path helpers. No stage logic lives here.

import json
import os
import re
import shlex
import sys

# Rules call `segback <command>` exactly as docs/CONTRACTS.md writes it. `segback` is a shell
# function running the CLI through the interpreter that runs Snakemake (the venv's), so rules never
# depend on PATH. The SEGBACK environment variable replaces that command (e.g. a container wrapper
# or the test suite's stand-in).
SEGBACK = os.environ.get("SEGBACK") or f"{shlex.quote(sys.executable)} -m segback.cli"

shell.executable("bash")
# (Snakemake formats the prefix like a shell command: literal braces are doubled.)
_SEGBACK_ESCAPED = SEGBACK.replace("{", "{{").replace("}", "}}")
shell.prefix(f'set -euo pipefail; segback() {{{{ {_SEGBACK_ESCAPED} "$@"; }}}}; ')

# Model-running rules (prepare, plan, train, generate) take every core the user gives the
# workflow (`--cores N` or `all`); Snakemake scales this down to --cores and sets
# OMP_NUM_THREADS / OPENBLAS_NUM_THREADS to it, so `--cores 1` still runs them, one at a time.
def HEAVY_THREADS(wildcards):
    return max(1, int(workflow.cores))

MODEL = config["model"]
SEQ = config["seq"]
TRAIN = config["train"]
EVAL = config["eval"]
DATA = config["data"]
GPU = config["resources"]["gpu"]
MEM_MB = config["resources"]["mem_mb"]

if MODEL not in config["models"]:
    raise ValueError(
        f"config: model {MODEL!r} is not an entry of `models` "
        f"(known: {', '.join(sorted(config['models']))})"
    )

# Names that are results/ folders of their own cannot be model names.
_RESERVED = {"data", "logs", "benchmarks"}
if _RESERVED & set(config["models"]):
    raise ValueError(f"config: model names {sorted(_RESERVED)} are reserved")


wildcard_constraints:
    model="|".join(re.escape(m) for m in sorted(config["models"], key=len, reverse=True)),
    seq=r"\d+",
    split="train|valid",
    variant=r"baseline|seq\d+/finetuned",
    stage="data|train|eval",


localrules:
    all,
    config_stamp,
    plots,
    summarize,


def stage_config(model, stage):
    """The config a stage's outputs depend on, as JSON: the params of its stamp (segback stamp)."""
    entry = config["models"][model]
    parts = {
        "data": {"data": DATA},
        "train": {"model": entry, "seq": SEQ, **TRAIN},
        "eval": {"model": entry, **EVAL},
    }
    return json.dumps(parts[stage], sort_keys=True)


def opt(flag, value):
    """`--flag value` for an optional CLI option, or "" when the value is null."""
    return "" if value is None else f"{flag} {shlex.quote(str(value))}"


def model_entry(wildcards):
    return config["models"][wildcards.model]


def model_source(wildcards):
    """(source, ref) for `segback prepare-model`; a hub model with `path` loads locally."""
    m = model_entry(wildcards)
    if m["source"] == "hub" and m.get("path"):
        return "local", m["path"]
    return m["source"], m["ref"]


def model_extra(wildcards):
    m = model_entry(wildcards)
    if m["source"] != "random":
        return ""
    return " ".join(x for x in (opt("--tokenizer-gguf", m.get("tokenizer_gguf")),
                                opt("--seed", m.get("seed"))) if x)


def plan_file(model, seq):
    """The plan train_lora uses: planned by plan_segments, or the configured file."""
    if TRAIN["plan"] == "auto":
        return f"results/{model}/seq{seq}/plan.json"
    return TRAIN["plan"]


def benchmark_files(model, seq):
    """NAME=PATH pairs of every stage benchmark behind results/{model}_chunk_score.json."""
    b = "results/benchmarks"
    s = f"{b}/{model}/seq{seq}"
    stages = {
        "prepare_model": f"{b}/{model}/prepare_model.tsv",
        "build_dataset": f"{b}/data/build_dataset.tsv",
        "filter_test": f"{b}/{model}/filter_test.tsv",
        "filter_data_train": f"{s}/filter_data_train.tsv",
        "filter_data_valid": f"{s}/filter_data_valid.tsv",
        "baseline_eval": f"{b}/{model}/baseline_eval.tsv",
        "score_baseline": f"{b}/{model}/baseline/score.tsv",
        "plan_segments": f"{s}/plan_segments.tsv",
        "train_lora": f"{s}/train_lora.tsv",
        "export_adapter": f"{s}/export_adapter.tsv",
        "finetuned_eval": f"{s}/finetuned_eval.tsv",
        "score_finetuned": f"{s}/finetuned/score.tsv",
        "plots": f"{s}/plots.tsv",
    }
    if TRAIN["plan"] != "auto":
        del stages["plan_segments"]
    return " ".join(f"{k}={shlex.quote(v)}" for k, v in stages.items())
