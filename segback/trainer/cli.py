"""`segback train`: from options to a model, a plan, an optimizer and data, then the loop.

As `mlx_lm.lora`: `--train` fine-tunes (LoRA, DoRA or full), `--test` evaluates test loss and
perplexity afterwards, or alone (on the adapter in --adapter-path, if there is one).

Under `mlx.launch -n N ...` every rank runs this; `mx.distributed.init()` is called once here,
rank 0 alone locks, writes and prints, the others print only their errors
(`segback.trainer.distributed`, docs/distributed.md).
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten
from mlx_lm.tuner.utils import build_schedule, linear_to_lora_layers

from segback.data.dataset import PAD_TO, DataError
from segback.data.tokens import ByteTokenizer
from segback.engine import EngineOptions, OptionsError, Plan, PlanError, segments_of
from segback.engine.options import AUTO
from segback.engine.ring_attention import shard_positions
from segback.engine.stack import get_stack
from segback.io import atomic_write_json
from segback.lock import LockedError, exclusive
from segback.models.adapters import adapter_modules, base_fingerprint, mount
from segback.models.load import load
from segback.planner import plan_segments
from segback.planner.geometry import text_parts
from segback.trainer import distributed, engine_request, loop
from segback.trainer.arguments import add_arguments, from_args
from segback.trainer.checkpoints import RUN_ONLY, SUMMARY, Interrupted, ResumeError, \
    TrainingDiverged
from segback.trainer.config import TrainConfig
from segback.trainer.stop import interruptible
from segback.trainer.values import TrainConfigError

__all__ = ["add_arguments", "main", "run"]

OPTIMIZER_CLASSES = {"adam": optim.Adam, "adamw": optim.AdamW, "muon": optim.Muon,
                     "sgd": optim.SGD, "adafactor": optim.Adafactor}  # as mlx_lm.lora


def main(args: argparse.Namespace) -> int:
    world = None
    try:
        cfg = from_args(args)
        with interruptible(cfg.parent_pid):
            world = distributed.init()  # the ranks mlx.launch started (one without it)
            if cfg.context_parallel > 1:  # data x context ranks
                world = distributed.context_world(world, cfg.context_parallel,
                                                  cfg.context_order, agreed(cfg))
            lock = exclusive(cfg.checkpoint_dir or cfg.adapter_path) if world.main else \
                nullcontext()  # one writer per run: rank 0
            with distributed.quiet(world), lock:
                result = run(cfg, world)
    except Interrupted as e:
        if world is None or world.main:
            print(f"segback train: {e}", file=sys.stderr)
        return 130
    except KeyboardInterrupt as e:  # before the first step: nothing to resume yet
        print(f"segback train: interrupted ({e or 'SIGINT'}) before training started",
              file=sys.stderr)
        return 130
    except TrainingDiverged as e:
        if world is None or world.main:  # every rank stops at the same step; rank 0 says it
            print(f"segback train: {e}", file=sys.stderr)
        return 3
    except (TrainConfigError, DataError, ResumeError, OptionsError, PlanError, ValueError,
            OSError, ImportError, LockedError) as e:
        print(f"segback train: error: {distributed.who(world)}{e}", file=sys.stderr)
        return 2
    keys = ("steps", "first_loss", "final_loss", "val_loss", "peak_gb", "seconds",
            "tokens_per_second", "test_loss", "test_ppl", "world_size")
    if world.main:
        print(json.dumps({k: result[k] for k in keys if k in result}))
    return 0


def run(cfg: TrainConfig, world: distributed.World | None = None) -> dict:
    """Train and/or test as `cfg` says; returns the summary (and the test results).

    `world`: the data-parallel ranks (`distributed.init()` when not given); rank 0 writes."""
    world = world or distributed.init()
    callback = reporting_callback(cfg) if world.main else None
    model, tokenizer = load_model(cfg.model)
    train_set, valid_set, test_set = loop.load_data(cfg, tokenizer)
    model.set_dtype(resolve_dtype(cfg.dtype))
    result: dict[str, Any] = {}
    if cfg.do_train:
        if cfg.grad_checkpoint:
            print("segback: --grad-checkpoint is not needed: the segmented backward keeps one "
                  "segment's activations alive, which replaces gradient checkpointing",
                  file=sys.stderr)
        attach(model, cfg)
        plan = resolve_plan(cfg, model, distributed.rank_batch(cfg.batch_size, world))
        describe(plan, model, cfg)
        grad_fn = distributed.context_grad_fn(plan, world) if cfg.context_parallel > 1 \
            else loop.segmented_grad_fn(plan)
        result = loop.train(model, build_optimizer(cfg), train_set, valid_set, cfg, grad_fn,
                            training_callback=callback, world=world)
    elif (Path(cfg.adapter_path) / "adapter_config.json").exists():
        mount(model, cfg.adapter_path)
    else:
        print(f"segback: no adapter in {cfg.adapter_path}: testing the base model",
              file=sys.stderr)
    if cfg.test:
        tested = loop.test(model, test_set, cfg, world)
        if world.main:
            print(f"Test loss {tested['test_loss']:.3f}, Test ppl {tested['test_ppl']:.3f}.",
                  file=sys.stderr)
            atomic_write_json(Path(cfg.adapter_path) / "test_results.json", tested)
            if cfg.do_train:
                atomic_write_json(Path(cfg.adapter_path) / SUMMARY, result | tested)
        result |= tested
    return result


# ---- from options to objects -----------------------------------------------------------------


def agreed(cfg: TrainConfig) -> dict:
    """The options every rank must share (not where rank 0 writes)."""
    return {k: v for k, v in vars(cfg).items() if k not in RUN_ONLY}


def reporting_callback(cfg: TrainConfig) -> Any:
    """mlx-lm's wandb/swanlab callback for --report-to (None without it)."""
    if not cfg.report_to:
        return None
    from mlx_lm.tuner.callbacks import get_reporting_callbacks  # imports wandb, swanlab

    try:
        return get_reporting_callbacks(cfg.report_to, project_name=cfg.project_name,
                                       log_dir=cfg.adapter_path, config=cfg.to_dict())
    except ImportError as e:
        raise TrainConfigError(f"--report-to {cfg.report_to}: {e}") from None


