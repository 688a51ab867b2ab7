"""`segback train`'s options: each declared once, as a `TrainConfig` field with its type and help.

The command line (`add_arguments`) and the config file (`read_config_file`, YAML or JSON) are
generated from that declaration; engine options come from `segback.engine.options`' own
declaration. Names are mlx-lm's (`mlx_lm.lora`), so its example config and the
`adapter_config.json` it writes (or we write) load with `-c`. Old segback names stay as aliases
(`--seq`, `--grad-accum`, `--val-every`) or as extras that add something (`--lora-rank`,
`--warmup`, `--plan`, `--resume`, ...). Values are checked here, at the edge: a bad one fails
with a message naming the option, before any model is loaded.

Precedence: declared defaults < the config file < the command line.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import re
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from segback.engine import options as engine_options
from segback.engine.options import EngineOptions, OptionsError

OPTIMIZERS = ("adam", "adamw", "muon", "sgd", "adafactor")  # mlx_lm.lora's (a test checks)
FINE_TUNE_TYPES = ("lora", "dora", "full")
SCHEDULES = ("cosine", "constant")
LORA_KEYS = ("rank", "scale", "dropout", "keys")
SCHEDULE_KEYS = ("name", "warmup", "warmup_init", "arguments")
DATA_FEATURES = {"prompt_feature": "prompt", "completion_feature": "completion",
                 "chat_feature": "messages", "text_feature": "text"}
# What the planner chooses under --plan auto (these also take "auto" there).
SEARCHED = ("attention", "tile", "offload", "light_tile", "boundaries_on_device")
PLANNER_CHOOSES = ("tile", "offload", "boundaries_on_device")  # "auto" = the planner's choice
ENGINE_KEYS = tuple(f.name for f in fields(EngineOptions))
ENGINE_ALIASES = {"offload_keep": "boundaries_on_device", "head_max_elements": "head_chunk"}
# Keys mlx-lm config files carry that segback ignores: the config file's own path.
IGNORED_KEYS = ("config",)


class TrainConfigError(ValueError):
    """An option with a value segback train cannot run; the message names the option."""


# ---- the declaration -------------------------------------------------------------------------


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


SCHEDULE = "schedule"  # lr_schedule: a name (cosine, constant) or mlx-lm's mapping
PLAN = "plan"  # auto | FILE.json | layers per segment | [[start, stop], ...]
MEASURE = "measure"  # auto | a count >= 0
MAPPING = "mapping"
STRINGS = "strings"
SIZE = "size"  # bytes, or "2GB" as mlx-lm's --clear-cache-threshold


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
    engine: dict = option({}, MAPPING, "engine options (a config file may give them flat: "
                          "tile: 2048, offload: true, ...)", cli=False, group="segback")

    def __post_init__(self) -> None:
        for f in fields(self):
            setattr(self, f.name, _convert(f, getattr(self, f.name)))
        for f in fields(self):  # extras fill mlx-lm's mappings, then are spent
            target, value = f.metadata["fills"], getattr(self, f.name)
            if target and value is not None:
                mapping, key = target.split(".")
                getattr(self, mapping)[key] = value
                setattr(self, f.name, None)
        self.lora_parameters = _lora_parameters(self.lora_parameters)
        self.optimizer_config = _optimizer_config(self.optimizer_config)
        self.engine = _engine(self.engine)
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


# ---- values ----------------------------------------------------------------------------------


def _name(f: Any) -> str:
    flag = f" (--{f.name.replace('_', '-')})" if f.metadata["cli"] else ""
    return f"{f.name}{flag}"


def _number(v: Any, kind: type, what: str) -> Any:
    """An int or float from a number or a string (PyYAML reads 1e-5 as a string)."""
    if isinstance(v, bool):
        raise TrainConfigError(f"{what} must be a number, not {v!r}")
    if isinstance(v, str):
        try:
            v = float(v.strip()) if kind is float or not re.fullmatch(r"\s*[-+]?\d+\s*", v) \
                else int(v)
        except ValueError:
            raise TrainConfigError(f"{what} must be a number, not {v!r}") from None
    if not isinstance(v, (int, float)) or (isinstance(v, float) and not math.isfinite(v)):
        raise TrainConfigError(f"{what} must be a finite number, not {v!r}")
    if kind is int:
        if v != int(v):
            raise TrainConfigError(f"{what} must be a whole number, not {v!r}")
        return int(v)
    return float(v)


def _boolean(v: Any, what: str) -> bool:
    if isinstance(v, bool):
        return v
    low = str(v).strip().lower()
    if low in ("true", "on", "yes", "1", "false", "off", "no", "0"):
        return low in ("true", "on", "yes", "1")
    raise TrainConfigError(f"{what} must be true or false, not {v!r}")


def _size(v: Any, what: str) -> int:
    if isinstance(v, str) and re.fullmatch(r"\s*[\d.]+\s*[MmGg]?[Bb]?\s*", v):
        from mlx_lm.utils import _parse_size  # mlx-lm's --clear-cache-threshold reading

        return _parse_size(v.strip())
    return _number(v, int, what)


def _convert(f: Any, v: Any) -> Any:
    """One option's value in its declared type, checked."""
    kind, what = f.metadata["type"], _name(f)
    if v is None:
        if kind is MAPPING and f.default is MISSING:
            return f.default_factory()  # mlx-lm writes lora_parameters: null for full
        if f.default is not None and f.name != "lr_schedule":  # null lr_schedule: constant
            raise TrainConfigError(f"{what} needs a value")
        return None
    if kind in (int, float):
        v = _number(v, kind, what)
    elif kind is bool:
        v = _boolean(v, what)
    elif kind is SIZE:
        v = _size(v, what)
    elif kind is str:
        if isinstance(v, (dict, list, bool)):
            raise TrainConfigError(f"{what} must be a string, not {v!r}")
        v = str(v)
    elif kind is STRINGS:
        v = [v] if isinstance(v, str) else v
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise TrainConfigError(f"{what} must be a list of strings, not {v!r}")
    elif kind is MAPPING:
        if f.name == "hf_dataset" and isinstance(v, list):
            return v
        if not isinstance(v, dict):
            raise TrainConfigError(f"{what} must be a mapping, not {v!r}")
        v = dict(v)
    elif kind is PLAN:
        v = _plan(v, what)
    elif kind is MEASURE:
        v = "auto" if isinstance(v, str) and v.strip().lower() == "auto" else \
            _number(v, int, what)
        if v != "auto" and v < 0:
            raise TrainConfigError(f"{what} {v!r}: must be auto or >= 0")
    elif kind is SCHEDULE:
        v = _schedule(v, what)
    choices = f.metadata["choices"]
    if choices and isinstance(v, str) and v not in choices:
        raise TrainConfigError(f"{what} must be one of {', '.join(choices)}, not {v!r}")
    check = f.metadata["check"]
    problem = check(v) if check else None
    if problem:
        raise TrainConfigError(f"{what} {v!r}: {problem}")
    return v


