"""`segback export`: an mlx-lm adapter as mlx-lm copy, PEFT adapter and (optionally) fused model.

PEFT conventions (what `peft.PeftModel.from_pretrained` reads):
- keys `base_model.model.<HF module path>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r];
  mlx-lm stores `lora_a` [in, r] and `lora_b` [r, out], so both are transposed. LoRA on an
  embedding becomes `lora_embedding_A` [r, vocab] / `lora_embedding_B` [dim, r]; DoRA's
  magnitude `m` becomes `lora_magnitude_vector` [out] (PEFT's saved name, no `.weight`).
- `lora_alpha = scale * r`, so PEFT's scaling alpha / r equals mlx-lm's `scale`.
- HF module paths equal mlx-lm's for text models (`model.layers.N...`). mlx-lm nests wrapped
  multimodal text models as `language_model.model.*` where transformers has
  `model.language_model.*` (gemma3, gemma4): that prefix is swapped (see `PREFIX_MAP`).
- `layers_to_transform` lists the adapted layers when LoRA sits on only the last N layers.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from segback.adapters import (
    CONFIG_FILE,
    EMBEDDING_TYPES,
    WEIGHTS_FILE,
    adapter_modules,
    read_config,
    save_safetensors_atomic,
)
from segback.io import atomic_write_bytes, atomic_write_json

# mlx-lm module path prefix -> transformers module path prefix (first match wins).
PREFIX_MAP = (("language_model.model.", "model.language_model."),)
PEFT_WEIGHTS = "adapter_model.safetensors"


def hf_module_path(mlx_path: str) -> str:
    """The transformers module path of an mlx-lm module path."""
    for src, dst in PREFIX_MAP:
        if mlx_path.startswith(src):
            return dst + mlx_path[len(src):]
    return mlx_path


def _layer_index(path: str) -> int | None:
    parts = path.split(".")
    for a, b in zip(parts, parts[1:]):
        if a == "layers" and b.isdigit():
            return int(b)
    return None


def module_kinds(model: nn.Module, adapter_path: str | Path) -> dict[str, str]:
    """{module path: "linear" | "embedding"} of the adapter's layers, by mounting it on `model`.

    Shapes alone cannot tell a LoRA embedding ([vocab, r], [r, dim]) from a linear.
    """
    from mlx_lm.tuner.lora import LoRASwitchLinear
    from mlx_lm.tuner.utils import linear_to_lora_layers

    cfg = read_config(adapter_path)
    linear_to_lora_layers(model, cfg["num_layers"], cfg["lora_parameters"],
                          use_dora=cfg.get("fine_tune_type") == "dora")
    kinds = {}
    for name, m in adapter_modules(model):
        if isinstance(m, LoRASwitchLinear):
            raise NotImplementedError(f"{name}: PEFT export of mixture-of-experts LoRA "
                                      "(LoRASwitchLinear) is not supported")
        kinds[name] = "embedding" if isinstance(m, EMBEDDING_TYPES) else "linear"
    return kinds


def to_peft(
    weights: dict[str, mx.array],
    config: dict,
    kinds: dict[str, str] | None = None,
    base_model: str | None = None,
    num_model_layers: int | None = None,
) -> tuple[dict[str, mx.array], dict]:
    """(PEFT state dict, PEFT adapter_config) from mlx-lm adapter weights and config.

    `kinds` says which modules are embeddings (default: none are); `num_model_layers` lets
    `layers_to_transform` be omitted when every layer is adapted.
    """
    if config.get("fine_tune_type", "lora") not in ("lora", "dora"):
        raise ValueError(f"PEFT export needs a LoRA/DoRA adapter, not "
                         f"{config.get('fine_tune_type')!r}")
    lora = config["lora_parameters"]
    rank, scale = int(lora["rank"]), float(lora["scale"])
    kinds = kinds or {}
    out: dict[str, mx.array] = {}
    targets, layers = set(), set()
    for key, w in sorted(weights.items()):
        module, leaf = key.rsplit(".", 1)
        emb = kinds.get(module) == "embedding"
        prefix = "base_model.model." + hf_module_path(module)
        if leaf == "lora_a":
            name = ".lora_embedding_A" if emb else ".lora_A.weight"
        elif leaf == "lora_b":
            name = ".lora_embedding_B" if emb else ".lora_B.weight"
        elif leaf == "m":
            out[prefix + ".lora_magnitude_vector"] = w
            continue
        else:
            raise ValueError(f"{key}: not a LoRA/DoRA tensor")
        if w.ndim != 2:
            raise NotImplementedError(f"{key}: {w.ndim}-D LoRA tensors (experts) have no PEFT "
                                      "equivalent here")
        out[prefix + name] = mx.contiguous(w.T)
        targets.add(module.rsplit(".", 1)[-1])
        if (i := _layer_index(module)) is not None:
            layers.add(i)
    alpha = scale * rank
    if num_model_layers is not None:
        partial = 0 < len(layers) < num_model_layers
    else:
        partial = bool(layers) and config.get("num_layers", -1) != -1
    subset = sorted(layers) if partial else None
    peft_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model or config.get("model"),
        "r": rank,
        "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "lora_dropout": float(lora.get("dropout", 0.0)),
        "target_modules": sorted(targets),
        "bias": "none",
        "use_dora": config.get("fine_tune_type") == "dora",
        "use_rslora": False,
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "layers_to_transform": subset,
        "layers_pattern": "layers" if subset is not None else None,
        "modules_to_save": None,
        "inference_mode": True,
        "revision": None,
    }
    return out, peft_config


def _load_base(model_spec: str, lazy: bool = True) -> nn.Module:
    """The base model's module tree (weights lazy: only types and shapes are needed)."""
    from segback.models.geometry import GEOMETRIES, build_model

    if model_spec in GEOMETRIES and not Path(model_spec).exists():
        return build_model(model_spec)
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(model_spec), lazy=lazy)
    return model