def resolve_dtype(name: str) -> mx.Dtype:
    """`auto`: float32 on CPU (bf16 matmul is ~35x slower there), bfloat16 on GPU."""
    if name == "auto":
        return mx.bfloat16 if mx.default_device().type == mx.DeviceType.gpu else mx.float32
    return getattr(mx, name)


def load_model(spec: str) -> tuple[nn.Module, Any]:
    """A checkpoint dir or a random geometry (`segback.models.load`), with a tokenizer.

    Geometry models ship no tokenizer: they get `ByteTokenizer` (for smoke runs and benchmarks).
    """
    model, tokenizer = load(spec)
    if tokenizer is None:
        vocab = getattr(getattr(model, "args", None), "vocab_size", None) or 0
        if vocab < 256:
            raise ValueError(f"{spec}: no tokenizer, and vocab {vocab} < 256 rules out bytes")
        tokenizer = ByteTokenizer()
    return model, tokenizer


def attach(model: nn.Module, cfg: TrainConfig) -> None:
    """Freeze the base and make the trainable part exactly as `mlx_lm.lora` does: LoRA/DoRA
    layers on the last --num-layers layers, or those layers unfrozen (full); then load
    --resume-adapter-file."""
    if adapter_modules(model):
        raise ValueError("the model already has LoRA layers; pass a base model")
    if cfg.num_layers > len(model.layers):
        raise ValueError(f"--num-layers {cfg.num_layers} but the model has "
                         f"{len(model.layers)} layers")
    model.freeze()
    mx.random.seed(cfg.seed)
    if cfg.fine_tune_type == "full":
        for layer in model.layers[-max(cfg.num_layers, 0):]:
            layer.unfreeze()
    else:
        linear_to_lora_layers(model, cfg.num_layers, cfg.lora_parameters,
                              use_dora=cfg.fine_tune_type == "dora")
        if not adapter_modules(model):
            raise ValueError(f"no layer matched lora_parameters.keys "
                             f"{cfg.lora_parameters.get('keys')}")
    if cfg.resume_adapter_file:
        load_adapter_file(model, cfg.resume_adapter_file)