def _plan(v: Any, what: str) -> Any:
    if isinstance(v, str) and re.fullmatch(r"\s*\d+\s*", v):
        v = int(v)
    if isinstance(v, bool) or (isinstance(v, int) and v < 1):
        raise TrainConfigError(f"{what} {v!r}: must be auto, a plan file or layers per "
                               "segment >= 1")
    if isinstance(v, (int, str, list)):
        return v
    raise TrainConfigError(f"{what} must be auto, a plan JSON file, layers per segment or a list "
                           f"of [start, stop] ranges, not {v!r}")


def _schedule(v: Any, what: str) -> Any:
    if isinstance(v, str):
        return v
    if not isinstance(v, dict):
        raise TrainConfigError(f"{what} must be {' or '.join(SCHEDULES)} or a mapping "
                               f"{{{', '.join(SCHEDULE_KEYS)}}}, not {v!r}")
    v = dict(v)
    _refuse_unknown(v, SCHEDULE_KEYS, "lr_schedule")
    import mlx.optimizers as optim

    name = v.get("name")
    if not isinstance(name, str) or not callable(getattr(optim.schedulers, name, None)):
        raise TrainConfigError(f"lr_schedule.name must name a schedule of mlx.optimizers "
                               f"(cosine_decay, linear_schedule, ...), not {name!r}")
    if not isinstance(v.get("arguments"), list) or not v["arguments"]:
        raise TrainConfigError(f"lr_schedule.arguments must be a list (the first is the initial "
                               f"learning rate), not {v.get('arguments')!r}")
    v["arguments"] = [_number(a, float, f"lr_schedule.arguments[{i}]")
                      if isinstance(a, str) else a for i, a in enumerate(v["arguments"])]
    if "warmup" in v:
        v["warmup"] = _number(v["warmup"], int, "lr_schedule.warmup")
        if v["warmup"] < 0:
            raise TrainConfigError(f"lr_schedule.warmup {v['warmup']}: must be >= 0")
    if "warmup_init" in v:
        v["warmup_init"] = _number(v["warmup_init"], float, "lr_schedule.warmup_init")
    return v