def export_peft(model_spec: str | None, adapter: str | Path, out: str | Path,
                base_model_name: str | None = None) -> dict:
    """Write OUT/adapter_model.safetensors + OUT/adapter_config.json in PEFT's format."""
    config = read_config(adapter)
    weights = mx.load(str(Path(adapter) / WEIGHTS_FILE))
    kinds, n_layers = None, None
    if model_spec:
        model = _load_base(model_spec)
        n_layers = len(model.layers)
        kinds = module_kinds(model, adapter)
        unknown = sorted({k.rsplit(".", 1)[0] for k in weights} - set(kinds))
        if unknown:
            raise ValueError(f"adapter modules not in the model: {unknown[:3]}")
    tensors, peft_config = to_peft(weights, config, kinds, base_model_name or model_spec,
                                   n_layers)
    out = Path(out)
    save_safetensors_atomic(out / PEFT_WEIGHTS, tensors, metadata={"format": "pt"})
    atomic_write_json(out / CONFIG_FILE, peft_config)
    return peft_config


def export_fused(model_dir: str, adapter: str | Path, out: str | Path,
                 dequantize: bool = False) -> None:
    """`mlx_lm.fuse`'s steps: load with the adapter, fuse each LoRA layer, save with mlx-lm."""
    from mlx.utils import tree_unflatten
    from mlx_lm.utils import dequantize_model, load, save

    if not Path(model_dir).is_dir():
        raise ValueError("--fuse needs --model to be a model directory (with a tokenizer)")
    model, tokenizer, config = load(model_dir, adapter_path=str(adapter), return_config=True)
    fused = [(n, m.fuse(dequantize=dequantize)) for n, m in model.named_modules()
             if hasattr(m, "fuse")]
    if fused:
        model.update_modules(tree_unflatten(fused))
    if dequantize:
        model = dequantize_model(model)
        config.pop("quantization", None)
        config.pop("quantization_config", None)
    tmp = Path(out).with_name(f".{Path(out).name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save(tmp, model_dir, model, tokenizer, config, donate_model=False)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def export(model: str | None, adapter: str | Path, out: str | Path, fuse: bool = False,
           peft: bool = True, base_model_name: str | None = None,
           dequantize: bool = False) -> dict[str, Any]:
    """OUT/mlx (copy), OUT/peft (PEFT format), OUT/fused (optional); returns what was written."""
    adapter, out = Path(adapter), Path(out)
    for f in (WEIGHTS_FILE, CONFIG_FILE):
        if not (adapter / f).exists():
            raise FileNotFoundError(f"{adapter / f} not found: not an mlx-lm adapter directory")
    for f in (WEIGHTS_FILE, CONFIG_FILE):
        atomic_write_bytes(out / "mlx" / f, (adapter / f).read_bytes())
    done: dict[str, Any] = {"mlx": str(out / "mlx")}
    if peft:
        done["peft_config"] = export_peft(model, adapter, out / "peft", base_model_name)
        done["peft"] = str(out / "peft")
    if fuse:
        if not model:
            raise ValueError("--fuse needs --model")
        export_fused(model, adapter, out / "fused", dequantize)
        done["fused"] = str(out / "fused")
    return done


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="base model dir (or geometry name, no --fuse)")
    p.add_argument("--adapter", required=True, help="mlx-lm adapter dir (segback train output)")
    p.add_argument("--out", required=True, help="writes OUT/mlx, OUT/peft, OUT/fused")
    p.add_argument("--fuse", action="store_true", help="also write a fused model (mlx_lm.fuse)")
    p.add_argument("--dequantize", action="store_true", help="fused model in full precision")
    p.add_argument("--no-peft", dest="peft", action="store_false", help="skip the PEFT copy")
    p.add_argument("--base-model-name", default=None,
                   help="PEFT base_model_name_or_path (default: --model)")


def main(args: argparse.Namespace) -> int:
    try:
        done = export(args.model, args.adapter, args.out, fuse=args.fuse, peft=args.peft,
                      base_model_name=args.base_model_name, dequantize=args.dequantize)
    except (FileNotFoundError, ValueError, NotImplementedError) as e:
        print(f"segback export: error: {e}", file=sys.stderr)
        return 2
    for k in ("mlx", "peft", "fused"):
        if k in done:
            print(f"segback export: {k} -> {done[k]}", file=sys.stderr)
    return 0
