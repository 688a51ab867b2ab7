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

import os
import sys

from snakemake.utils import min_version

from segback.config_check import ConfigError, check_config

min_version("9.0")


configfile: "config/config.yaml"


try:
    check_config(config, os.path.join(workflow.basedir, "workflow/schemas/config.schema.json"))
except ConfigError as e:  # one paragraph, no traceback
    sys.exit(str(e))


report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"


rule all:
    input:
        f"results/{MODEL}_chunk_score.json",
    default_target: True


include: "workflow/rules/prepare.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/results.smk"
