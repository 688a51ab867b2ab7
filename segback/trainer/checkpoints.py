"""The run directory: checkpoints, the JSONL log, resume, and the final adapter.

ADAPTER_PATH/
  adapters.safetensors, adapter_config.json   mlx-lm's layout (written when the run finishes)
  checkpoints/step_{k:06d}/                   adapter + optimizer state + state.json (last)
  train_log.jsonl                             one record per step / validation / resume
  train_summary.json                          the finished run

A checkpoint holds everything a bit-exact resume needs besides (seed, step), which fix the data
order and dropout: the trainable weights and the optimizer state. Resume refuses a checkpoint
made for another model, data, dtype or a setting that fixes the data order or the adapter's
shape; a different BLAS thread count only warns (float sums may then round differently).
Every file is written atomically (temp + rename); a checkpoint directory is complete once its
state.json exists. One whose files cannot be read (a torn copy, a disk error) is set aside
with a warning and the newest intact one resumes. A finished run keeps its last checkpoint
when asked to clean up, so running a finished training again (its workflow stopped before
recording it) rewrites the same adapter at once instead of training again.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any, NoReturn

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_map_with_path

from segback.models.adapters import CONFIG_FILE, WEIGHTS_FILE, base_fingerprint, \
    save_safetensors_atomic
from segback.io import atomic_write_json, atomic_write_text, read_json
from segback.trainer import engine_request
from segback.trainer.values import TrainConfigError

CHECKPOINTS = "checkpoints"
FINISHED = "finished"  # checkpoints/finished/KEY: the last checkpoint of finished settings
SUMMARY = "train_summary.json"
# Options that fix the data order, the adapter's shape or its meaning: a resume must match.
RESUME_KEYS = ("model", "data", "fine_tune_type", "num_layers", "lora_parameters", "seed",
               "batch_size", "grad_accumulation_steps", "max_seq_length", "mask_prompt",
               "optimizer", "resume_adapter_file", "prompt_feature", "completion_feature",
               "chat_feature", "text_feature", "hf_dataset")


# Options that change how a run is watched or where it writes, not the adapter it ends with.
RUN_ONLY = {"adapter_path", "checkpoint_dir", "log", "progress", "resume", "keep_checkpoints",
            "parent_pid",
            "clean_checkpoints", "restart_on_change", "steps_per_report", "report_to",
            "project_name", "config", "test", "test_batches", "save_every"}


class TrainingDiverged(RuntimeError):
    """Loss, gradient norm or weights became NaN/inf; the last good checkpoint is kept."""


class ResumeError(ValueError):
    """The newest checkpoint was made for other settings than this run's."""


class Interrupted(RuntimeError):
    """SIGINT or SIGTERM (or the workflow that started the run exited); the checkpoints
    stay, and the same command resumes from the last one."""


def blas_threads() -> int:
    """Threads OpenBLAS uses: OPENBLAS_NUM_THREADS, else OMP_NUM_THREADS, else the CPUs."""
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        if os.environ.get(var, "").strip().isdigit():
            return int(os.environ[var])
    return os.cpu_count() or 1


def data_fingerprint(dataset: Any) -> str:
    """sha256 of the tokenized examples (ids and loss offsets): changes with the data."""
    h = hashlib.sha256()
    for ids, offset in dataset.examples:
        h.update(json.dumps([offset, list(ids)]).encode())
    return h.hexdigest()


def model_dtype(model: nn.Module) -> str:
    """The dtype of the model's floating base weights."""
    for _, v in tree_flatten(model.parameters()):
        if mx.issubdtype(v.dtype, mx.floating):
            return str(v.dtype).removeprefix("mlx.core.")
    return "none"


def identity(args: Any, model: nn.Module, train_set: Any) -> dict[str, Any]:
    """What a checkpoint must share with the run that resumes it."""
    return {**{k: getattr(args, k, None) for k in RESUME_KEYS},
            "dtype": model_dtype(model), "data_sha256": data_fingerprint(train_set)}


