"""The training loop: mlx-lm's (`mlx_lm.tuner.trainer.train`), resumable bit for bit.

`train(model, optimizer, train_set, val_set, args, grad_fn)` takes its gradient function as
mlx-lm's takes `loss`: `grad_fn(model, batch, lengths) -> ((loss, ntoks), grads)`. The default,
`segmented_grad_fn(plan)`, is `segback.engine.value_and_grad` (exact, one segment's activations
alive); `nn.value_and_grad(model, default_loss)` is mlx-lm's own and gives the same losses.

Step k's data and dropout stream are a pure function of (seed, k), so a resumed run restores only
weights, optimizer state and the step, and ends with the adapter of an uninterrupted run. A
non-finite loss or gradient norm stops the run at once, keeping the last good checkpoint.

Under `mlx.launch` (or any launcher setting MLX's distributed environment) it is data-parallel:
--batch-size is the global batch, as in mlx_lm.lora, and each rank trains on its slice of it
(--batch-size / ranks rows); gradients and loss are combined weighted by each rank's trained
tokens, so the run equals one process of the same --batch-size; only rank 0 writes and reports
(`segback.trainer.distributed`).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map
from mlx_lm.tuner.trainer import default_loss
from tqdm import tqdm

from segback.data.dataset import DataError, TokenDataset, validation_batches
from segback.data.formats import DataFormat, encode_rows
from segback.data.packing import PackedDataset, pack_dataset
from segback.data.packing import describe as describe_packing
from segback.data.sources import load_dataset
from segback.engine import memory_stats, reset_peak, value_and_grad
from segback.engine.head import chunk_rows, loss_mask
from segback.engine.packing import input_tokens as count_input_tokens
from segback.engine.plan_file import step_inputs
from segback.engine.stack import get_stack
from segback.trainer import distributed
from segback.trainer.checkpoints import Interrupted, Run
from segback.trainer.distributed import World

GradFn = Callable[[nn.Module, mx.array, mx.array], tuple[tuple[mx.array, mx.array], Any]]


def segmented_grad_fn(plan: Any = None, options: Any = None) -> GradFn:
    """`segback.engine.value_and_grad` with a `Plan` (or segments), as a grad_fn for `train`;
    it carries the plan, which the run summary records. A `Plan` is checked against the model
    where it is made (`cli.resolve_plan`); the steps run its segments and options."""
    segments, options = step_inputs(plan, options)

    def grad_fn(model, batch, lengths):
        return value_and_grad(model, batch, lengths, segments, options)

    grad_fn.plan = plan
    return grad_fn



def train(model: nn.Module, optimizer: optim.Optimizer, train_set: TokenDataset,
          val_set: TokenDataset | None, args: Any, grad_fn: GradFn | None = None,
          training_callback: Any = None, world: World | None = None) -> dict:
    """Train `model`'s trainable parameters; returns (and writes) the run summary.

    `args` is a `TrainConfig`. `training_callback` is mlx-lm's `TrainingCallback` (its
    on_train_loss_report / on_val_loss_report get mlx-lm's keys). `world`: the ranks
    (`distributed.init()` when not given); rank 0 alone writes, reports and calls back.
    """
    world = world or distributed.init()
    grad_fn = grad_fn or segmented_grad_fn()
    train_set = packed(train_set, args)
    distributed.check_data(train_set, args.batch_size, world)
    run = Run(args, model, train_set, world_size=world.size) if world.main else \
        distributed.Replica(args, model, train_set, world)
    stats = {"tokens": 0, "input_tokens": 0, "seconds": 0.0, "first_loss": None,
             "last_loss": None, "peak_gb": 0.0, "val_loss": None, "first_val_loss": None}
    start = distributed.begin(world, run, model, optimizer, stats)
    report = Reporter(args, training_callback if world.main else None, start,
                      enabled=world.main)
    model.train()

    def validate(step: int) -> None:
        if val_set is None or args.steps_per_eval == 0 or args.val_batches == 0:
            return
        tic = time.perf_counter()
        val = evaluate(model, val_set, args, args.val_batches, world)
        stats["val_loss"] = val
        if stats["first_val_loss"] is None:
            stats["first_val_loss"] = val
        run.log.write({"step": step, "val_loss": val, "val_seconds": time.perf_counter() - tic})
        report.validation(step, val, time.perf_counter() - tic)

    wall = time.perf_counter()
    step = start
    try:
        if start == 0:
            validate(0)
        for step in range(start + 1, args.iters + 1):
            reset_peak()
            tic = time.perf_counter()
            loss, norm, grads, ntoks, input_tokens = gradients(model, grad_fn, train_set, step,
                                                                args, world)
            if not (math.isfinite(loss) and math.isfinite(norm)):
                run.diverged(step, f"loss {loss}, grad norm {norm}")
            optimizer.update(model, grads)
            mx.eval(model.trainable_parameters(), optimizer.state)
            del grads
            lr = learning_rate(optimizer)  # what this update used
            if args.clear_cache_threshold and mx.get_cache_memory() > args.clear_cache_threshold:
                mx.clear_cache()
            seconds = time.perf_counter() - tic
            record = {"step": step, "loss": loss, "lr": lr, "grad_norm": norm, "tokens": ntoks,
                      "input_tokens": input_tokens, "seconds": seconds, **memory_stats()}
            ranks = getattr(world, "full", world)  # every rank, also of context parallelism
            if ranks.size > 1:  # the largest rank's peak, and each rank's
                peaks = ranks.all_gather(mx.array([record["peak_gb"]], mx.float32)).tolist()
                record |= {"peak_gb": max(peaks), "rank_peak_gb": peaks}
            run.log.write(record)
            tally(stats, record)
            report.step(record, last=step == args.iters)

            if args.steps_per_eval and (step % args.steps_per_eval == 0 or step == args.iters):
                validate(step)
            if step == args.iters or (args.save_every and step % args.save_every == 0):
                run.save(step, model, optimizer, stats)
    except KeyboardInterrupt as e:  # SIGINT, or what segback.trainer.stop makes one
        why = f"interrupted ({e or 'SIGINT'})"
        if world.main:
            raise run.interrupted(step, why) from None
        raise Interrupted(f"{why} at step {step} (rank {world.rank})") from None
    finally:
        report.close()
    plan = getattr(grad_fn, "plan", None)
    return run.finish(model, summary(args, model, stats, plan, time.perf_counter() - wall,
                                     world))


def gradients(model: nn.Module, grad_fn: GradFn, train_set: TokenDataset, step: int, args: Any,
              world: World = distributed.SINGLE) -> tuple[float, float, Any, int, int]:
    """Step `step`'s accumulated, averaged and clipped gradients (one eval per micro-batch).

    Returns (mean loss, grad norm before clipping, grads, loss tokens, input tokens). With
    several ranks, each micro-batch's gradient and loss are token-weighted over the ranks
    (this rank's mean x its tokens / all ranks' tokens, summed over the ranks), so they are
    those of the global micro-batch; the weighted gradients are all-summed once per step.
    """
    n = args.grad_accumulation_steps
    parallel = world.size > 1
    acc, loss_sum, ntoks, input_tokens = None, mx.array(0.0), mx.array(0), 0
    for j in range(n):
        index = (step - 1) * n + j
        batch, lengths = distributed.batch_at(train_set, index, args.batch_size, args.seed,
                                              args.max_seq_length, world)
        input_tokens += count_input_tokens(lengths)
        mx.random.seed(distributed.rank_seed(micro_seed(args.seed, index), world))
        (loss, toks), grads = grad_fn(model, batch, lengths)
        if parallel:
            total = world.all_sum(toks.astype(mx.int32))
            share = toks.astype(mx.float32) / total.astype(mx.float32)
            grads = tree_map(lambda g: g.astype(mx.float32) * share, grads)
            loss = world.all_sum(loss.astype(mx.float32) * toks.astype(mx.float32)) / \
                total.astype(mx.float32)
            toks = total
        acc = grads if acc is None else tree_map(mx.add, acc, grads)
        loss_sum, ntoks = loss_sum + loss, ntoks + toks
        if j < n - 1:
            mx.eval(loss_sum, ntoks, acc)
    if parallel:  # sum over the ranks, back in the parameters' dtype
        acc = tree_map(lambda g, p: g.astype(p.dtype), world.all_sum_tree(acc),
                       model.trainable_parameters())
        input_tokens = int(world.all_sum(mx.array([input_tokens], mx.int32)).item())
    if n > 1:
        acc = tree_map(lambda g: g / n, acc)
    if args.grad_clip > 0:
        acc, norm = optim.clip_grad_norm(acc, args.grad_clip)
    else:
        norm = mx.sqrt(sum(mx.sum(mx.square(g.astype(mx.float32)))
                           for _, g in tree_flatten(acc)))
    mx.eval(loss_sum, ntoks, acc, norm)
    return loss_sum.item() / n, norm.item(), acc, int(ntoks.item()), input_tokens


def tally(stats: dict, record: dict) -> None:
    """Run totals after one step (a checkpoint keeps them, so a resume continues them)."""
    for k in ("tokens", "input_tokens", "seconds"):
        stats[k] += record[k]
    stats["peak_gb"] = max(stats["peak_gb"], record["peak_gb"])
    stats["last_loss"] = record["loss"]
    if stats["first_loss"] is None:
        stats["first_loss"] = record["loss"]


def micro_seed(seed: int, index: int) -> int:
    """The dropout stream of micro-batch `index`: a pure function, like its data."""
    return (int(seed) * 1_000_003 + int(index)) % (1 << 63)


def learning_rate(optimizer: optim.Optimizer) -> float:
    """The learning rate of the optimizer's last update (a schedule sets it in `update`)."""
    lr = optimizer.learning_rate
    return float(lr.item() if isinstance(lr, mx.array) else lr)