def load_adapter_file(model: nn.Module, path: str) -> None:
    """Trainable weights from a .safetensors file (mlx-lm's --resume-adapter-file); refuses
    tensors the model does not train or of another shape."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"--resume-adapter-file {path}: no such file")
    try:
        weights = mx.load(path)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"--resume-adapter-file {path} cannot be read ("
                         f"{str(e).removeprefix('[load_safetensors] ')}): it is truncated or "
                         "corrupt; copy it again, or train without it") from None
    trainable = dict(tree_flatten(model.trainable_parameters()))
    bad = [f"{k} {tuple(v.shape)}" for k, v in weights.items()
           if k not in trainable or trainable[k].shape != v.shape]
    if bad:
        raise ValueError(f"--resume-adapter-file {path} does not fit this adapter "
                         f"(--fine-tune-type, --num-layers, rank, keys?): {', '.join(bad[:3])}")
    warn_other_base(model, Path(path).with_name("adapter_config.json"), path)
    print(f"segback: loading fine-tuned weights from {path}", file=sys.stderr)
    model.load_weights(list(weights.items()), strict=False)
    mx.eval(model.parameters())


def warn_other_base(model: nn.Module, config_file: Path, path: str) -> None:
    """Warn when the adapter_config.json beside --resume-adapter-file says it was trained on
    another base model (shapes alone cannot tell: a same-geometry model fits them)."""
    try:
        saved = json.loads(config_file.read_text()).get("base_model_sha256")
    except (OSError, ValueError, AttributeError):
        return  # no config beside it (mlx-lm's own adapters): nothing to compare
    if saved and saved != base_fingerprint(model):
        print(f"segback: warning: --resume-adapter-file {path} was trained on another base "
              f"model than this one (its {config_file.name} records another "
              "base_model_sha256): its weights will not mean what they did", file=sys.stderr)


def build_optimizer(cfg: TrainConfig) -> optim.Optimizer:
    """mlx_lm.lora's optimizer: the class of --optimizer with optimizer_config[name], on
    mlx-lm's schedule (`build_schedule`) or a constant --learning-rate."""
    schedule = cfg.lr_schedule_config()
    lr = build_schedule(schedule) if schedule else cfg.learning_rate
    cls = OPTIMIZER_CLASSES[cfg.optimizer]
    kwargs = cfg.optimizer_config.get(cfg.optimizer, {})
    accepted = inspect.signature(cls.__init__).parameters
    unknown = [k for k in kwargs if k not in accepted]
    if unknown:
        takes = [k for k in accepted if k not in ("self", "learning_rate")]
        raise TrainConfigError(f"optimizer_config.{cfg.optimizer}: {cls.__name__} has no "
                               f"{', '.join(unknown)} (it takes {', '.join(takes)})")
    return cls(learning_rate=lr, **kwargs)


