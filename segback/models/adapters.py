"""LoRA/DoRA adapters in mlx-lm's layout: save, mount, unmount (hot-swap on one base model).

The layout is mlx-lm's own (`adapters.safetensors` + `adapter_config.json` with fine_tune_type,
num_layers, lora_parameters {rank, scale, dropout, keys}), so `mlx_lm.load(model,
adapter_path=...)`, `mlx_lm.generate --adapter-path` and `mlx_lm.fuse` read what we write.
"""

from __future__ import annotations

import errno
import hashlib
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.tuner.dora import DoRAEmbedding, DoRALinear
from mlx_lm.tuner.lora import LoRAEmbedding, LoRALinear, LoRASwitchLinear
from mlx_lm.tuner.utils import linear_to_lora_layers

from segback.io import atomic_write_file, atomic_write_json

LINEAR_TYPES = (LoRALinear, DoRALinear, LoRASwitchLinear)
EMBEDDING_TYPES = (LoRAEmbedding, DoRAEmbedding)
ADAPTER_TYPES = LINEAR_TYPES + EMBEDDING_TYPES
ADAPTER_LEAVES = ("lora_a", "lora_b", "m")  # "m": DoRA's magnitude
WEIGHTS_FILE = "adapters.safetensors"
CONFIG_FILE = "adapter_config.json"


def adapter_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, module) of every LoRA/DoRA layer in the model."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, ADAPTER_TYPES)]


def adapter_weights(model: nn.Module) -> dict[str, mx.array]:
    """Only the adapter leaves, even if the base is not frozen (as after `mlx_lm.load`)."""
    out = {}
    for name, module in adapter_modules(model):
        for leaf in ADAPTER_LEAVES:
            if leaf in module:
                out[f"{name}.{leaf}"] = module[leaf]
    return out


def adapter_config(fine_tune_type: str, num_layers: int, rank: int, scale: float,
                   dropout: float = 0.0, keys: list[str] | None = None,
                   extra: dict[str, Any] | None = None) -> dict:
    """An adapter_config.json dict in mlx-lm's layout; `extra` keys ride along (mlx-lm ignores
    them, as it ignores the rest of the arguments `mlx_lm.lora` writes there)."""
    lora = {"rank": int(rank), "scale": float(scale), "dropout": float(dropout)}
    if keys:
        lora["keys"] = list(keys)
    return {**(extra or {}), "fine_tune_type": fine_tune_type, "num_layers": int(num_layers),
            "lora_parameters": lora}


def save_safetensors_atomic(path: str | Path, arrays: dict[str, mx.array],
                            metadata: dict[str, str] | None = None) -> None:
    """mx.save_safetensors into a scratch file beside `path`, checked, then renamed over it.

    mx.save_safetensors does not report a failed write (a full disk gives a short file), so the
    scratch file's size is checked against its header before it replaces `path`.
    """
    def write(tmp: Path) -> None:
        try:
            mx.save_safetensors(str(tmp), arrays, metadata=metadata or {})
        except RuntimeError as e:  # e.g. the scratch file cannot be opened
            raise OSError(errno.EIO, str(e)) from e

    atomic_write_file(path, write, suffix=".safetensors", check=_check_safetensors_size)


