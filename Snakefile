# segback: the conversation-chunking fine-tuning experiment as a Snakemake workflow, or the same
# DAG on your own data (`task: generic`, README "Your own data").
#
#   snakemake --cores 1 --configfile config/config.yaml results/gemma3_chunk_score.json
#   snakemake --cores 1 --configfile config/config.yaml --report results/report.html
#   snakemake --cores 2 --configfile config/generic_smoke.yaml    # results/tiny_generic_eval.json
#
# The DAG: prepare_model -> build_dataset -> filter_test / filter_data -> baseline_eval ->
# plan_segments -> train_lora -> export_adapter -> finetuned_eval -> score -> plots -> summarize.
# Each rule calls one `segback <command>` (docs/CONTRACTS.md); the logic lives in the package.
# Everything that depends on the training length `seq` has `seq{seq}` in its path, so changing
# `seq` re-runs exactly the seq-dependent rules.
#
# `task: generic` reads `dataset` (a local directory or JSONL file, or a Hugging Face dataset)
# in place of build_dataset, filters it with `segback evaluate --rows`, and evaluates held-out
# test loss and perplexity (`segback evaluate`) before and after fine-tuning (workflow/rules/
# generic.smk): results/{model}_{dataset.name}_eval.json.
#
# Sweeps: `model`, `seq` and `train.lora_rank` may be lists; the DAG then has one branch per
# combination (shared stages run once) and `all` targets results/sweep_summary.json (.md, .html),
# one row per branch. Paths and targets of a config without lists are unchanged
# (workflow/rules/common.smk, README "Sweeps").

import os
import re
import sys

from snakemake.utils import min_version

from segback.experiment import workflow_lock
from segback.experiment.config_check import ConfigError, check_config

min_version("9.0")

# A lock left by a Snakemake that was killed (kill -9, power loss) is freed, so the same
# command also goes on after those (segback/workflow_lock.py); a live one's is kept.
if workflow.is_main_process:
    _stale = workflow_lock.clear_stale()
    if _stale:
        print(_stale, file=sys.stderr)


onstart:
    workflow_lock.claim()


onsuccess:
    workflow_lock.release()


onerror:
    workflow_lock.release()


configfile: "config/config.yaml"


# `--config seq=[1024,2048]` reads list items as strings (Snakemake parses --config values with
# YAML's base loader): make integer-looking ones integers before the schema check.
for _key in ("seq",):
    if isinstance(config.get(_key), list):
        config[_key] = [int(v) if isinstance(v, str) and v.isdigit() else v for v in config[_key]]


def _dataset_value(key, value):
    """A `dataset` value as --config gives it (a string) in the schema's type."""
    if not isinstance(value, str):
        return value
    if key == "mask_prompt" and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if key == "scorer" and value.lower() in ("null", "none", ""):
        return None
    if key == "seed" and value.lstrip("-").isdigit():
        return int(value)
    if key in ("valid_fraction", "test_fraction"):
        try:
            return float(value)
        except ValueError:
            return value
    return value


# `dataset: my.jsonl` (or `--config dataset=my.jsonl`) is short for {path: ...} when the path
# exists, else for {hf: ...} (a Hugging Face dataset name), as `segback train --data` reads it.
if isinstance(config.get("dataset"), str):
    _ds = config["dataset"]
    config["dataset"] = {"path": _ds} if os.path.exists(os.path.expanduser(_ds)) else {"hf": _ds}
if isinstance(config.get("dataset"), dict):
    config["dataset"] = {k: _dataset_value(k, v) for k, v in config["dataset"].items()}


try:
    check_config(config, os.path.join(workflow.basedir, "workflow/schemas/config.schema.json"),
                 workflow.configfiles)
except ConfigError as e:  # one paragraph, no traceback
    sys.exit(str(e))


def _check_dataset(dataset):
    """What the schema cannot say about `dataset` (task: generic), one line each."""
    problems = []
    if ("path" in dataset) == ("hf" in dataset):
        problems.append("`dataset`: give `path` (a local directory or data file) or `hf` (a "
                        "Hugging Face dataset name), " + ("not both" if "path" in dataset
                                                         else "one of them"))
    path = dataset.get("path")
    if path is not None and not os.path.exists(os.path.expanduser(path)):
        problems.append(f"`dataset.path`: {path} not found (a relative path is relative to the "
                        f"working directory, {os.getcwd()})")
    name = dataset.get("name", "generic")
    if name in ("model", "data", "baseline", "config", "logs", "benchmarks") or re.match(
            r"seq\d", name):
        problems.append(f"`dataset.name`: {name!r} is a folder name of results/{{model}}/; "
                        "choose another")
    if problems:
        sys.exit("config: the workflow cannot run with this config; fix these keys "
                 "(config/config.yaml documents each):\n  " + "\n  ".join(problems))


if config.get("task") == "generic":
    _check_dataset(config["dataset"])


report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"


rule all:
    input:
        f"{SWEEP_TABLE}.json" if SWEEP else result_file(MODEL),
    default_target: True


include: "workflow/rules/prepare.smk"


if not GENERIC:

    include: "workflow/rules/data.smk"


include: "workflow/rules/train.smk"


if GENERIC:

    include: "workflow/rules/generic.smk"

else:

    include: "workflow/rules/evaluate.smk"


include: "workflow/rules/results.smk"
