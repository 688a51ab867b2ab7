# segback: the conversation-chunking fine-tuning experiment as a Snakemake workflow, or the same
# DAG on your own data (`task: generic`, docs/workflow.md "Your own data").
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
# (workflow/rules/common.smk, docs/workflow.md "Sweeps").

import os
import sys

from snakemake.utils import min_version

from segback.experiment import workflow_lock
from segback.experiment.config_check import ConfigError, checked_configfile, prepare_config

min_version("9.0")

# A lock left by a Snakemake that was killed (kill -9, power loss) is freed, so the same
# command also goes on after those (segback/experiment/workflow_lock.py); a live one's is kept.
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


# The default config, read only after segback has checked it is YAML (a syntax error names the
# file and line; `--configfile` files are read by Snakemake before this file runs: `make run`
# checks them first with `python -m segback.experiment.config_check`).
configfile: checked_configfile("config/config.yaml")


# `--config` strings in the schema's types, the `dataset` shorthand, the schema and every check
# a schema cannot make (segback/experiment/config_check.py): one paragraph naming each key, no
# traceback.
try:
    prepare_config(config, os.path.join(workflow.basedir, "workflow/schemas/config.schema.json"),
                   workflow.configfiles)
except ConfigError as e:
    sys.exit(str(e))


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