def summary(args: Any, model: nn.Module, stats: dict, plan: Any, wall: float,
            world: World = distributed.SINGLE) -> dict:
    segments = getattr(plan, "segments", plan)  # a Plan, ranges, layers per segment or None
    return {
        "steps": args.iters,
        "seq": args.max_seq_length,
        "batch_size": args.batch_size,
        "world_size": world.size,
        "global_batch_size": args.batch_size,  # --batch-size is global, as in mlx_lm.lora
        "rank_batch_size": args.batch_size // world.size,
        "context_parallel": getattr(world, "context", 1),
        "grad_accum": args.grad_accumulation_steps,
        "segments": [list(s) for s in segments] if isinstance(segments, list) else segments,
        "plan": args.plan if isinstance(args.plan, (str, int)) else "list",
        "engine": plan.engine.to_dict() if hasattr(plan, "engine") else None,
        "pack": bool(getattr(args, "pack", False)),
        "fine_tune_type": args.fine_tune_type,
        "lora_parameters": None if args.fine_tune_type == "full" else args.lora_parameters,
        "optimizer": args.optimizer,
        "trainable_parameters": sum(v.size for _, v in
                                    tree_flatten(model.trainable_parameters())),
        "peak_gb": stats["peak_gb"],
        "seconds": stats["seconds"],
        "wall_seconds": wall,
        "tokens": stats["tokens"],
        "input_tokens": stats["input_tokens"],
        "tokens_per_second": stats["tokens"] / max(stats["seconds"], 1e-9),
        "input_tokens_per_second": stats["input_tokens"] / max(stats["seconds"], 1e-9),
        "first_loss": stats["first_loss"],
        "final_loss": stats["last_loss"],
        "first_val_loss": stats["first_val_loss"],
        "val_loss": stats["val_loss"],
    }


