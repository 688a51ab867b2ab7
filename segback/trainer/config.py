"""`segback train`'s options: each declared once, as a `TrainConfig` field with its type and help.

The command line (`segback.trainer.arguments`) and the config file
(`segback.trainer.config_file`, YAML or JSON) are generated from that declaration; engine options
come from `segback.engine.options`' own declaration (`segback.trainer.engine_request`). Names are
mlx-lm's (`mlx_lm.lora`), so its example config and the `adapter_config.json` it writes (or we
write) load with `-c`. Old segback names stay as aliases (`--seq`, `--grad-accum`, `--val-every`)
or as extras that add something (`--lora-rank`, `--warmup`, `--plan`, `--resume`, ...). Values
are checked here, at the edge (`segback.trainer.values`): a bad one fails with a message naming
the option, before any model is loaded.

Precedence: declared defaults < the config file < the command line.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from segback.trainer import engine_request
from segback.trainer.engine_request import ENGINE_NAMES
from segback.trainer.values import FINE_TUNE_TYPES, MAPPING, MEASURE, OPTIMIZERS, PLAN, \
    SCHEDULE, SCHEDULES, SIZE, STRINGS, TrainConfigError, check_lora_parameters, \
    check_optimizer_config, convert, refuse_unknown

# Keys mlx-lm config files carry that segback ignores: the config file's own path.
IGNORED_KEYS = ("config",)


def option(default: Any, type_: Any, help: str, *, aliases: tuple[str, ...] = (),
           choices: tuple | None = None, check: Any = None, cli: bool = True,
           group: str = "mlx-lm", fills: str | None = None, metavar: str | None = None) -> Any:
    """A field of TrainConfig: its type, help and checks in `metadata` (as mlx-lm's
    TrainingArgs). `check(value)` returns None or what is wrong; `fills` names the mapping key
    an extra writes into (`lora_parameters.rank`); `cli=False`: config file only."""
    meta = dict(type=type_, help=help, aliases=aliases, choices=choices, check=check, cli=cli,
                group=group, fills=fills, metavar=metavar)
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: json.loads(json.dumps(default)), metadata=meta)
    return field(default=default, metadata=meta)


def at_least(n: float, note: str = ""):
    return lambda v: None if v >= n else f"must be >= {n}{note}"


def positive(v: float) -> str | None:
    return None if v > 0 else "must be > 0"


def layers(v: int) -> str | None:
    return None if v == -1 or v >= 1 else "must be >= 1, or -1 (-1 means all layers)"


def batches(v: int) -> str | None:
    return None if v >= -1 else "must be >= 0, or -1 (-1 means all batches)"


@dataclass
class TrainConfig:
    """Every `segback train` option (config-file keys are these names, - or _)."""

    # mlx-lm's options (mlx_lm.lora), in its order.
    model: str | None = option(None, str, "model directory (mlx_lm.load layout) or a random "
                               "geometry name (segback.models.random_init)")
    train: bool | None = option(None, bool, "train (default: unless only --test is given)")
    data: str | None = option(None, str, "directory with {train, valid, test}.jsonl, a data "
                              "file or a Hugging Face dataset name (segback.data)")
    fine_tune_type: str = option("lora", str, "what is trained: LoRA, DoRA or full weights of "
                                 "the last --num-layers layers", choices=FINE_TUNE_TYPES)
    optimizer: str = option("adam", str, "optimizer (mlx.optimizers); its arguments come from "
                            "optimizer_config in the config file", choices=OPTIMIZERS)
    optimizer_config: dict = option({}, MAPPING, "per optimizer: keyword arguments of its "
                                    "class, e.g. {adamw: {weight_decay: 0.05}}", cli=False)
    mask_prompt: bool = option(True, bool, "count only completion tokens in the loss (chat and "
                               "prompt/completion rows); segback's default is on, mlx-lm's off")
    num_layers: int = option(-1, int, "adapt the last N layers; -1 means all layers",
                             check=layers)
    batch_size: int = option(1, int, "examples per micro-batch", check=at_least(1))
    iters: int = option(100, int, "optimizer steps (each of --grad-accumulation-steps "
                        "micro-batches)", check=at_least(1))
    val_batches: int = option(25, int, "validation batches; -1 uses the whole validation set",
                              check=batches)
    learning_rate: float = option(1e-4, float, "peak learning rate", check=positive)
    steps_per_report: int = option(10, int, "steps between progress reports (bar, report "
                                   "line, --report-to); the JSONL log has every step",
                                   check=at_least(1))
    steps_per_eval: int = option(100, int, "steps between validations; 0 = none",
                                 aliases=("val_every",), check=at_least(0))
    grad_accumulation_steps: int = option(1, int, "micro-batches per optimizer step",
                                          aliases=("grad_accum",), check=at_least(1))
    resume_adapter_file: str | None = option(None, str, "adapter weights (.safetensors) loaded "
                                             "before training, as mlx-lm does")
    adapter_path: str = option("adapters", str, "output directory: adapters.safetensors, "
                               "adapter_config.json, checkpoints/, train_summary.json, log")
    save_every: int = option(100, int, "steps between checkpoints (the last step always "
                             "saves)", check=at_least(0))
    test: bool = option(False, bool, "evaluate test loss and perplexity (test.jsonl) after "
                        "training, or alone without --train")
    test_batches: int = option(500, int, "test batches; -1 uses the whole test set",
                               check=batches)
    max_seq_length: int = option(2048, int, "tokens per example (longer ones are truncated; "
                                 "the plan's sequence length)", aliases=("seq",),
                                 check=at_least(2))
    grad_checkpoint: bool = option(False, bool, "accepted for mlx-lm configs; the segmented "
                                   "backward replaces gradient checkpointing")
    clear_cache_threshold: int = option(0, SIZE, "clear MLX's buffer cache after a step when it "
                                        "holds more than this many bytes (or 2GB, 500MB)",
                                        check=at_least(0))
    lr_schedule: Any = option("cosine", SCHEDULE, "cosine (decay to --min-lr after --warmup) or "
                              "constant; a config file may give mlx-lm's mapping {name, warmup, "
                              "warmup_init, arguments}; null = constant", choices=SCHEDULES,
                              group="segback")
    lora_parameters: dict = option({"rank": 8, "scale": 20.0, "dropout": 0.0}, MAPPING,
                                   "LoRA/DoRA {rank, scale, dropout, keys} as mlx-lm",
                                   cli=False)
    report_to: str | None = option(None, str, "report to wandb, swanlab or 'wandb,swanlab' "
                                   "(mlx-lm's callbacks; the package must be installed)")
    project_name: str | None = option(None, str, "project name for --report-to")
    seed: int = option(0, int, "LoRA init, data order and dropout")
    trust_remote_code: bool = option(False, bool, "not supported: segback loads models with "
                                     "mlx_lm.load's defaults")
    training_mode: str = option("normal", str, "only 'normal' (supervised fine-tuning)",
                                cli=False)
    # mlx-lm's data options (mlx_lm/tuner/datasets.py), config file only.
    hf_dataset: Any = option(None, MAPPING, "Hugging Face dataset(s) {path, train_split, ...}",
                             cli=False)
    prompt_feature: str = option("prompt", str, "prompt key of completion rows", cli=False)
    completion_feature: str = option("completion", str, "completion key of completion rows",
                                     cli=False)
    chat_feature: str = option("messages", str, "messages key of chat rows", cli=False)
    text_feature: str = option("text", str, "text key of text rows", cli=False)

    # segback extras.
    plan: Any = option("auto", PLAN, "segments of the backward: auto (the planner), a plan "
                       "JSON file (segback plan) or layers per segment", group="segback")
    target_gb: float | None = option(None, float, "with --plan auto: the planner's memory "
                                     "target in GB (default: the plan of least peak memory)",
                                     check=positive, group="segback")
    measure_plan: int | str = option("auto", MEASURE, "with --plan auto: time N candidate "
                                     "plans for one step each on this model and train with the "
                                     "fastest measured within --target-gb (0: the cost model "
                                     "alone; auto: 3 on a GPU with --target-gb, else 0)",
                                     group="segback")
    lora_rank: int | None = option(None, int, "LoRA rank (fills lora_parameters.rank; 8)",
                                   check=at_least(1), fills="lora_parameters.rank",
                                   group="segback")
    lora_scale: float | None = option(None, float, "LoRA scale = PEFT alpha / r (fills "
                                      "lora_parameters.scale; 20)", fills="lora_parameters.scale",
                                      group="segback")
    lora_dropout: float | None = option(None, float, "LoRA dropout (fills "
                                        "lora_parameters.dropout; 0)",
                                        fills="lora_parameters.dropout", group="segback")
    lora_keys: list | None = option(None, STRINGS, "module paths inside a layer, e.g. "
                                    "self_attn.q_proj (fills lora_parameters.keys; default: all "
                                    "linears)", fills="lora_parameters.keys", group="segback")
    warmup: int | None = option(None, int, "linear warmup steps (fills lr_schedule.warmup; 0)",
                                check=at_least(0), group="segback")
    min_lr: float = option(0.0, float, "the cosine schedule's floor", check=at_least(0),
                           group="segback")
    weight_decay: float | None = option(None, float, "weight decay (fills optimizer_config; "
                                        "needs an optimizer that has one, e.g. adamw)",
                                        check=at_least(0), group="segback")
    grad_clip: float = option(1.0, float, "clip the global gradient norm; 0 = off",
                              check=at_least(0), group="segback")
    dtype: str = option("auto", str, "base weights: auto = float32 on CPU, bfloat16 on GPU",
                        choices=("auto", "float32", "bfloat16", "float16"), group="segback")
    keep_checkpoints: int = option(3, int, "newest checkpoints kept; 0 = all",
                                   check=at_least(0), group="segback")
    resume: bool = option(True, bool, "continue from the newest checkpoint in --adapter-path, "
                          "bit for bit", group="segback")
    log: str | None = option(None, str, "JSONL log (default ADAPTER_PATH/train_log.jsonl)",
                             group="segback")
    checkpoint_dir: str | None = option(None, str, "where checkpoints live (default "
                                        "ADAPTER_PATH/checkpoints); give a directory your "
                                        "workflow manager does not delete with a failed job's "
                                        "outputs, and a re-run resumes", group="segback")
    clean_checkpoints: bool = option(False, bool, "remove all but the last checkpoint once "
                                     "the run has finished and the adapter is written (the "
                                     "last makes a rerun of the finished run instant)",
                                     group="segback")
    parent_pid: int | None = option(None, int, "stop, as on SIGTERM, when process PID exits "
                                    "(a workflow passes its own: a trainer orphaned by a "
                                    "killed workflow does not train on)", group="segback")
    restart_on_change: bool = option(False, bool, "checkpoints made with other settings, "
                                     "data or model are removed and training starts afresh "
                                     "(default: refuse to resume, naming what changed)",
                                     group="segback")
    pack: bool = option(False, bool, "pack several training examples into each row of "
                        "--max-seq-length tokens (block-diagonal attention: the loss and "
                        "gradients equal mlx-lm's on the examples unpacked); with --attention "
                        "chunked only each example's own block is computed; validation and "
                        "test stay unpacked; needs an untiled plan", group="segback")
    context_parallel: int = option(1, int, "split each sequence over this many ranks of "
                                   "mlx.launch (ring attention, exact); the world is data x "
                                   "context ranks; --plan auto plans each rank's shard; "
                                   "not with --pack", check=at_least(1),
                                   group="segback")
    context_order: str = option("zigzag", str, "how --context-parallel shards a sequence: "
                                "zigzag (each rank an early and a late piece: causal work "
                                "balanced) or contiguous", choices=("zigzag", "contiguous"),
                                group="segback")
    progress: bool = option(True, bool, "tqdm progress bar", group="segback")
    engine: dict = option({}, MAPPING, "engine options, typed (a config file may give them "
                          "flat: tile: 2048, offload: true, ...)", cli=False, group="segback")

    def __post_init__(self) -> None:
        for f in fields(self):
            setattr(self, f.name, convert(f, getattr(self, f.name)))
        for f in fields(self):  # extras fill mlx-lm's mappings, then are spent
            target, value = f.metadata["fills"], getattr(self, f.name)
            if target and value is not None:
                mapping, key = target.split(".")
                getattr(self, mapping)[key] = value
                setattr(self, f.name, None)
        self.lora_parameters = check_lora_parameters(self.lora_parameters)
        self.optimizer_config = check_optimizer_config(self.optimizer_config)
        self.engine = engine_request.parse(self.engine)
        if self.training_mode != "normal":
            raise TrainConfigError(
                f"training_mode {self.training_mode!r} is not supported: segback train does "
                "supervised fine-tuning (training_mode: normal); for DPO, ORPO, GRPO and other "
                "preference training use the mlx-lm-lora package (mlx_lm_lora.train)")
        if self.trust_remote_code:
            raise TrainConfigError("trust_remote_code is not supported: segback loads models with "
                                   "mlx_lm.load's defaults; convert the model with mlx_lm.convert")
        if self.weight_decay is not None:
            self.optimizer_config.setdefault(self.optimizer, {})["weight_decay"] = \
                self.weight_decay
            self.weight_decay = None
        if self.train is False and not self.test:
            raise TrainConfigError("nothing to do: give --train and/or --test (as mlx_lm.lora)")

    @property
    def do_train(self) -> bool:
        return self.train if self.train is not None else not self.test

    @classmethod
    def from_dict(cls, values: dict[str, Any], where: str = "options") -> TrainConfig:
        """Options from a mapping whose keys are option names, aliases or engine options."""
        return cls(**normalize(values, where))

    def to_dict(self) -> dict[str, Any]:
        """Every option, JSON-ready: what adapter_config.json and checkpoints record."""
        return asdict(self)

    def lr_schedule_config(self) -> dict | None:
        """mlx-lm's lr_schedule mapping (`mlx_lm.tuner.utils.build_schedule`), or None for a
        constant --learning-rate. The name form ramps from lr / (warmup + 1), so the first step
        already learns."""
        if isinstance(self.lr_schedule, dict):
            d = dict(self.lr_schedule)
            if self.warmup is not None:
                d["warmup"] = self.warmup
            return d
        lr, warmup = self.learning_rate, self.warmup or 0
        if self.lr_schedule == "cosine":
            d = {"name": "cosine_decay",
                 "arguments": [lr, max(self.iters - warmup, 1), self.min_lr]}
        elif warmup:
            d = {"name": "linear_schedule", "arguments": [lr, lr, 1]}
        else:
            return None
        if warmup:
            d |= {"warmup": warmup, "warmup_init": lr / (warmup + 1)}
        return d


FIELDS = {f.name: f for f in fields(TrainConfig)}
ALIASES = {a: f.name for f in fields(TrainConfig) for a in f.metadata["aliases"]}


def normalize(values: dict[str, Any], where: str = "options") -> dict[str, Any]:
    """Option names from keys as a config file or a caller gives them: '-' or '_', aliases,
    engine options flat or under `engine:`; unknown keys refused with a did-you-mean."""
    out: dict[str, Any] = {}
    engine = dict(values.get("engine") or {})
    known = [*FIELDS, *ALIASES, *ENGINE_NAMES, *IGNORED_KEYS]
    for key, v in values.items():
        k = str(key).replace("-", "_")
        if k in IGNORED_KEYS or k == "engine":
            continue
        if k in ENGINE_NAMES:
            engine[k] = v
            continue
        refuse_unknown({k: v}, known, where)
        out[ALIASES.get(k, k)] = v
    if engine:
        out["engine"] = engine
    return out