def typed_engine(config: dict) -> dict:
    """`config` with its engine options as `engine_request.parse` types them: options given as
    "2048" or 2048, "true" or true, name the same settings."""
    if not isinstance(config.get("engine"), dict):
        return config
    try:
        return config | {"engine": engine_request.parse(config["engine"])}
    except TrainConfigError:
        return config


def check_resume(saved: dict, current: dict, path: Path) -> None:
    changed = [k for k in current if saved.get(k) != current[k]]
    if changed:
        what = ", ".join(f"{k}: {_short(saved.get(k))} -> {_short(current[k])}" for k in changed)
        raise ResumeError(f"cannot resume from {path}: {what} changed; use --no-resume or "
                          "another --adapter-path")


def global_batch(state: dict, path: Path, batch_size: int, say: bool = True) -> dict:
    """A checkpoint's identity with --batch-size as the global batch. Before that meaning
    (mlx_lm.lora's), a run of N ranks read --batch-size per rank: its global batch was N times
    it, which is what a resume must now be given (the data order is then the same)."""
    saved, ranks = dict(state["identity"]), state.get("world_size", 1)
    if ranks == 1 or state.get("batch_size_is") == "global":
        return saved
    per_rank = saved.get("batch_size")
    saved["batch_size"] = per_rank * ranks
    if batch_size != per_rank * ranks:
        raise ResumeError(
            f"cannot resume from {path}: it was trained with --batch-size {per_rank} per rank on "
            f"{ranks} ranks (segback's old meaning), a global batch of {per_rank * ranks}; "
            "--batch-size is now the global batch, split across the ranks as in mlx_lm.lora: "
            f"resume with --batch-size {per_rank * ranks}, or start afresh with --no-resume")
    if say:
        print(f"segback: note: {path} was trained with --batch-size {per_rank} per rank on "
              f"{ranks} ranks; that is --batch-size {per_rank * ranks} as it is read now (the "
              "global batch): resuming with the same batches", file=sys.stderr)
    return saved


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 40 else s[:16] + "..." + s[-8:]


def trainable_weights(model: nn.Module) -> dict[str, mx.array]:
    """What mlx-lm saves as the adapter: the trainable parameters (LoRA/DoRA leaves, or the
    unfrozen layers for --fine-tune-type full)."""
    return dict(tree_flatten(model.trainable_parameters()))


def save_adapter(model: nn.Module, path: Path, config: dict) -> None:
    """adapters.safetensors + adapter_config.json, atomically, as mlx_lm.lora writes them."""
    save_safetensors_atomic(path / WEIGHTS_FILE, trainable_weights(model))
    atomic_write_json(path / CONFIG_FILE, config)


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


def damaged(path: Path) -> str | None:
    """Why checkpoint `path` cannot be resumed (a file torn or unreadable), else None."""
    try:
        state = read_json(path / "state.json")
        if not isinstance(state, dict) or "step" not in state:
            return "state.json holds no step"
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return f"state.json: {e}"
    for name in (WEIGHTS_FILE, "optimizer.safetensors"):
        try:
            mx.load(str(path / name))
        except (RuntimeError, ValueError, OSError) as e:
            return f"{name}: {str(e).removeprefix('[load_safetensors] ')}"
    return None