class Reporter:
    """The tqdm bar, a report line every --steps-per-report steps (averaged over them, as
    mlx-lm) and mlx-lm's reporting callback (wandb, swanlab)."""

    def __init__(self, args: Any, callback: Any, start: int, enabled: bool = True):
        self.args, self.callback, self.enabled = args, callback, enabled
        self.bar = tqdm(total=args.iters, initial=start, desc="train", unit="step",
                        file=sys.stderr, disable=not (args.progress and enabled),
                        dynamic_ncols=True)
        self.window: list[dict] = []
        self.trained_tokens = 0

    def step(self, record: dict, last: bool) -> None:
        self.bar.update(1)
        self.window.append(record)
        if record["step"] % self.args.steps_per_report and not last:
            return
        w, self.window = self.window, []
        seconds = sum(r["seconds"] for r in w)
        tokens = sum(r["tokens"] for r in w)
        self.trained_tokens += tokens
        info = {"iteration": record["step"], "train_loss": sum(r["loss"] for r in w) / len(w),
                "learning_rate": record["lr"], "iterations_per_second": len(w) / seconds,
                "tokens_per_second": tokens / seconds, "trained_tokens": self.trained_tokens,
                "peak_memory": max(r["peak_gb"] for r in w)}
        self.bar.set_postfix(loss=f"{info['train_loss']:.3f}",
                             tok_s=f"{info['tokens_per_second']:.0f}",
                             peak_gb=f"{info['peak_memory']:.2f}")
        self.write(f"Iter {info['iteration']}: Train loss {info['train_loss']:.3f}, Learning "
                   f"Rate {info['learning_rate']:.3e}, It/sec "
                   f"{info['iterations_per_second']:.3f}, Tokens/sec "
                   f"{info['tokens_per_second']:.1f}, Trained Tokens {self.trained_tokens}, "
                   f"Peak mem {info['peak_memory']:.3f} GB")
        if self.callback is not None:
            self.callback.on_train_loss_report(info)

    def validation(self, step: int, loss: float, seconds: float) -> None:
        self.write(f"Iter {step}: Val loss {loss:.3f}, Val took {seconds:.3f}s")
        if self.callback is not None:
            self.callback.on_val_loss_report({"iteration": step, "val_loss": loss,
                                              "val_time": seconds})

    def write(self, line: str) -> None:
        if not self.enabled:
            return
        self.bar.write(line, file=sys.stderr) if self.args.progress else \
            print(line, file=sys.stderr)

    def close(self) -> None:
        self.bar.close()


