# Shared definitions: the segback command, config shortcuts, wildcard constraints, and small
# path helpers. No stage logic lives here.

import json
import os
import re
import shlex
import shutil
import sys
import types

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
DATA = config.get("data")  # the chunking builder's options (task: chunking)
GPU = config["resources"]["gpu"]
MEM_MB = config["resources"]["mem_mb"]


# ---- task ----------------------------------------------------------------------------------------
# `task: chunking` (default) is the conversation-chunking experiment: results/{model}/... and the
# target results/{model}_chunk_score.json. `task: generic` runs the same DAG on the user's own
# data (`dataset`): everything that depends on that data lives in results/{model}/{name}/ (RUN),
# beside the prepared model results/{model}/model that both tasks share, and the target is
# results/{model}_{name}_eval.json (held-out loss and perplexity, before and after).
TASK = config.get("task", "chunking")
GENERIC = TASK == "generic"
DATASET_DEFAULTS = {
    "name": "generic", "mask_prompt": True, "prompt_feature": "prompt",
    "completion_feature": "completion", "chat_feature": "messages", "text_feature": "text",
    "valid_fraction": 0.1, "test_fraction": 0.1, "seed": 0, "scorer": None,
}
DATASET = {**DATASET_DEFAULTS, **config["dataset"]} if GENERIC else None
NAME = DATASET["name"] if GENERIC else None
SCORER = DATASET["scorer"] if GENERIC else "chunking"
# Where a model's data-dependent outputs, logs and benchmarks live ({model} is the wildcard).
RUN = f"results/{{model}}/{NAME}" if GENERIC else "results/{model}"
LOGS = f"results/logs/{{model}}/{NAME}" if GENERIC else "results/logs/{model}"
BENCH = f"results/benchmarks/{{model}}/{NAME}" if GENERIC else "results/benchmarks/{model}"
# The result of one branch (sweeps) and the sweep table, without the .json.
BRANCH_RESULT = "result" if GENERIC else "chunk_score"
SWEEP_TABLE = f"results/{NAME}_sweep_summary" if GENERIC else "results/sweep_summary"
# segback train's --mask-prompt (chunking: always on)
MASK_PROMPT_FLAG = "--no-mask-prompt" if GENERIC and not DATASET["mask_prompt"] else "--mask-prompt"


def run_dir(model):
    """A model's RUN directory: results/{model} (chunking) or results/{model}/{name}."""
    return RUN.replace("{model}", model)


def result_file(model):
    """The final result of a config without lists."""
    return f"results/{model}_{NAME}_eval.json" if GENERIC else f"results/{model}_chunk_score.json"


# ---- sweeps --------------------------------------------------------------------------------------
# `model`, `seq`, `train.lora_rank` and `train.window` may each be a list: the DAG then has one
# branch per combination (models x seqs x windows x ranks), sharing what does not depend on the
# swept keys (the dataset; per model the checkpoint, test set and baseline; per model and seq the
# filtered train/valid data). A branch's directory is results/{model}/seq{seq}/, with
# `-w{window}` appended when it trains on windows of the cases (train.window, task chunking) and
# `-r{rank}` only when the rank is swept (results/{model}/seq{seq}-w{window}-r{rank}/), so the
# `seq` wildcard is the branch. A config without lists has exactly one branch,
# results/{model}/seq{seq}/, and the usual target results/{model}_chunk_score.json.
def _as_list(value):
    return list(value) if isinstance(value, list) else [value]


MODELS = _as_list(MODEL)
SEQS = _as_list(SEQ)
LORA_RANKS = _as_list(TRAIN["lora_rank"])
RANK_SWEPT = isinstance(TRAIN["lora_rank"], list)
# train.window: null (whole cases), a window length, or a list of them (a sweep); absent = null.
WINDOW = TRAIN.get("window")
WINDOWS = _as_list(WINDOW)
WINDOW_SWEPT = isinstance(WINDOW, list)
SWEEP = any(isinstance(v, list) for v in (MODEL, SEQ, TRAIN["lora_rank"], WINDOW))
_BRANCH_TAG = re.compile(r"(\d+)(?:-w(\d+))?(?:-r(\d+))?")


