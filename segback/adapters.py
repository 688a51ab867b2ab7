"""LoRA/DoRA adapters in mlx-lm's layout: save, mount, unmount (hot-swap on one base model).

The layout is mlx-lm's own (`adapters.safetensors` + `adapter_config.json` with fine_tune_type,
num_layers, lora_parameters {rank, scale, dropout, keys}), so `mlx_lm.load(model,
adapter_path=...)`, `mlx_lm.generate --adapter-path` and `mlx_lm.fuse` read what we write.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten
from mlx_lm.tuner.dora import DoRAEmbedding, DoRALinear
from mlx_lm.tuner.lora import LoRAEmbedding, LoRALinear, LoRASwitchLinear
from mlx_lm.tuner.utils import load_adapters

from segback.io import atomic_write_json

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
    """mx.save_safetensors into a temp file beside `path`, then rename over it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.safetensors")  # keeps the suffix
    try:
        mx.save_safetensors(str(tmp), arrays, metadata=metadata or {})
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save_adapter(model: nn.Module, path: str | Path, config: dict) -> None:
    """Write adapters.safetensors + adapter_config.json (atomically) into `path`."""
    path = Path(path)
    weights = adapter_weights(model)
    if not weights:
        raise ValueError("the model has no LoRA/DoRA layers to save")
    save_safetensors_atomic(path / WEIGHTS_FILE, weights)
    atomic_write_json(path / CONFIG_FILE, config)


def read_config(adapter_path: str | Path) -> dict:
    path = Path(adapter_path) / CONFIG_FILE
    if not path.exists():
        raise FileNotFoundError(f"no {CONFIG_FILE} in {adapter_path}")
    return json.loads(path.read_text())


def unmount(model: nn.Module) -> nn.Module:
    """Replace every LoRA/DoRA layer by its base layer again (base weights were never touched)."""
    base = [(n, m.linear if isinstance(m, LINEAR_TYPES) else m.embedding)
            for n, m in adapter_modules(model)]
    if base:
        model.update_modules(tree_unflatten(base))
    return model


def mount(model: nn.Module, adapter_path: str | Path) -> nn.Module:
    """Attach the adapter at `adapter_path` (replacing any mounted one) and load its weights.

    Uses mlx-lm's `load_adapters`, so the result is what `mlx_lm.load(..., adapter_path=)` builds.
    The new layers take the model's current train/eval mode (dropout only acts in training).
    """
    unmount(model)
    load_adapters(model, str(adapter_path))
    model.train(model.training)
    return model