def _lora_parameters(p: dict) -> dict:
    if "alpha" in p and "scale" not in p:
        raise TrainConfigError("lora_parameters has 'alpha': mlx-lm's LoRA uses 'scale' "
                               "(= PEFT alpha / rank)")
    _refuse_unknown(p, LORA_KEYS, "lora_parameters")
    out = {"rank": 8, "scale": 20.0, "dropout": 0.0} | p
    out["rank"] = _number(out["rank"], int, "lora_parameters.rank (--lora-rank)")
    if out["rank"] < 1:
        raise TrainConfigError(f"lora_parameters.rank (--lora-rank) {out['rank']}: must be >= 1")
    out["scale"] = _number(out["scale"], float, "lora_parameters.scale (--lora-scale)")
    out["dropout"] = _number(out["dropout"], float, "lora_parameters.dropout (--lora-dropout)")
    if not 0 <= out["dropout"] < 1:
        raise TrainConfigError(f"lora_parameters.dropout (--lora-dropout) {out['dropout']}: must "
                               "be in [0, 1)")
    keys = out.get("keys")
    if keys is None:
        out.pop("keys", None)
    elif not (isinstance(keys, list) and keys and all(isinstance(k, str) for k in keys)):
        raise TrainConfigError(f"lora_parameters.keys (--lora-keys) must be a list of module "
                               f"paths, not {keys!r}")
    return out


def _optimizer_config(c: dict) -> dict:
    _refuse_unknown(c, OPTIMIZERS, "optimizer_config")
    out = {}
    for name, kwargs in c.items():
        if kwargs is None:
            kwargs = {}
        if not isinstance(kwargs, dict):
            raise TrainConfigError(f"optimizer_config.{name} must be a mapping of keyword "
                                   f"arguments, not {kwargs!r}")
        out[name] = dict(kwargs)
    return out


def _engine(values: dict) -> dict:
    """Engine option values as given (strings from a command line, YAML scalars); checked
    now. "auto" is the planner's choice (tile, offload, boundaries_on_device with --plan auto)
    or the device default (compile, share_traces)."""
    values = {ENGINE_ALIASES.get(k, k): v for k, v in values.items() if v is not None}
    _refuse_unknown(values, ENGINE_KEYS, "engine options")
    searched, runtime = split_engine(values)
    auto = [k for k, v in searched.items() if v == "auto"]
    if set(auto) - set(PLANNER_CHOOSES):
        raise TrainConfigError(f"{auto[0]} has no 'auto'; the planner chooses "
                               f"{', '.join(PLANNER_CHOOSES)}")
    try:  # what the planner will choose cannot be checked yet
        EngineOptions.from_dict(runtime if auto else searched | runtime, "engine options")
    except OptionsError as e:
        raise TrainConfigError(str(e)) from None
    return values


def split_engine(values: dict) -> tuple[dict, dict]:
    """(what --plan auto searches, run-time options); 'auto' compile/share_traces -> None."""
    searched = {k: v for k, v in values.items() if k in SEARCHED}
    runtime = {}
    for k, v in values.items():
        if k in SEARCHED:
            continue
        if isinstance(v, str) and v.strip().lower() == "auto":
            if EngineOptions.__dataclass_fields__[k].default is not None:
                raise TrainConfigError(f"{k} has no 'auto' (it takes a value; see --help)")
            v = None
        runtime[k] = v
    for k, v in searched.items():
        if isinstance(v, str) and v.strip().lower() == "auto":
            searched[k] = "auto"
    return searched, {k: v for k, v in runtime.items() if v is not None}


# ---- config files and names ------------------------------------------------------------------


def _refuse_unknown(values: dict, known: Any, where: str) -> None:
    for key in values:
        if key not in known:
            close = difflib.get_close_matches(str(key), list(known), n=1, cutoff=0.6)
            hint = f"; did you mean '{close[0]}'?" if close else \
                f"; known: {', '.join(sorted(known))}"
            raise TrainConfigError(f"{where}: unknown option '{key}'{hint}")