def resolve_plan(cfg: TrainConfig, model: nn.Module, batch_size: int | None = None) -> Plan:
    """The plan the engine runs, checked here against the model and the longest batch (the
    steps do not check it again): `--plan auto` asks the planner (with what the engine flags
    say, 'auto' included), a file is read (flags given on top of its engine options), N makes
    segments of N layers. `batch_size`: the rows each rank runs (default --batch-size: one
    process)."""
    batch_size = batch_size or cfg.batch_size
    if cfg.plan != "auto":
        auto = engine_request.asks_planner(cfg.engine)
        if auto:
            raise TrainConfigError(f"{', '.join(auto)} 'auto' needs --plan auto (the planner "
                                   "chooses them)")
        if cfg.target_gb is not None:
            raise TrainConfigError(f"--target-gb {cfg.target_gb} needs --plan auto (a given plan "
                                   "has its own target: make it with `segback plan --target-gb`)")
        if cfg.measure_plan not in (0, AUTO):
            raise TrainConfigError(f"--measure-plan {cfg.measure_plan} needs --plan auto (it times "
                                   "the planner's candidates)")
    n = len(model.layers)
    if cfg.plan == "auto":
        space = engine_request.space(cfg.engine)
        plan = plan_segments(
            model, cfg.max_seq_length, batch_size=batch_size, target_gb=cfg.target_gb,
            lora_rank=cfg.lora_parameters["rank"],
            lora_layers=None if cfg.num_layers < 0 else cfg.num_layers, space=space,
            options=engine_request.runtime(cfg.engine, space.attention),
            measure=cfg.measure_plan, context_parallel=cfg.context_parallel,
            context_order=cfg.context_order)
    elif isinstance(cfg.plan, str):
        plan = Plan.read(cfg.plan)
        plan = plan.with_engine(engine_request.on_top(plan.engine, cfg.engine,
                                                      f"{cfg.plan}: engine"))
    else:
        plan = Plan(segments=segments_of(cfg.plan, n),
                    engine=engine_request.on_top(EngineOptions(), cfg.engine, "engine options"))
    if cfg.context_parallel > 1:
        check_context(cfg)
    plan.check(n, get_stack(model).layer_types,
               model_type=getattr(text_parts(model)[1], "model_type", None),
               seq_len=shard_length(cfg), batch_size=batch_size)
    if cfg.pack and plan.engine.tile:
        raise TrainConfigError(f"--pack needs an untiled plan (this one has tiles of "
                               f"{plan.engine.tile} tokens): the tiled engine builds no "
                               "block-diagonal masks; leave out --tile, or train unpacked")
    return plan


def shard_length(cfg: TrainConfig) -> int:
    """The longest sequence one rank's engine runs: --max-seq-length, or with
    --context-parallel its longest shard."""
    if cfg.context_parallel == 1:
        return cfg.max_seq_length
    return shard_positions(cfg.max_seq_length, cfg.context_parallel, cfg.context_order).padded


def check_context(cfg: TrainConfig) -> None:
    """--context-parallel's limits, the same on every rank (so every rank stops)."""
    R = cfg.context_parallel
    if cfg.pack:
        raise TrainConfigError(f"--context-parallel {R} trains unpacked rows: leave out --pack "
                               "(a shard of packed rows would need block-diagonal ring masks)")
    pieces = 2 * R if cfg.context_order == "zigzag" else R
    shortest = min(PAD_TO, cfg.max_seq_length - 1)  # the fewest tokens a batch may have
    if pieces > shortest:
        raise TrainConfigError(f"--context-parallel {R} ({cfg.context_order}) splits a sequence "
                               f"into {pieces} pieces, more than the {shortest} tokens of the "
                               "shortest batch: use fewer context ranks" + (
                                   " or --context-order contiguous" if pieces > R else ""))


def describe(plan: Plan, model: nn.Module, cfg: TrainConfig) -> None:
    e = plan.engine.resolved()
    n = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))
    print(f"segback: {n / 1e6:.3f}M trainable parameters ({cfg.fine_tune_type}), "
          f"{len(plan.segments)} segments {[tuple(s) for s in plan.segments]}, "
          f"{e.attention} attention"
          + (f", tiles of {e.tile} tokens, {'compiled' if e.compile else 'eager'} tile "
             "functions" if e.tile else "")
          + (f" ({e.light_tile} in the light passes)" if e.light_tile else "")
          + (", boundaries in host memory" if e.offload else "")
          + (f" but the last {e.boundaries_on_device}" if e.boundaries_on_device else "")
          + f", optimizer {cfg.optimizer}", file=sys.stderr)