def branch_tag(seq, rank, window=None):
    """The `seq` wildcard of a branch: `512`, `512-w256` for windows of 256 tokens of the cases
    that fit 512, with `-r8` appended when train.lora_rank is swept."""
    tag = f"{seq}-w{window}" if window else str(seq)
    return f"{tag}-r{rank}" if RANK_SWEPT else tag


BRANCHES = [
    {"model": m, "seq": s, "lora_rank": r, "window": w, "tag": branch_tag(s, r, w)}
    for m in MODELS
    for s in SEQS
    for w in WINDOWS
    for r in LORA_RANKS
]
# The keys naming a branch in the sweep table (the window only where train.window is set).
BRANCH_KEYS = ("model", "seq", "lora_rank") + (("window",) if "window" in TRAIN else ())


def _branch(wildcards):
    """(seq, window or None, rank or None) named by a branch's `seq` wildcard."""
    seq, window, rank = _BRANCH_TAG.fullmatch(wildcards.seq).groups()
    return int(seq), window and int(window), rank and int(rank)


def seq_len(wildcards):
    """The training length of a branch: its window, or its `seq` for whole cases."""
    seq, window, _ = _branch(wildcards)
    return window or seq


def data_tag(wildcards):
    """Where a branch's training data lives, seq{data_tag}/data/: the branch without its rank
    (the ranks of one length and window share their data)."""
    return wildcards.seq.partition("-r")[0]


def batch_size(wildcards):
    """Rows per micro-batch (the global batch): train.window_batch_size on windows, so a step
    holds as many tokens as a whole case does; else train.batch_size."""
    if _branch(wildcards)[1]:
        return TRAIN.get("window_batch_size", TRAIN["batch_size"])
    return TRAIN["batch_size"]


def lora_rank(wildcards):
    """The LoRA rank of a branch: named in its path, or the configured (single) rank."""
    rank = _branch(wildcards)[2]
    if rank is not None:
        return rank
    if RANK_SWEPT:
        raise ValueError(
            f"train.lora_rank is swept ({LORA_RANKS}): name the rank in the path, "
            f"results/{{model}}/seq{wildcards.seq}-r{{rank}}/..."
        )
    return TRAIN["lora_rank"]


def single_tag():
    """The branch of a config that sweeps neither `seq`, the rank nor the window
    (results/{model}_...)."""
    if isinstance(SEQ, list) or RANK_SWEPT or WINDOW_SWEPT:
        raise ValueError(
            "config sweeps `seq`, `train.lora_rank` or `train.window`: there is no single "
            f"{result_file('{model}')}; per-branch results are "
            f"{RUN}/seq{{seq}}/{BRANCH_RESULT}.json, the table {SWEEP_TABLE}.json"
        )
    return branch_tag(SEQ, TRAIN["lora_rank"], WINDOW)


def wildcard_tag(wildcards):
    """The job's branch: its `seq` wildcard, or the single configured one."""
    return wildcards.seq if "seq" in wildcards.keys() else single_tag()


# (`model` naming an entry of `models`, reserved names: segback.experiment.config_check.)


wildcard_constraints:
    model="|".join(re.escape(m) for m in sorted(config["models"], key=len, reverse=True)),
    seq=r"\d+(?:-w\d+)?(?:-r\d+)?",
    split="train|valid",
    variant=r"baseline|seq\d+(?:-w\d+)?(?:-r\d+)?/finetuned",
    # `train` is the single config's training stamp; `train-seq{seq}` a sweep branch's.
    stage=r"data|eval|train(?:-seq\d+(?:-w\d+)?(?:-r\d+)?)?",


localrules:
    all,
    config_stamp,
    plots,
    summarize,
    summarize_branch,
    sweep_summary,


def stage_config(model, stage):
    """The config a stage's outputs depend on, as JSON: the params of its stamp (segback stamp).
    `train-seq{seq}` is a sweep branch's training config (its length and rank)."""
    entry = config["models"][model]
    if stage == "train" and WINDOW is not None:  # a single config training on windows
        stage = f"train-seq{single_tag()}"
    if stage.startswith("train-seq"):
        branch = types.SimpleNamespace(seq=stage[len("train-seq"):])
        train = {"model": entry, "seq": seq_len(branch), **TRAIN, "lora_rank": lora_rank(branch)}
        if "window" in TRAIN:  # the branch's own window, and what it was cut from
            seq, window, _ = _branch(branch)
            train |= {"window": window, "batch_size": batch_size(branch)}
            train |= {"window_of_seq": seq} if window else {}
        return json.dumps(train, sort_keys=True)
    parts = {
        "data": {"dataset": DATASET} if GENERIC else {"data": DATA},
        "train": {"model": entry, "seq": SEQ, **TRAIN},
        "eval": {"model": entry, **EVAL},
    }
    return json.dumps(parts[stage], sort_keys=True)