# ---- evaluation (forward only, chunked head) -------------------------------------------------


def eval_loss(model: nn.Module, batch: mx.array, lengths: mx.array) -> tuple[float, int]:
    """(sum of CE over counted tokens, count): no [B, T, vocab] logits at once, no backward."""
    try:
        stack = get_stack(model)
    except ValueError:
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


def evaluate(model: nn.Module, dataset: TokenDataset, args: Any, num_batches: int,
             world: World | None = None) -> float:
    """Mean loss per token over a fixed set of batches (-1: all), dropout off.

    With several ranks the batches are global ones (--batch-size), each rank scores its slice
    and the sums are all-summed: the loss one process of that batch size reports."""
    world = world or distributed.init()
    model.eval()
    total, count = 0.0, 0
    try:
        for batch, lengths in validation_batches(dataset, args.batch_size, num_batches,
                                                 args.seed, args.max_seq_length):
            batch, lengths = distributed.shard(batch, lengths, world,
                                               distributed.rank_batch(args.batch_size, world))
            if batch.shape[0] == 0:
                continue
            s, n = eval_loss(model, batch, lengths)
            total, count = total + s, count + n
    finally:
        model.train()
    if world.size > 1:
        total = world.all_sum(mx.array([total], mx.float32)).item()
        count = int(world.all_sum(mx.array([count], mx.int32)).item())
    return total / max(count, 1)


def test(model: nn.Module, test_set: TokenDataset, args: Any, world: World | None = None
         ) -> dict:
    """Test loss and perplexity over --test-batches batches, as `mlx_lm.lora --test`."""
    loss = evaluate(model, test_set, args, args.test_batches, world)
    return {"test_loss": loss, "test_ppl": math.exp(loss), "test_batches": args.test_batches}


# ---- data ------------------------------------------------------------------------------------


def load_data(args: Any, tokenizer: Any) -> tuple[TokenDataset | None, ...]:
    """(train, valid, test) for what this run does, read as mlx_lm.lora reads them: --data (a
    directory, a file or a Hugging Face name) or `hf_dataset`, with --mask-prompt and the
    *_feature names (`segback.data.load_dataset`)."""
    splits = (("train", "valid") if args.do_train else ()) + (("test",) if args.test else ())
    data = load_dataset(args.hf_dataset or args.data, tokenizer, args.max_seq_length, splits,
                        DataFormat.from_config(args))
    if args.test and data.get("test") is None:
        raise DataError(f"--test needs a test split (test.jsonl in {args.data})")
    return tuple(data.get(s) for s in ("train", "valid", "test"))


def packed(train_set: TokenDataset, args: Any) -> TokenDataset:
    """With --pack, the training examples packed into rows of --max-seq-length tokens
    (`segback.data.packing`); validation and test stay unpacked (the same loss either way, and
    comparable with unpacked runs)."""
    if not getattr(args, "pack", False) or isinstance(train_set, PackedDataset):
        return train_set
    train_set = pack_dataset(train_set, args.max_seq_length)
    print(f"segback: {describe_packing(train_set)}", file=sys.stderr)
    return train_set


def as_dataset(rows: Any, tokenizer: Any, args: Any, name: str) -> TokenDataset | None:
    """A TokenDataset from in-memory rows (chat, completions or text dicts), or itself."""
    if rows is None or isinstance(rows, TokenDataset):
        return rows
    if len(rows) == 0:
        return None
    return encode_rows(tokenizer, list(rows), args.max_seq_length, name,
                       DataFormat.from_config(args))
