"""`segback train`: LoRA/DoRA fine-tuning with segmented backward, resumable bit for bit.

The loop is mlx-lm's (`mlx_lm.tuner.trainer.train`) with three changes:
- gradients come from `segback.engine.value_and_grad` (exact, one segment's activations alive);
- step k's data (and dropout stream) is a pure function of (seed, k), so a resumed run restores
  only adapter weights, optimizer state and the step, and ends with the same adapter as an
  uninterrupted run (float32, CPU);
- a non-finite loss or gradient norm stops the run at once, keeping the last good checkpoint.

Outputs in --adapter-path: adapters.safetensors + adapter_config.json (mlx-lm's layout),
checkpoints/step_{k:06d}/ (adapter, optimizer, state.json), train_summary.json, and the JSONL log.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any
from collections.abc import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_map, tree_map_with_path

from segback.adapters import adapter_config, adapter_modules, adapter_weights, save_adapter
from segback.adapters import save_safetensors_atomic
from segback.data import (
    ByteTokenizer,
    DataError,
    TokenDataset,
    batch_at,
    encode_rows,
    load_dataset,
    validation_batches,
)
from segback.io import atomic_write_json, atomic_write_text, read_json

CHECKPOINTS = "checkpoints"
# Settings that fix the data order, the adapter's shape or its meaning: a resume must match them.
RESUME_KEYS = ("fine_tune_type", "num_layers", "lora_rank", "lora_scale", "lora_dropout",
               "lora_keys", "seed", "batch_size", "grad_accum", "seq")


@dataclass
class TrainConfig:
    """Every `segback train` option (YAML config keys use the same names, - or _)."""

    model: str = ""
    data: str = ""
    adapter_path: str = "adapters"
    plan: Any = "auto"  # "auto" | FILE.json | layers per segment | [(start, stop), ...]
    attention: str = "fused"  # for plans that do not say: "fused" | "chunked"
    tile: Any = None  # tokens per tile (sequence-tiled engine), "auto" (planner) or None
    offload: Any = False  # host-parked boundaries (with tile); "auto" lets the planner choose
    compile: str = "auto"  # tiled engine's tile functions: "on" | "off" | "auto" (CPU only)
    target_gb: float | None = None  # --plan auto: the planner's memory target (None: min peak)
    seq: int = 2048
    iters: int = 100
    batch_size: int = 1
    grad_accum: int = 1
    learning_rate: float = 1e-4
    warmup: int = 0
    lr_schedule: str = "cosine"
    min_lr: float = 0.0
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    lora_rank: int = 8
    lora_scale: float = 20.0
    lora_dropout: float = 0.0
    lora_keys: list[str] | None = None
    num_layers: int = -1
    fine_tune_type: str = "lora"
    seed: int = 0
    val_every: int = 100
    val_batches: int = 25
    save_every: int = 100
    keep_checkpoints: int = 3
    dtype: str = "auto"
    log: str | None = None
    resume: bool = True
    progress: bool = True

    def __post_init__(self):
        """Command-line and YAML strings for the engine options: "512", "auto", "true"."""
        from segback.engine.segmented import tiling_options

        self.tile, self.offload = tiling_options(self.tile, self.offload)
        if self.attention not in ("fused", "chunked"):
            raise ValueError(f"attention must be 'fused' or 'chunked', not {self.attention!r}")
        self.compile = {True: "on", False: "off"}.get(self.compile, self.compile)  # YAML bools
        if self.compile not in ("auto", "on", "off"):
            raise ValueError(f"compile must be 'auto', 'on' or 'off', not {self.compile!r}")
        gb = self.target_gb
        if gb is not None and (isinstance(gb, bool) or not isinstance(gb, (int, float)) or gb <= 0):
            raise ValueError(f"target_gb must be a number of GB > 0, not {self.target_gb!r}")

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        names = {f.name for f in fields(cls)}
        d = {k.replace("-", "_"): v for k, v in d.items()}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown training option(s) {unknown}; known: {sorted(names)}")
        for f in fields(cls):  # YAML reads 1e-4 as a string
            if f.name in d and isinstance(f.default, (int, float)) and isinstance(d[f.name], str):
                d[f.name] = type(f.default)(d[f.name])
        return cls(**d)


class TrainingDiverged(RuntimeError):
    """Loss or gradient norm became NaN/inf; the last good checkpoint is kept."""


# ---- model, plan, schedule --------------------------------------------------------------------


def resolve_dtype(name: str) -> mx.Dtype:
    """`auto`: float32 on CPU (bf16 matmul is ~35x slower there), bfloat16 on GPU."""
    if name == "auto":
        return mx.bfloat16 if mx.default_device().type == mx.DeviceType.gpu else mx.float32
    return {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}[name]


def load_model(spec: str) -> tuple[nn.Module, Any]:
    """A checkpoint dir or a random geometry (`segback.models.load`), with a tokenizer.

    Geometry models ship no tokenizer: they get `ByteTokenizer` (for smoke runs and benchmarks).
    """
    from segback.models.load import load

    model, tokenizer = load(spec)
    if tokenizer is None:
        vocab = getattr(getattr(model, "args", None), "vocab_size", None) or 0
        if vocab < 256:
            raise ValueError(f"{spec}: no tokenizer, and vocab {vocab} < 256 rules out bytes")
        tokenizer = ByteTokenizer()
    return model, tokenizer


def attach_lora(model: nn.Module, cfg: TrainConfig) -> None:
    """Freeze the base and convert linears to LoRA/DoRA, exactly as `mlx_lm.lora` does."""
    from mlx_lm.tuner.utils import linear_to_lora_layers

    if cfg.fine_tune_type not in ("lora", "dora"):
        raise ValueError(f"fine_tune_type must be lora or dora, not {cfg.fine_tune_type!r}")
    if adapter_modules(model):
        raise ValueError("the model already has LoRA layers; pass a base model")
    if cfg.num_layers > len(model.layers):
        raise ValueError(f"--num-layers {cfg.num_layers} but the model has "
                         f"{len(model.layers)} layers")
    model.freeze()
    mx.random.seed(cfg.seed)
    linear_to_lora_layers(model, cfg.num_layers, _lora_parameters(cfg),
                          use_dora=cfg.fine_tune_type == "dora")
    if not adapter_modules(model):
        raise ValueError(f"no layer matched --lora-keys {cfg.lora_keys}")


def _lora_parameters(cfg: TrainConfig) -> dict:
    p = {"rank": cfg.lora_rank, "scale": cfg.lora_scale, "dropout": cfg.lora_dropout}
    if cfg.lora_keys:
        p["keys"] = list(cfg.lora_keys)
    return p


def resolve_plan(plan: Any, model: nn.Module, seq: int, batch_size: int, lora_rank: int = 8,
                 num_layers: int = -1, attention: str = "fused", tile: Any = None,
                 offload: Any = False, target_gb: float | None = None,
                 ) -> tuple[list[tuple[int, int]], dict[str, Any]]:
    """Segments and the engine options (attention, tile, offload, light_tile, offload_keep) a
    plan was made for; the arguments fill in what a plan does not say (`--plan auto` passes them
    to the planner)."""
    from segback.engine import resolve_segments
    from segback.engine.segmented import engine_options

    if plan not in (None, "auto"):
        if tile == "auto" or offload == "auto":
            raise ValueError("tile/offload 'auto' needs --plan auto (the planner chooses them)")
        if target_gb is not None:
            raise ValueError(f"--target-gb {target_gb} needs --plan auto (a given plan has its "
                             "own target: make it with `segback plan --target-gb`)")
    if plan is None or plan == "auto":
        from segback.planner import plan_segments

        plan = plan_segments(model, seq, batch_size=batch_size, lora_rank=lora_rank,
                             lora_layers=None if num_layers < 0 else num_layers,
                             attention=attention, tile=tile, offload=offload,
                             target_gb=target_gb)
        tile, offload = None, False  # the plan says what the planner chose (null: untiled)
    elif isinstance(plan, str) and re.fullmatch(r"\d+", plan):
        plan = int(plan)
    elif isinstance(plan, (str, Path)):
        if not Path(plan).is_file():
            raise ValueError(f"--plan {plan}: not 'auto', an integer or a plan JSON file")
        plan = read_json(plan)
    return resolve_segments(plan, len(model.layers)), engine_options(plan, attention, tile,
                                                                     bool(offload))


def build_schedule(cfg: TrainConfig) -> Callable:
    """Linear warmup to the peak (first step already > 0), then cosine decay to --min-lr."""
    lr, w = cfg.learning_rate, cfg.warmup
    if cfg.lr_schedule == "cosine":
        main = optim.cosine_decay(lr, max(cfg.iters - w, 1), cfg.min_lr)
    elif cfg.lr_schedule == "constant":
        main = optim.linear_schedule(lr, lr, 1)
    else:
        raise ValueError(f"--lr-schedule must be cosine or constant, not {cfg.lr_schedule!r}")
    if w <= 0:
        return main
    return optim.join_schedules([optim.linear_schedule(lr / (w + 1), lr, w), main], [w])


def _grad_norm(grads: Any) -> mx.array:
    return mx.sqrt(sum(mx.sum(mx.square(g.astype(mx.float32))) for _, g in tree_flatten(grads)))


def _micro_seed(seed: int, index: int) -> int:
    """The dropout stream of micro-batch `index`: a pure function, like its data."""
    return (int(seed) * 1_000_003 + int(index)) % (1 << 63)


# ---- validation (forward only, chunked head) -------------------------------------------------


def eval_loss(model: nn.Module, batch: mx.array, lengths: mx.array) -> tuple[float, int]:
    """(sum of CE over counted tokens, count): no [B, T, vocab] logits at once, no backward."""
    import numpy as np

    from segback.engine.head import chunk_rows, loss_mask
    from segback.models.stack import get_stack

    try:
        stack = get_stack(model)
    except ValueError:
        from mlx_lm.tuner.trainer import default_loss

        loss, ntoks = default_loss(model, batch, lengths)
        mx.eval(loss, ntoks)
        return loss.item() * ntoks.item(), int(ntoks.item())
    B, T = batch.shape
    h, pli = stack.embed(batch[:, :-1])
    h, _ = stack.run(0, stack.num_layers, h, stack.masks(h), pli)
    mx.eval(h)
    rows = np.flatnonzero(loss_mask(np.array(lengths), T).reshape(-1)).astype(np.int32)
    h = h.reshape(B * (T - 1), -1)
    targets = batch[:, 1:].reshape(-1)
    total = mx.array(0.0, mx.float32)
    vocab = int(getattr(getattr(model, "args", None), "vocab_size", 0) or 1)
    for s, e in chunk_rows(int(rows.size), vocab):
        idx = mx.array(rows[s:e])
        ce = nn.losses.cross_entropy(stack.head(h[idx]), targets[idx])
        total = total + ce.astype(mx.float32).sum()
        mx.eval(total)
    return total.item(), int(rows.size)


def evaluate(model: nn.Module, dataset: TokenDataset, cfg: TrainConfig) -> float:
    """Mean validation loss per token over a fixed set of batches (dropout off)."""
    model.eval()
    total, count = 0.0, 0
    try:
        for batch, lengths in validation_batches(dataset, cfg.batch_size, cfg.val_batches,
                                                 cfg.seed, cfg.seq):
            s, n = eval_loss(model, batch, lengths)
            total, count = total + s, count + n
    finally:
        model.train()
    return total / max(count, 1)


# ---- checkpoints and log ---------------------------------------------------------------------


def list_checkpoints(out: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (state.json is written last), oldest first."""
    found = []
    for p in (out / CHECKPOINTS).glob("step_*"):
        m = re.fullmatch(r"step_(\d+)", p.name)
        if m and (p / "state.json").exists():
            found.append((int(m.group(1)), p))
    return sorted(found)