def stamp_files(model, tag=None):
    """The config stamps behind a result: the single config's, or a sweep branch's."""
    train = "train" if tag is None else f"train-seq{tag}"
    return [f"{run_dir(model)}/config/{stage}.json" for stage in ("data", train, "eval")]


def opt(flag, value):
    """`--flag value` for an optional CLI option, or "" when the value is null."""
    return "" if value is None else f"{flag} {shlex.quote(str(value))}"


# ---- data-parallel training ---------------------------------------------------------------------
# train.ranks > 1 runs `segback train` under a launcher (mlx.launch; docs/distributed.md): every
# rank runs the same command on its slice of the global batch (batch_size / ranks rows, as
# mlx_lm.lora splits it). The job keeps the cores Snakemake gives it (`threads`), shared out
# among the ranks; a ring or NCCL launch
# gets a free port at run time, so two launches on one host do not collide. mlx.launch exits 0
# even when a rank fails, so the log is checked for its "Node with rank R exited" warning.
RANKS = TRAIN.get("ranks", 1)
LAUNCHER = TRAIN.get("launcher", "mlx.launch")
BACKEND = TRAIN.get("backend", "ring")
_PORT_FLAG = {"ring": "--starting-port", "nccl": "--nccl-port"}
FREE_PORT = (
    f"{shlex.quote(sys.executable)} -c 'import socket; s = socket.socket(); "
    "s.bind((\"127.0.0.1\", 0)); print(s.getsockname()[1])'"
)


def _launcher_command():
    """The launcher as a command: a bare name not on PATH is looked up beside the interpreter
    (the venv's bin/, where mlx.launch lives when Snakemake runs as .venv/bin/snakemake)."""
    words = shlex.split(LAUNCHER)
    beside = os.path.join(os.path.dirname(sys.executable), words[0])
    if "/" not in words[0] and not shutil.which(words[0]) and os.access(beside, os.X_OK):
        words[0] = beside
    return shlex.join(words)


def train_command():
    """The shell command that starts training: `segback train` (one process), or its launch on
    train.ranks ranks. Literal braces are doubled for Snakemake; it fills in {threads}."""
    if RANKS == 1:
        return "segback train"
    esc = lambda text: text.replace("{", "{{").replace("}", "}}")
    per_rank = f"$(( {{threads}} >= {RANKS} ? {{threads}} / {RANKS} : 1 ))"
    port = f' {_PORT_FLAG[BACKEND]} "$({esc(FREE_PORT)})"' if BACKEND in _PORT_FLAG else ""
    return (
        f"{esc(_launcher_command())} -n {RANKS} --backend {esc(shlex.quote(BACKEND))}{port}"
        f" --env OMP_NUM_THREADS={per_rank} --env OPENBLAS_NUM_THREADS={per_rank}"
        f" -- {esc(SEGBACK)} train"
    )


def launch_check():
    """After a launch: fail when the launcher reported a failed rank (mlx.launch exits 0)."""
    if RANKS == 1:
        return ""
    return (
        " && if grep -Eq 'Node with rank [0-9]+ (exited with code|was killed)' {log}; then"
        " echo 'segback: a training rank failed (the launcher exits 0 regardless)' >> {log};"
        " false; fi"
    )


def model_entry(wildcards):
    return config["models"][wildcards.model]


def model_source(wildcards):
    """(source, ref) for `segback prepare-model`; a hub model with `path` loads locally."""
    m = model_entry(wildcards)
    if m["source"] == "hub" and m.get("path"):
        return "local", m["path"]
    return m["source"], m["ref"]