def normalize(values: dict[str, Any], where: str = "options") -> dict[str, Any]:
    """Option names from keys as a config file or a caller gives them: '-' or '_', aliases,
    engine options flat or under `engine:`; unknown keys refused with a did-you-mean."""
    out: dict[str, Any] = {}
    engine = dict(values.get("engine") or {})
    known = [*FIELDS, *ALIASES, *ENGINE_KEYS, *ENGINE_ALIASES, *IGNORED_KEYS]
    for key, v in values.items():
        k = str(key).replace("-", "_")
        if k in IGNORED_KEYS or k == "engine":
            continue
        if k in ENGINE_KEYS or k in ENGINE_ALIASES:
            engine[k] = v
            continue
        _refuse_unknown({k: v}, known, where)
        out[ALIASES.get(k, k)] = v
    if engine:
        out["engine"] = engine
    return out


class _Loader(yaml.SafeLoader):
    """YAML with mlx-lm's float resolver (mlx_lm.lora): 1e-5 is a float, not a string."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+][0-9]+)?
    |[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\.[0-9_]*
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."))


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A YAML config (mlx-lm's lora_config.yaml) or an adapter_config.json, as option names."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise TrainConfigError(f"config file not found: {path}") from None
    try:
        values = json.loads(text) if path.suffix == ".json" else yaml.load(text, _Loader)
    except json.JSONDecodeError as e:
        raise TrainConfigError(f"{path}, line {e.lineno}, column {e.colno}: not valid JSON "
                               f"({e.msg})") from None
    except yaml.YAMLError as e:  # the file, line and column, and the line itself
        from segback.experiment.config_check import yaml_problem

        raise TrainConfigError(yaml_problem(path, e, text)) from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise TrainConfigError(f"{path}: a config file is a mapping of option names to values")
    if path.suffix != ".json":
        from segback.experiment.config_check import duplicate_keys

        twice = duplicate_keys(path)
        if twice:
            raise TrainConfigError(twice[0])
    return normalize(values, str(path))


# ---- command line ----------------------------------------------------------------------------

GROUPS = {"mlx-lm": "mlx-lm's options (mlx_lm.lora)", "segback": "segback's options"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per declared option (and its aliases), plus the engine's own flags. Defaults
    are left out of the namespace, so `from_args` can tell what was given."""
    S = argparse.SUPPRESS
    parser.add_argument("-c", "--config", default=None,
                        help="YAML config file (mlx-lm's lora_config.yaml) or an "
                        "adapter_config.json; the command line wins")
    groups = {name: parser.add_argument_group(title) for name, title in GROUPS.items()}
    for f in fields(TrainConfig):
        m = f.metadata
        if not m["cli"]:
            continue
        flags = ["--" + n.replace("_", "-") for n in (f.name, *m["aliases"])]
        shown = f.default if f.default is not MISSING else "{...}"
        kw: dict[str, Any] = dict(dest=f.name, default=S, help=f"{m['help']} (default: {shown})")
        if m["type"] is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif m["type"] is STRINGS:
            kw["nargs"] = "+"
        else:
            kw["metavar"] = m["metavar"] or f.name.upper()
        if m["choices"]:
            kw["metavar"] = "{" + ",".join(m["choices"]) + "}"
        groups[m["group"]].add_argument(*flags, **kw)
    engine_options.add_arguments(parser.add_argument_group(
        "engine (how the segmented backward runs; a plan file's values unless given; with "
        "--plan auto, --tile, --offload and --boundaries-on-device also take 'auto')"))


def from_args(args: argparse.Namespace) -> TrainConfig:
    """Declared defaults < --config file < the flags given."""
    given = vars(args)
    values = read_config_file(given["config"]) if given.get("config") else {}
    values.update({k: v for k, v in given.items() if k in FIELDS})
    engine = {k: given[k] for k in ENGINE_KEYS if given.get(k) is not None}
    if engine:
        values["engine"] = {**values.get("engine", {}), **engine}
    cfg = TrainConfig(**values)
    missing = ["model"] * (not cfg.model) + ["data"] * (not (cfg.data or cfg.hf_dataset))
    if missing:
        raise TrainConfigError("missing option(s): " + ", ".join("--" + m for m in missing))
    for flag, where in (("--adapter-path", cfg.adapter_path),
                        ("--checkpoint-dir", cfg.checkpoint_dir)):
        if where is not None and Path(where).exists() and not Path(where).is_dir():
            raise TrainConfigError(f"{flag} {where} is a file, not a directory: give a directory "
                                   "(the adapter's files and checkpoints go inside it)")
    return cfg