def intact_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """`list_checkpoints`, after removing the newest ones that cannot be read (each named on
    stderr): resume then starts from the newest intact one."""
    found = list_checkpoints(root)
    while found:
        step, path = found[-1]
        why = damaged(path)
        if why is None:
            break
        found.pop()
        older = f"step {found[-1][0]}" if found else "none: training starts afresh"
        print(f"segback: warning: checkpoint {path} is damaged ({why}); removed it, resuming "
              f"from the newest intact one ({older})", file=sys.stderr)
        shutil.rmtree(path, ignore_errors=True)
    return found


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints in `root` (state.json is written last), oldest first."""
    found = []
    for p in root.glob("step_*"):
        m = re.fullmatch(r"step_(\d+)", p.name)
        if m and (p / "state.json").exists():
            found.append((int(m.group(1)), p))
    return sorted(found)


def load_checkpoint(path: Path, model: nn.Module, optimizer: optim.Optimizer) -> dict:
    """Restore trainable weights and optimizer state in place; return state.json."""
    model.load_weights(list(mx.load(str(path / WEIGHTS_FILE)).items()), strict=False)
    saved = mx.load(str(path / "optimizer.safetensors"))
    optimizer.init(model.trainable_parameters())
    missing = [k for k, _ in tree_flatten(optimizer.state) if k not in saved]
    if missing:
        raise ResumeError(f"{path}: optimizer state lacks {missing[:3]}... (another optimizer "
                          "or adapter?)")
    optimizer.state = tree_map_with_path(lambda k, v: saved[k], optimizer.state)
    mx.eval(model.parameters(), optimizer.state)
    return read_json(path / "state.json")


class Run:
    """One training run's directory: resume, log records, checkpoints, the finished adapter."""

    def __init__(self, args: Any, model: nn.Module, train_set: Any, world_size: int = 1):
        self.args = args
        self.world_size = world_size  # data-parallel ranks (rank 0 alone holds a Run)
        self.out = Path(args.adapter_path)  # made when the adapter is written: a workflow
        # sees no output of an unfinished run
        # Checkpoints live in --checkpoint-dir when given: a directory a workflow manager does
        # not own survives the deletion of an interrupted job's outputs.
        self.ckpt = Path(args.checkpoint_dir) if getattr(args, "checkpoint_dir", None) \
            else self.out / CHECKPOINTS
        self.log = JsonlLog(Path(args.log) if args.log else self.out / "train_log.jsonl")
        self.identity = identity(args, model, train_set)
        self.base = base_fingerprint(model)
        self.threads = blas_threads()
        self.last_saved: int | None = None
        self.resumed_from: int | None = None

    def adapter_config(self) -> dict:
        """adapter_config.json: every option, as mlx_lm.lora writes its arguments there."""
        cfg = self.args.to_dict() if hasattr(self.args, "to_dict") else dict(vars(self.args))
        if cfg.get("fine_tune_type") == "full":
            cfg["lora_parameters"] = None  # as mlx-lm
        return cfg | {"base_model_sha256": self.base}

    def start(self, model: nn.Module, optimizer: optim.Optimizer, stats: dict) -> int:
        """The step to continue after: the newest checkpoint's (restored into model, optimizer
        and stats) when resuming, else 0 (old checkpoints and log removed)."""
        for tmp in self.ckpt.glob(".tmp-*"):
            shutil.rmtree(tmp, ignore_errors=True)
        checkpoints = intact_checkpoints(self.ckpt)
        start = 0
        changed = self._changed(checkpoints[-1][1]) if checkpoints and self.args.resume and \
            getattr(self.args, "restart_on_change", False) else None
        if changed:
            print(f"segback: the checkpoints in {self.ckpt} were made with another {changed}: "
                  "starting afresh (--restart-on-change)", file=sys.stderr)
            self._set_aside(checkpoints[-1][1])
            for _, old in checkpoints:
                shutil.rmtree(old, ignore_errors=True)
            checkpoints = []
        kept = self.ckpt / FINISHED / self._key(self.identity, self.world_size,
                                                self.adapter_config())
        if not checkpoints and self.args.resume and kept.is_dir():
            step = read_json(kept / "state.json")["step"]
            print(f"segback: these settings finished before ({kept}): resuming from their last "
                  "checkpoint", file=sys.stderr)
            os.replace(kept, self.ckpt / f"step_{step:06d}")
            checkpoints = intact_checkpoints(self.ckpt)
        if checkpoints and self.args.resume:
            start, path = checkpoints[-1]
            if start > self.args.iters:
                raise ResumeError(f"{path} is past --iters {self.args.iters}; use --no-resume "
                                  "or more --iters")
            state = read_json(path / "state.json")
            if "identity" not in state:
                raise ResumeError(f"{path} was written by an older segback train; use "
                                  "--no-resume or another --adapter-path")
            ranks = state.get("world_size", 1)
            if ranks != self.world_size:  # each rank's slice and dropout stream would change
                raise ResumeError(
                    f"cannot resume from {path}: it was trained on {ranks} rank(s), this run "
                    f"has {self.world_size}; resume with {ranks} rank(s) ("
                    + (f"mlx.launch -n {ranks} ..." if ranks > 1 else "without a launcher")
                    + "), or start afresh with --no-resume")
            check_resume(global_batch(state, path, self.identity["batch_size"]), self.identity,
                          path)
            if state["config"].get("base_model_sha256", self.base) != self.base:
                raise ResumeError(f"cannot resume from {path}: it was trained on another base "
                                  f"model than {self.args.model} holds now (same name, other "
                                  "weights); use --no-resume or another --adapter-path")
            if state.get("blas_threads") != self.threads:
                print(f"segback: warning: {path} was trained with {state.get('blas_threads')} "
                      f"BLAS threads, this run has {self.threads}: the result will not be "
                      "bit-identical to an uninterrupted run (set OPENBLAS_NUM_THREADS)",
                      file=sys.stderr)
            if state["config"].get("iters") != self.args.iters or \
                    state["config"].get("lr_schedule") != self.args.lr_schedule or \
                    state["config"].get("learning_rate") != self.args.learning_rate:
                print("segback: resuming with another --iters/--learning-rate/lr_schedule: the "
                      "schedule changes from here on", file=sys.stderr)
            stats.update(load_checkpoint(path, model, optimizer)["stats"])
            self.last_saved = self.resumed_from = start
            self.log.truncate_after(start)
            self.log.write({"step": start, "resumed_from": start, "checkpoint": str(path),
                            "blas_threads": self.threads})
            print(f"segback: resuming from {path} (step {start})", file=sys.stderr)
        else:
            if checkpoints:
                print(f"segback: --no-resume: removing {len(checkpoints)} old checkpoint(s)",
                      file=sys.stderr)
                shutil.rmtree(self.ckpt, ignore_errors=True)
            self.log.truncate_after(-1)
        if start < self.args.iters:  # final files exist only for a finished run
            for name in (WEIGHTS_FILE, CONFIG_FILE, SUMMARY):
                (self.out / name).unlink(missing_ok=True)
        return start

    def save(self, step: int, model: nn.Module, optimizer: optim.Optimizer, stats: dict
             ) -> Path:
        """checkpoints/step_{k:06d}/ via a temp dir and a rename; prune old ones. Refuses
        non-finite weights, so the last checkpoint is always a good one."""
        bad = [k for k, v in trainable_weights(model).items()
               if not mx.all(mx.isfinite(v)).item()]
        if bad:
            self.diverged(step, f"non-finite weights ({bad[0]} ...)")
        root = self.ckpt
        final = root / f"step_{step:06d}"
        tmp = root / f".tmp-step_{step:06d}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        save_adapter(model, tmp, self.adapter_config())
        save_safetensors_atomic(tmp / "optimizer.safetensors",
                                dict(tree_flatten(optimizer.state)))
        atomic_write_json(tmp / "state.json", {
            "step": step, "config": self.adapter_config(), "identity": self.identity,
            "blas_threads": self.threads, "stats": stats, "world_size": self.world_size,
            "batch_size_is": "global"})
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        keep = self.args.keep_checkpoints
        if keep > 0:
            for _, old in list_checkpoints(self.ckpt)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
        self.last_saved = step
        return final

    def diverged(self, step: int, what: str) -> NoReturn:
        last = self.ckpt / f"step_{self.last_saved or 0:06d}"
        keep = f"the last good checkpoint is {last}" if self.last_saved else \
            "no checkpoint was saved before it"
        msg = (f"training diverged at step {step}: {what}; stopped ({keep}). "
               "Try a lower --learning-rate, more --warmup or --grad-clip.")
        self.log.write({"step": step, "error": msg})
        raise TrainingDiverged(msg)

    def finish(self, model: nn.Module, summary: dict) -> dict:
        """The adapter in mlx-lm's layout and train_summary.json; with `--clean-checkpoints`
        every checkpoint but the last goes (the last makes a rerun of this finished training
        instant and bit-identical)."""
        save_adapter(model, self.out, self.adapter_config())
        summary = {**summary, "resumed_from": self.resumed_from, "blas_threads": self.threads,
                   "dtype": self.identity["dtype"], "adapter_path": str(self.out)}
        atomic_write_json(self.out / SUMMARY, summary)
        if getattr(self.args, "clean_checkpoints", False):
            for _, old in list_checkpoints(self.ckpt)[:-1]:
                shutil.rmtree(old, ignore_errors=True)
        return summary

    def interrupted(self, step: int, why: str) -> Interrupted:
        """The one line an interrupted run ends with."""
        last = f"the last checkpoint is step {self.last_saved} ({self.ckpt})" \
            if self.last_saved else "no checkpoint was saved yet"
        msg = (f"{why} at step {step} of {self.args.iters}; stopped ({last}). Run the same "
               "command again to resume.")
        self.log.write({"step": step, "interrupted": msg})
        return Interrupted(msg)

    @staticmethod
    def _key(identity: dict, world_size: int, config: dict) -> str:
        """Names a run's settings: what fixes its result (not RUN_ONLY options)."""
        kept = {k: v for k, v in typed_engine(config).items() if k not in RUN_ONLY}
        text = json.dumps([identity, world_size, kept], sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def _set_aside(self, path: Path) -> None:
        """Keep the last checkpoint of a finished run whose settings this run replaces (in
        FINISHED/, by settings): going back to them (a config change that failed, reverted)
        then resumes it instead of training again. The newest `keep_checkpoints` are kept."""
        try:
            state = read_json(path / "state.json")
        except (OSError, ValueError):
            return
        if state.get("step") != state.get("config", {}).get("iters"):
            return  # unfinished: its steps are cheaper to redo than to keep around
        root = self.ckpt / FINISHED
        root.mkdir(parents=True, exist_ok=True)
        key = self._key(state["identity"], state.get("world_size", 1), state["config"])
        shutil.rmtree(root / key, ignore_errors=True)
        os.replace(path, root / key)
        keep = self.args.keep_checkpoints
        if keep > 0:
            for old in sorted(root.iterdir(), key=lambda p: p.stat().st_mtime)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)

    def _changed(self, path: Path) -> str | None:
        """What differs between the newest checkpoint's run and this one (None: nothing that
        changes the result), for --restart-on-change."""
        state = read_json(path / "state.json")
        if "identity" not in state:
            return "segback version"
        try:
            saved = global_batch(state, path, self.identity["batch_size"], say=False)
        except ResumeError:
            return "batch_size (--batch-size is now the global batch, as in mlx_lm.lora)"
        moved = [k for k in self.identity if saved.get(k) != self.identity[k]]
        if moved:
            return ", ".join(moved)
        if state.get("world_size", 1) != self.world_size:
            return "number of ranks"
        saved, now = typed_engine(state.get("config", {})), self.adapter_config()
        keys = sorted(k for k in set(saved) | set(now)  # identity's keys are compared above
                      if k not in RUN_ONLY and k not in self.identity
                      and saved.get(k) != now.get(k)
                      and (k in saved or k != "base_model_sha256"))  # older: not recorded
        return f"setting ({', '.join(keys)})" if keys else None