def save_checkpoint(out: Path, step: int, model: nn.Module, optimizer: optim.Optimizer,
                    cfg: TrainConfig, stats: dict) -> Path:
    """Write checkpoints/step_{k:06d}/ via a temp dir and a rename; prune old ones."""
    root = out / CHECKPOINTS
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp-step_{step:06d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    save_adapter(model, tmp, make_adapter_config(cfg))
    save_safetensors_atomic(tmp / "optimizer.safetensors", dict(tree_flatten(optimizer.state)))
    atomic_write_json(tmp / "state.json", {"step": step, "cfg": asdict(cfg), "stats": stats})
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    if cfg.keep_checkpoints > 0:
        for _, old in list_checkpoints(out)[:-cfg.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: Path, model: nn.Module, optimizer: optim.Optimizer) -> dict:
    """Restore adapter weights and optimizer state in place; return state.json."""
    weights = mx.load(str(path / "adapters.safetensors"))
    model.load_weights(list(weights.items()), strict=False)
    saved = mx.load(str(path / "optimizer.safetensors"))
    optimizer.init(model.trainable_parameters())
    missing = [k for k, _ in tree_flatten(optimizer.state) if k not in saved]
    if missing:
        raise ValueError(f"{path}: optimizer state lacks {missing[:3]}... (different adapter?)")
    optimizer.state = tree_map_with_path(lambda k, v: saved[k], optimizer.state)
    mx.eval(model.parameters(), optimizer.state)
    return read_json(path / "state.json")


def make_adapter_config(cfg: TrainConfig) -> dict:
    """mlx-lm's adapter_config.json: our options flat (as mlx_lm.lora writes its args) + LoRA."""
    return adapter_config(cfg.fine_tune_type, cfg.num_layers, cfg.lora_rank, cfg.lora_scale,
                          cfg.lora_dropout, cfg.lora_keys, extra=asdict(cfg))


class JsonlLog:
    """Append-only JSONL: one write + flush per record, so a kill loses at most a partial line."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def truncate_after(self, step: int) -> None:
        """Drop records past `step` (a resumed run replays them) and any torn last line."""
        keep = []
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if row.get("step", 0) <= step:
                    keep.append(line + "\n")
        atomic_write_text(self.path, "".join(keep))

    def write(self, row: dict) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()


# ---- the loop ---------------------------------------------------------------------------------


def _as_dataset(data: Any, tokenizer: Any, cfg: TrainConfig, name: str) -> TokenDataset | None:
    if data is None or isinstance(data, TokenDataset):
        return data
    if len(data) == 0:
        return None
    return encode_rows(tokenizer, list(data), cfg.seq, name=name)


def _check_resume(saved: dict, cfg: TrainConfig, path: Path) -> None:
    diff = {k: (saved.get(k), getattr(cfg, k)) for k in RESUME_KEYS
            if saved.get(k) != getattr(cfg, k)}
    if diff:
        detail = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in diff.items())
        raise ValueError(f"cannot resume from {path}: settings changed ({detail}); "
                         "use --no-resume or another --adapter-path")
    if saved.get("iters") != cfg.iters or saved.get("learning_rate") != cfg.learning_rate:
        print("segback: resuming with a different --iters/--learning-rate: the LR schedule "
              "changes from here on", file=sys.stderr)


def train(
    model: nn.Module,
    tokenizer: Any,
    train_set: TokenDataset | Sequence[dict],
    valid_set: TokenDataset | Sequence[dict] | None,
    cfg: TrainConfig | dict,
    callback: Callable[[int, dict], None] | None = None,
) -> dict:
    """Train an adapter on a base model; returns (and writes) the run summary.

    `callback(step, record)` runs after each step's log record and checkpoint (tests use it to
    simulate a kill).
    """
    from segback.engine import memory_stats, reset_peak, value_and_grad
    from segback.engine.segmented import compile_by_default

    cfg = TrainConfig.from_dict(cfg) if isinstance(cfg, dict) else cfg
    if cfg.iters < 1 or cfg.batch_size < 1 or cfg.grad_accum < 1:
        raise ValueError("iters, batch_size and grad_accum must be >= 1")
    train_set = _as_dataset(train_set, tokenizer, cfg, "train")
    valid_set = _as_dataset(valid_set, tokenizer, cfg, "valid")
    if train_set is None:
        raise DataError("the training set is empty")
    out = Path(cfg.adapter_path)
    out.mkdir(parents=True, exist_ok=True)
    log = JsonlLog(Path(cfg.log) if cfg.log else out / "train_log.jsonl")

    dtype = resolve_dtype(cfg.dtype)
    model.set_dtype(dtype)
    attach_lora(model, cfg)
    model.train()
    segments, engine = resolve_plan(cfg.plan, model, cfg.seq, cfg.batch_size, cfg.lora_rank,
                                    cfg.num_layers, cfg.attention, cfg.tile, cfg.offload,
                                    cfg.target_gb)
    engine["compile"] = {"auto": None, "on": True, "off": False}[cfg.compile]
    compiled = compile_by_default() if engine["compile"] is None else engine["compile"]
    schedule = build_schedule(cfg)
    optimizer = optim.AdamW(learning_rate=schedule, weight_decay=cfg.weight_decay)

    stats = {"tokens": 0, "input_tokens": 0, "seconds": 0.0, "first_loss": None,
             "last_loss": None, "peak_gb": 0.0, "val_loss": None, "first_val_loss": None}
    start, resumed_from = 0, None
    for tmp in (out / CHECKPOINTS).glob(".tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True)
    checkpoints = list_checkpoints(out)
    if checkpoints and cfg.resume:
        start, path = checkpoints[-1]
        if start > cfg.iters:
            raise ValueError(f"{path} is past --iters {cfg.iters}; use --no-resume or more iters")
        _check_resume(read_json(path / "state.json")["cfg"], cfg, path)
        state = load_checkpoint(path, model, optimizer)
        stats.update(state.get("stats", {}))
        resumed_from = str(path)
        log.truncate_after(start)
        print(f"segback: resuming from {path} (step {start})", file=sys.stderr)
    else:
        if checkpoints:
            print(f"segback: --no-resume: removing {len(checkpoints)} old checkpoint(s)",
                  file=sys.stderr)
            shutil.rmtree(out / CHECKPOINTS, ignore_errors=True)
        log.truncate_after(-1)

    if start < cfg.iters:  # final files exist only for a finished run
        for name in ("adapters.safetensors", "adapter_config.json", "train_summary.json"):
            (out / name).unlink(missing_ok=True)

    n_trainable = sum(v.size for v in adapter_weights(model).values())
    print(f"segback: {n_trainable / 1e6:.3f}M trainable parameters, {len(segments)} segments "
          f"{segments}, {engine['attention']} attention"
          + (f", tiles of {engine['tile']} tokens" if engine["tile"] else "")
          + ((", compiled" if compiled else ", eager") + " tile functions" if engine["tile"]
             else "")
          + (f" ({engine['light_tile']} in the light passes)" if engine.get("light_tile") else "")
          + (", boundaries in host memory" if engine["offload"] else "")
          + (f" but the last {engine['offload_keep']}" if engine.get("offload_keep") else "")
          + f", dtype {dtype}, {len(train_set)} train examples",
          file=sys.stderr)

    def validate(step: int) -> None:
        if valid_set is None or cfg.val_every <= 0 or cfg.val_batches == 0:
            return
        tic = time.perf_counter()
        val = evaluate(model, valid_set, cfg)
        stats["val_loss"] = val
        if stats["first_val_loss"] is None:
            stats["first_val_loss"] = val
        log.write({"step": step, "val_loss": val, "val_seconds": time.perf_counter() - tic})

    if start == 0:
        validate(0)

    from tqdm import tqdm

    wall = time.perf_counter()
    bar = tqdm(total=cfg.iters, initial=start, desc="train", unit="step", file=sys.stderr,
               disable=not cfg.progress, dynamic_ncols=True)
    last_saved = start if resumed_from else None
    try:
        for step in range(start + 1, cfg.iters + 1):
            reset_peak()
            tic = time.perf_counter()
            lr = schedule(mx.array(step - 1)).item()  # what this step's update will use
            loss_v, norm_v, grads, toks_v, input_tokens = _gradients(
                model, train_set, step, segments, cfg, value_and_grad, engine)
            if not (math.isfinite(loss_v) and math.isfinite(norm_v)):
                _diverged(log, out, step, f"loss {loss_v}, grad norm {norm_v}", last_saved)
            optimizer.update(model, grads)
            mx.eval(model.trainable_parameters(), optimizer.state)
            del grads
            seconds = time.perf_counter() - tic
            mem = memory_stats()
            stats["tokens"] += toks_v
            stats["input_tokens"] += input_tokens
            stats["seconds"] += seconds
            stats["peak_gb"] = max(stats["peak_gb"], mem["peak_gb"])
            stats["last_loss"] = loss_v
            if stats["first_loss"] is None:
                stats["first_loss"] = loss_v
            record = {"step": step, "loss": loss_v, "lr": lr, "grad_norm": norm_v,
                      "tokens": toks_v, "input_tokens": input_tokens, "seconds": seconds,
                      **mem}
            log.write(record)
            bar.update(1)
            bar.set_postfix(loss=f"{loss_v:.3f}", tok_s=f"{input_tokens / seconds:.0f}",
                            peak_gb=f"{mem['peak_gb']:.2f}")

            if cfg.val_every > 0 and (step % cfg.val_every == 0 or step == cfg.iters):
                validate(step)
            if step == cfg.iters or (cfg.save_every > 0 and step % cfg.save_every == 0):
                bad = [k for k, v in adapter_weights(model).items()
                       if not mx.all(mx.isfinite(v)).item()]
                if bad:
                    _diverged(log, out, step, f"non-finite adapter weights ({bad[0]} ...)",
                              last_saved)
                save_checkpoint(out, step, model, optimizer, cfg, stats)
                last_saved = step
            if callback is not None:
                callback(step, record)
    finally:
        bar.close()

    save_adapter(model, out, make_adapter_config(cfg))
    summary = {
        "steps": cfg.iters,
        "seq": cfg.seq,
        "batch_size": cfg.batch_size,
        "grad_accum": cfg.grad_accum,
        "segments": [list(s) for s in segments],
        "plan": cfg.plan if isinstance(cfg.plan, (str, int)) or cfg.plan is None else "list",
        "fine_tune_type": cfg.fine_tune_type,
        "lora_parameters": _lora_parameters(cfg),
        "trainable_parameters": n_trainable,
        "dtype": str(dtype).removeprefix("mlx.core."),
        "peak_gb": stats["peak_gb"],
        "seconds": stats["seconds"],
        "wall_seconds": time.perf_counter() - wall,
        "tokens": stats["tokens"],
        "input_tokens": stats["input_tokens"],
        "tokens_per_second": stats["tokens"] / max(stats["seconds"], 1e-9),
        "input_tokens_per_second": stats["input_tokens"] / max(stats["seconds"], 1e-9),
        "first_loss": stats["first_loss"],
        "final_loss": stats["last_loss"],
        "first_val_loss": stats["first_val_loss"],
        "val_loss": stats["val_loss"],
        "resumed_from": resumed_from,
        "adapter_path": str(out),
    }
    atomic_write_json(out / "train_summary.json", summary)
    return summary


def _gradients(model: nn.Module, train_set: TokenDataset, step: int, segments: list,
               cfg: TrainConfig, value_and_grad: Callable, engine: dict | None = None
               ) -> tuple[float, float, Any, int, int]:
    """Step `step`'s accumulated, averaged and clipped gradients (one eval per micro-batch).

    Returns (mean loss, grad norm before clipping, grads, loss tokens, input tokens).
    """
    acc, loss_sum, ntoks, input_tokens = None, mx.array(0.0), mx.array(0), 0
    for j in range(cfg.grad_accum):
        index = (step - 1) * cfg.grad_accum + j
        batch, lengths = batch_at(train_set, index, cfg.batch_size, cfg.seed, cfg.seq)
        input_tokens += int(mx.sum(lengths[:, 1] + 1).item())
        mx.random.seed(_micro_seed(cfg.seed, index))
        (loss, toks), grads = value_and_grad(model, batch, lengths, segments, **(engine or {}))
        acc = grads if acc is None else tree_map(mx.add, acc, grads)
        loss_sum, ntoks = loss_sum + loss, ntoks + toks
        if j < cfg.grad_accum - 1:
            mx.eval(loss_sum, ntoks, acc)
    if cfg.grad_accum > 1:
        acc = tree_map(lambda g: g / cfg.grad_accum, acc)
    if cfg.grad_clip > 0:
        acc, norm = optim.clip_grad_norm(acc, cfg.grad_clip)
    else:
        norm = _grad_norm(acc)
    mx.eval(loss_sum, ntoks, acc, norm)
    return loss_sum.item() / cfg.grad_accum, norm.item(), acc, int(ntoks.item()), input_tokens


def _diverged(log: JsonlLog, out: Path, step: int, what: str, last_saved: int | None) -> None:
    keep = (f"the last good checkpoint is {out / CHECKPOINTS / f'step_{last_saved:06d}'}"
            if last_saved else "no checkpoint was saved before it")
    msg = (f"training diverged at step {step}: {what}; stopped ({keep}). "
           "Try a lower --learning-rate, more --warmup or --grad-clip.")
    log.write({"step": step, "error": msg})
    raise TrainingDiverged(msg)


# ---- CLI --------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    S = argparse.SUPPRESS  # unset options fall back to --config, then to TrainConfig defaults
    d = TrainConfig()
    p.add_argument("--config", default=S, help="YAML file whose keys are these option names")
    p.add_argument("--model", default=S, help="model dir (mlx_lm.load) or a geometry name")
    p.add_argument("--data", default=S, help="dir with train.jsonl (+ valid.jsonl)")
    p.add_argument("--adapter-path", default=S, help="output dir for adapters and checkpoints")
    p.add_argument("--plan", default=S,
                   help=f"auto | plan JSON file | layers per segment (default {d.plan})")
    p.add_argument("--attention", choices=["fused", "chunked"], default=S,
                   help="attention for plans that do not name one (a plan JSON's wins)")
    p.add_argument("--tile", default=S, help="tokens per tile for the sequence-tiled engine, "
                   "or 'auto' (with --plan auto) to let the planner choose")
    p.add_argument("--offload", default=S, choices=["true", "false", "auto"],
                   help="park boundaries and per-layer inputs in host memory (with --tile)")
    p.add_argument("--target-gb", type=float, default=S,
                   help="with --plan auto: the planner's memory target in GB (default: the "
                   "plan of least peak memory); with --offload it also keeps as many boundaries "
                   "on the device as the target allows")
    p.add_argument("--compile", default=S, choices=["auto", "on", "off"],
                   help="mx.compile the tiled engine's tile functions; auto: on the CPU only "
                   "(on CUDA compiled is faster per step but its first step JIT-builds for "
                   "minutes)")
    p.add_argument("--seq", type=int, default=S, help=f"max tokens per example ({d.seq})")
    p.add_argument("--iters", type=int, default=S, help=f"optimizer steps ({d.iters})")
    p.add_argument("--batch-size", type=int, default=S, help=f"examples per micro-batch "
                   f"({d.batch_size})")
    p.add_argument("--grad-accum", type=int, default=S,
                   help=f"micro-batches per optimizer step ({d.grad_accum})")
    p.add_argument("--learning-rate", type=float, default=S, help=f"peak LR ({d.learning_rate})")
    p.add_argument("--warmup", type=int, default=S, help="linear warmup steps (0)")
    p.add_argument("--lr-schedule", choices=["cosine", "constant"], default=S,
                   help=f"after warmup ({d.lr_schedule})")
    p.add_argument("--min-lr", type=float, default=S, help="cosine floor (0)")
    p.add_argument("--weight-decay", type=float, default=S, help=f"AdamW ({d.weight_decay})")
    p.add_argument("--grad-clip", type=float, default=S,
                   help=f"max global grad norm, 0 = off ({d.grad_clip})")
    p.add_argument("--fine-tune-type", choices=["lora", "dora"], default=S)
    p.add_argument("--lora-rank", type=int, default=S, help=f"({d.lora_rank})")
    p.add_argument("--lora-scale", type=float, default=S,
                   help=f"mlx-lm's scale = PEFT alpha / r ({d.lora_scale})")
    p.add_argument("--lora-dropout", type=float, default=S, help=f"({d.lora_dropout})")
    p.add_argument("--lora-keys", nargs="+", default=S,
                   help="module paths inside a layer, e.g. self_attn.q_proj (default: all linears)")
    p.add_argument("--num-layers", type=int, default=S, help="last N layers get LoRA; -1 = all")
    p.add_argument("--seed", type=int, default=S, help="LoRA init, data order, dropout (0)")
    p.add_argument("--val-every", type=int, default=S, help=f"steps; 0 = off ({d.val_every})")
    p.add_argument("--val-batches", type=int, default=S, help=f"-1 = all ({d.val_batches})")
    p.add_argument("--save-every", type=int, default=S, help=f"checkpoint steps ({d.save_every})")
    p.add_argument("--keep-checkpoints", type=int, default=S,
                   help=f"newest kept; 0 = all ({d.keep_checkpoints})")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default=S,
                   help="base weights; auto = float32 on CPU, bfloat16 on GPU")
    p.add_argument("--log", default=S, help="JSONL log (default ADAPTER_PATH/train_log.jsonl)")
    p.add_argument("--resume", action=argparse.BooleanOptionalAction, default=S,
                   help="continue from the newest checkpoint in --adapter-path (default on)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=S,
                   help="tqdm progress bar (default on)")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Defaults < --config YAML < explicit command-line options."""
    given = {k: v for k, v in vars(args).items() if k not in ("command", "_module")}
    merged: dict = {}
    if given.get("config"):
        import yaml

        merged.update(yaml.safe_load(Path(given["config"]).read_text()) or {})
    merged.update({k: v for k, v in given.items() if k != "config"})
    cfg = TrainConfig.from_dict(merged)
    missing = [k for k in ("model", "data", "adapter_path") if not getattr(cfg, k)]
    if missing:
        flags = ", ".join("--" + m.replace("_", "-") for m in missing)
        raise ValueError(f"missing option(s): {flags}")
    return cfg


def main(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args)
        model, tokenizer = load_model(cfg.model)
        data = load_dataset(cfg.data, tokenizer, cfg.seq)
        summary = train(model, tokenizer, data["train"], data["valid"], cfg)
    except TrainingDiverged as e:
        print(f"segback train: {e}", file=sys.stderr)
        return 3
    except (DataError, ValueError, FileNotFoundError) as e:
        print(f"segback train: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({k: summary[k] for k in ("steps", "first_loss", "final_loss", "val_loss",
                                               "peak_gb", "seconds", "tokens_per_second")}))
    return 0