def model_extra(wildcards):
    """prepare-model's options: a gguf or random model's stored dtype, a random model's
    tokenizer, seed and quantization; "" for none."""
    m = model_entry(wildcards)
    dtype = opt("--dtype", m.get("dtype") if m["source"] in ("gguf", "random") else None)
    if m["source"] != "random":
        return dtype
    bits = m.get("quant_bits")
    flags = (
        opt("--tokenizer-gguf", m.get("tokenizer_gguf")),
        opt("--seed", m.get("seed")),
        opt("--quant-bits", bits),
        opt("--quant-group-size", m.get("quant_group_size") if bits else None),
        dtype,
    )
    return " ".join(x for x in flags if x)


# `segback generate`'s prefill chunk (eval.prefill_step_size): a params entry only when set,
# so the recorded params of configs without it, and their results, stay as they are.
GENERATE_PARAMS = (
    {"prefill": f"--prefill-step-size {int(EVAL['prefill_step_size'])}"}
    if EVAL.get("prefill_step_size") is not None
    else {}
)
GENERATE_FLAGS = " {params.prefill}" if GENERATE_PARAMS else ""


def plan_file(model, seq):
    """The plan train_lora uses: planned by plan_segments, or the configured file. `seq` is the
    branch (its `seq` wildcard)."""
    if TRAIN["plan"] == "auto":
        return f"{run_dir(model)}/seq{seq}/plan.json"
    return TRAIN["plan"]


def benchmark_files(model, seq):
    """NAME=PATH pairs of every stage benchmark behind a result; `seq` is the branch."""
    b = "results/benchmarks"
    s = f"{b}/{model}/seq{seq}"
    seq_only = str(seq).split("-")[0]  # filter_data is shared by the ranks and windows of a length
    data = str(seq).partition("-r")[0]  # window_data by the ranks of a window
    stages = {
        "prepare_model": f"{b}/{model}/prepare_model.tsv",
        "build_dataset": f"{b}/data/build_dataset.tsv",
        "filter_test": f"{b}/{model}/filter_test.tsv",
        "filter_data_train": f"{b}/{model}/seq{seq_only}/filter_data_train.tsv",
        "filter_data_valid": f"{b}/{model}/seq{seq_only}/filter_data_valid.tsv",
        "baseline_eval": f"{b}/{model}/baseline_eval.tsv",
        "score_baseline": f"{b}/{model}/baseline/score.tsv",
        "plan_segments": f"{s}/plan_segments.tsv",
        "train_lora": f"{s}/train_lora.tsv",
        "export_adapter": f"{s}/export_adapter.tsv",
        "finetuned_eval": f"{s}/finetuned_eval.tsv",
        "score_finetuned": f"{s}/finetuned/score.tsv",
        "plots": f"{s}/plots.tsv",
    }
    if data != seq_only:
        stages |= {f"window_data_{split}": f"{b}/{model}/seq{data}/window_data_{split}.tsv"
                   for split in ("train", "valid")}
    if GENERIC:
        stages = generic_benchmarks(model, seq)
    if TRAIN["plan"] != "auto":
        del stages["plan_segments"]
    return " ".join(f"{k}={shlex.quote(v)}" for k, v in stages.items())


def generic_benchmarks(model, seq):
    """benchmark_files' stages of the generic task (the scorer's when one is named)."""
    b = BENCH.replace("{model}", model)
    s = f"{b}/seq{seq}"
    seq_only = str(seq).partition("-r")[0]
    stages = {
        "prepare_model": f"results/benchmarks/{model}/prepare_model.tsv",
        "filter_test": f"{b}/filter_test.tsv",
        "filter_data_train": f"{b}/seq{seq_only}/filter_data_train.tsv",
        "filter_data_valid": f"{b}/seq{seq_only}/filter_data_valid.tsv",
        "baseline_eval": f"{b}/baseline_eval.tsv",
        "plan_segments": f"{s}/plan_segments.tsv",
        "train_lora": f"{s}/train_lora.tsv",
        "export_adapter": f"{s}/export_adapter.tsv",
        "finetuned_eval": f"{s}/finetuned_eval.tsv",
        "plots": f"{s}/plots.tsv",
    }
    if SCORER:
        stages |= {
            "baseline_generate": f"{b}/baseline_generate.tsv",
            "score_baseline": f"{b}/baseline/score.tsv",
            "finetuned_generate": f"{s}/finetuned_generate.tsv",
            "score_finetuned": f"{s}/finetuned/score.tsv",
        }
    return stages