def _check_safetensors_size(path: Path) -> None:
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        need = 8 + n + max((v["data_offsets"][1] for k, v in header.items()
                            if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError) as e:
        raise OSError(errno.ENOSPC, f"the file is short or corrupt after writing ({e}; disk "
                                    "full?)") from e
    if size < need:
        raise OSError(errno.ENOSPC, f"only {size} of {need} bytes were written (disk full?)")


def save_adapter(model: nn.Module, path: str | Path, config: dict) -> None:
    """Write adapters.safetensors + adapter_config.json (atomically) into `path`."""
    path = Path(path)
    weights = adapter_weights(model)
    if not weights:
        raise ValueError("the model has no LoRA/DoRA layers to save")
    save_safetensors_atomic(path / WEIGHTS_FILE, weights)
    atomic_write_json(path / CONFIG_FILE, config)


def base_fingerprint(model: nn.Module) -> str:
    """sha256 of what tells base models of the same shapes apart: the text model's config and
    its embedding table's first rows (never adapted, also for full fine-tuning). Recorded in a
    trained adapter's config (`base_model_sha256`), so an adapter used on another base model
    is noticed."""
    outer = model.language_model if getattr(model, "model_type", None) == "gemma4" else model
    args = getattr(outer, "args", None)
    h = hashlib.sha256(json.dumps(getattr(args, "__dict__", {}), sort_keys=True,
                                  default=str).encode())
    embed = getattr(getattr(outer, "model", outer), "embed_tokens", None)
    weight = getattr(embed, "weight", None)
    if weight is not None:
        rows = weight[:8]
        if mx.issubdtype(rows.dtype, mx.floating):
            rows = rows.astype(mx.float32)
        h.update(np.array(rows).tobytes())
    return h.hexdigest()


class AdapterError(ValueError):
    """An adapter directory that cannot be used (or not with this model)."""


FINE_TUNE_TYPES = ("lora", "dora", "full")
_LAYOUT = (f"an mlx-lm adapter directory holds {WEIGHTS_FILE} and {CONFIG_FILE} (mlx-lm's "
           "layout, as `segback train` and `mlx_lm.lora` write it)")


def _not_adapter(path: Path, what: str) -> str:
    return f"{what}: {path} is not an mlx-lm adapter directory; {_LAYOUT}"


def read_config(adapter_path: str | Path) -> dict:
    """adapter_config.json of an adapter directory, checked for what mlx-lm needs from it."""
    adapter_path = Path(adapter_path)
    path = adapter_path / CONFIG_FILE
    if not adapter_path.is_dir():
        raise FileNotFoundError(_not_adapter(adapter_path, "no such directory") + ". Pass "
                                "that directory.")
    if not path.is_file():
        peft = " It holds a PEFT adapter (adapter_model.safetensors), which is not read here." \
            if (adapter_path / "adapter_model.safetensors").exists() else ""
        raise FileNotFoundError(_not_adapter(adapter_path, f"{path} not found") + f".{peft} "
                                "Pass the directory holding both files (e.g. the training "
                                "run's --adapter-path or an export's mlx/ folder).")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise AdapterError(f"{path} is not readable JSON ({e}); copy the adapter_config.json "
                           f"that was written with this {WEIGHTS_FILE} again.") from e
    if not isinstance(config, dict):
        raise AdapterError(f"{path} must hold a JSON object (mlx-lm's adapter config), not "
                           f"{type(config).__name__}.")
    kind = config.get("fine_tune_type", "lora")
    if kind not in FINE_TUNE_TYPES:
        raise AdapterError(f"{path}: fine_tune_type {kind!r} is not one of "
                           f"{', '.join(FINE_TUNE_TYPES)}; fix the key (mlx-lm's layout).")
    if kind == "full":
        return config
    lora = config.get("lora_parameters")
    problems = []
    if not isinstance(config.get("num_layers"), int) or isinstance(config["num_layers"], bool):
        problems.append("num_layers (an integer, -1 for all layers)")
    if not isinstance(lora, dict):
        problems.append("lora_parameters (an object with rank, scale, dropout)")
    else:
        rank = lora.get("rank")
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            problems.append("lora_parameters.rank (a positive integer)")
        for key in ("scale", "dropout"):
            if not isinstance(lora.get(key), (int, float)) or isinstance(lora[key], bool):
                problems.append(f"lora_parameters.{key} (a number)")
    if problems:
        raise AdapterError(f"{path} lacks valid {'; '.join(problems)}, which mlx-lm needs to "
                           f"rebuild the {kind.upper()} layers; copy the adapter_config.json "
                           f"that was written with this {WEIGHTS_FILE}.")
    return config


def read_weights(adapter_path: str | Path) -> dict[str, mx.array]:
    """The tensors of adapters.safetensors; a missing, truncated or empty file is an error."""
    path = Path(adapter_path) / WEIGHTS_FILE
    if not path.is_file():
        raise FileNotFoundError(_not_adapter(path.parent, f"{path} not found") + ". Pass the "
                                "directory holding both files.")
    try:
        weights = mx.load(str(path))
    except (RuntimeError, ValueError, OSError) as e:
        raise AdapterError(f"{path} cannot be read ({e}). It is truncated or corrupt (an "
                           "interrupted copy, download or save?): copy or export the adapter "
                           "again.") from e
    if not isinstance(weights, dict) or not weights:
        raise AdapterError(f"{path} holds no tensors; copy or export the adapter again.")
    return weights


def _rank_of(leaf: str, shape: tuple[int, ...]) -> int | None:
    """The LoRA rank a tensor implies: lora_a [in, r] / lora_b [r, out] (linear, embedding),
    lora_a [experts, r, in] / lora_b [experts, out, r] (LoRASwitchLinear)."""
    if leaf not in ("lora_a", "lora_b") or len(shape) not in (2, 3):
        return None
    if len(shape) == 2:
        return shape[1] if leaf == "lora_a" else shape[0]
    return shape[1] if leaf == "lora_a" else shape[2]


def check_weights(weights: dict[str, mx.array], config: dict,
                  adapter_path: str | Path) -> None:
    """Model-independent checks: every tensor finite; LoRA tensors of the configured rank."""
    path = Path(adapter_path) / WEIGHTS_FILE
    bad = [k for k, w in sorted(weights.items())
           if mx.issubdtype(w.dtype, mx.inexact) and not mx.all(mx.isfinite(w)).item()]
    if bad:
        raise AdapterError(f"{path}: {len(bad)} of {len(weights)} tensors hold NaN or infinite "
                           f"values (e.g. {', '.join(bad[:3])}), so the model would only emit "
                           "garbage: the training run diverged. Use an earlier checkpoint or "
                           "retrain (e.g. with a lower learning rate).")
    kind = config.get("fine_tune_type", "lora")
    if kind == "full":
        return
    rank = config["lora_parameters"]["rank"]
    for key, w in sorted(weights.items()):
        leaf = key.rsplit(".", 1)[-1]
        if leaf not in ADAPTER_LEAVES:
            raise AdapterError(f"{path}: tensor {key!r} is not a LoRA/DoRA tensor (lora_a, "
                               f"lora_b, m) although {CONFIG_FILE} says fine_tune_type "
                               f"{kind!r}; the two files do not belong together.")
        r = _rank_of(leaf, tuple(w.shape))
        if r is not None and r != rank:
            raise AdapterError(f"{Path(adapter_path) / CONFIG_FILE} says lora_parameters.rank "
                               f"{rank} but {path} holds rank-{r} tensors (e.g. {key} "
                               f"{tuple(w.shape)}): the config does not belong to these "
                               f"weights. Copy the {CONFIG_FILE} that was written with this "
                               f"{WEIGHTS_FILE}.")


def attach(model: nn.Module, config: dict, adapter_path: str | Path = "") -> None:
    """Replace the configured layers by fresh LoRA/DoRA layers (as mlx-lm's load_adapters)."""
    kind = config.get("fine_tune_type", "lora")
    if kind == "full":
        return
    try:
        linear_to_lora_layers(model, config["num_layers"], config["lora_parameters"],
                              use_dora=kind == "dora")
    except (KeyError, ValueError, TypeError) as e:
        unmount(model)
        raise AdapterError(f"{Path(adapter_path) / CONFIG_FILE} cannot be applied to this "
                           f"model ({e}); it was written for another model. Pass the base "
                           "model the adapter was trained on.") from e


def check_fits(model: nn.Module, weights: dict[str, mx.array], config: dict,
               adapter_path: str | Path) -> None:
    """Every tensor names an adapter parameter of `model` (with the config's layers attached)
    of the same shape, and every attached LoRA/DoRA layer gets its tensors."""
    path = Path(adapter_path) / WEIGHTS_FILE
    params = dict(tree_flatten(model.parameters()))
    kind = config.get("fine_tune_type", "lora")
    allowed = params if kind == "full" else {
        k: v for k, v in params.items() if k.rsplit(".", 1)[-1] in ADAPTER_LEAVES}
    advice = ("The adapter was trained on another model (or another adapter_config.json): "
              "pass the base model it was trained on.")
    unknown = sorted(k for k in weights if k not in allowed)
    if unknown:
        have = sorted(allowed)[:2] or ["none"]
        raise AdapterError(f"{path}: {len(unknown)} of {len(weights)} tensors name parameters "
                           f"this model does not have (e.g. {', '.join(unknown[:3])}; the "
                           f"model's adapter parameters are e.g. {', '.join(have)}). {advice}")
    wrong = [(k, tuple(w.shape), tuple(allowed[k].shape)) for k, w in sorted(weights.items())
             if tuple(w.shape) != tuple(allowed[k].shape)]
    if wrong:
        k, got, want = wrong[0]
        raise AdapterError(f"{path}: {len(wrong)} of {len(weights)} tensors do not fit this "
                           f"model's shapes (e.g. {k} is {got} in the adapter but {want} in the "
                           f"model). {advice}")
    if kind != "full":
        missing = sorted(set(allowed) - set(weights))
        if missing:
            raise AdapterError(f"{path} has no tensors for {len(missing)} LoRA/DoRA parameters "
                               f"that {CONFIG_FILE} adds to this model (e.g. "
                               f"{', '.join(missing[:3])}): its num_layers/keys do not match "
                               f"the weights. Copy the {CONFIG_FILE} that was written with this "
                               f"{WEIGHTS_FILE}, or pass the model the adapter was trained on.")


def validate_adapter(model: nn.Module, adapter_path: str | Path
                     ) -> tuple[dict, dict[str, mx.array]]:
    """(config, weights) of the adapter, checked against `model`, whose layers it replaces with
    (not yet loaded) LoRA/DoRA layers; on error the model is left without adapter layers."""
    config = read_config(adapter_path)
    weights = read_weights(adapter_path)
    check_weights(weights, config, adapter_path)
    attach(model, config, adapter_path)
    try:
        check_fits(model, weights, config, adapter_path)
    except AdapterError:
        unmount(model)
        raise
    return config, weights


def unmount(model: nn.Module) -> nn.Module:
    """Replace every LoRA/DoRA layer by its base layer again (base weights were never touched)."""
    base = [(n, m.linear if isinstance(m, LINEAR_TYPES) else m.embedding)
            for n, m in adapter_modules(model)]
    if base:
        model.update_modules(tree_unflatten(base))
    return model


def mount(model: nn.Module, adapter_path: str | Path) -> nn.Module:
    """Attach the adapter at `adapter_path` (replacing any mounted one) and load its weights.

    Builds what `mlx_lm.load(..., adapter_path=)` builds (mlx-lm's `linear_to_lora_layers`, then
    the weights), after checking the adapter against the model (`validate_adapter`): an
    unreadable, NaN or mismatched adapter raises `AdapterError` instead of producing garbage.
    The new layers take the model's current train/eval mode (dropout only acts in training).
    """
    unmount(model)
    _, weights = validate_adapter(model, adapter_path)
    model.load_weights(list(weights.items()), strict=False)
    model.train(model.training)
    return model
