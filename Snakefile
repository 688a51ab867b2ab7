# segback: the conversation-chunking fine-tuning experiment as a Snakemake workflow.
#
#   snakemake --cores 1 --configfile config/config.yaml results/gemma3_chunk_score.json
#   snakemake --cores 1 --configfile config/config.yaml --report results/report.html
#
# The DAG: prepare_model -> build_dataset -> filter_test / filter_data -> baseline_eval ->
# plan_segments -> train_lora -> export_adapter -> finetuned_eval -> score -> plots -> summarize.
# Each rule calls one `segback <command>` (docs/CONTRACTS.md); the logic lives in the package.
# Everything that depends on the training length `seq` has `seq{seq}` in its path, so changing
# `seq` re-runs exactly the seq-dependent rules.
#
# Sweeps: `model`, `seq` and `train.lora_rank` may be lists; the DAG then has one branch per
# combination (shared stages run once) and `all` targets results/sweep_summary.json (.md, .html),
# one row per branch. Paths and targets of a config without lists are unchanged
# (workflow/rules/common.smk, README "Sweeps").

import os
import sys

from snakemake.utils import min_version

from segback.config_check import ConfigError, check_config

min_version("9.0")


configfile: "config/config.yaml"


# `--config seq=[1024,2048]` reads list items as strings (Snakemake parses --config values with
# YAML's base loader): make integer-looking ones integers before the schema check.
for _key in ("seq",):
    if isinstance(config.get(_key), list):
        config[_key] = [int(v) if isinstance(v, str) and v.isdigit() else v for v in config[_key]]


try:
    check_config(config, os.path.join(workflow.basedir, "workflow/schemas/config.schema.json"))
except ConfigError as e:  # one paragraph, no traceback
    sys.exit(str(e))


report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"


rule all:
    input:
        "results/sweep_summary.json" if SWEEP else f"results/{MODEL}_chunk_score.json",
    default_target: True


include: "workflow/rules/prepare.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/results.smk"
