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
- `base_model_name_or_path` is the base model's Hub id (--base-model-id, else a `base_model` /
  `_name_or_path` Hub id in the model dir's config.json, which `prepare-model --source hub`
  records), else the model's absolute local path, with a warning.

The adapter is checked before anything is written (segback.models.adapters: config readable, tensors
readable and finite, rank as configured, every tensor a parameter of the model's adapted modules
with the same shape), and OUT is built in a scratch directory beside it and renamed into place.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten
from mlx_lm.tuner.lora import LoRASwitchLinear
from mlx_lm.utils import dequantize_model, load, load_model, save

from segback.io import atomic_dir, atomic_write_json
from segback.models.adapters import (
    CONFIG_FILE,
    EMBEDDING_TYPES,
    WEIGHTS_FILE,
    adapter_modules,
    attach,
    check_fits,
    check_weights,
    mount,
    read_config,
    read_weights,
    save_safetensors_atomic,
    validate_adapter,
)
from segback.models.random_init import GEOMETRIES, build_model

# mlx-lm module path prefix -> transformers module path prefix (first match wins).
PREFIX_MAP = (("language_model.model.", "model.language_model."),)
PEFT_WEIGHTS = "adapter_model.safetensors"
OUT_PARTS = ("mlx", "peft", "fused")
# config.json keys that may name the base model's Hub id (a model card's `base_model`, the
# `_name_or_path` transformers records); only `org/name` values are taken as Hub ids.
HUB_ID_KEYS = ("base_model", "_name_or_path")
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


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


def adapted_kinds(model: nn.Module) -> dict[str, str]:
    """{module path: "linear" | "embedding"} of the LoRA/DoRA layers attached to `model`.

    Shapes alone cannot tell a LoRA embedding ([vocab, r], [r, dim]) from a linear.
    """
    kinds = {}
    for name, m in adapter_modules(model):
        if isinstance(m, LoRASwitchLinear):
            raise NotImplementedError(f"{name}: PEFT export of mixture-of-experts LoRA "
                                      "(LoRASwitchLinear) is not supported; pass --no-peft "
                                      "for the mlx-lm copy (and --fuse for a fused model).")
        kinds[name] = "embedding" if isinstance(m, EMBEDDING_TYPES) else "linear"
    return kinds


def module_kinds(model: nn.Module, adapter_path: str | Path) -> dict[str, str]:
    """`adapted_kinds` after mounting the adapter's layers (checked) on `model`."""
    validate_adapter(model, adapter_path)
    return adapted_kinds(model)


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
    if model_spec in GEOMETRIES and not Path(model_spec).exists():
        return build_model(model_spec)
    if not (Path(model_spec) / "config.json").is_file():
        raise FileNotFoundError(f"--model {model_spec}: not a model directory (no config.json) "
                                f"nor a geometry name; pass the base model directory the "
                                f"adapter was trained on.")
    model, _ = load_model(Path(model_spec), lazy=lazy)
    return model


def resolve_base_model(model_spec: str | None, given: str | None = None,
                       warn: bool = True) -> str | None:
    """What PEFT's `base_model_name_or_path` records: `given` (--base-model-id), else a Hub id
    hinted by the model dir's config.json (`base_model`, `_name_or_path`), else the model's
    absolute local path (with a warning: PEFT then only finds the base model on this machine).
    """
    if given:
        return given
    if not model_spec:
        return None
    path = Path(model_spec)
    config_path = path / "config.json"
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text())
        except (OSError, ValueError):
            config = {}
        for key in HUB_ID_KEYS:
            hint = config.get(key) if isinstance(config, dict) else None
            if isinstance(hint, str) and HUB_ID.fullmatch(hint) and not Path(hint).exists():
                return hint
        recorded = str(path.resolve())
    else:
        recorded = model_spec  # a geometry name
    if warn:
        print(f"segback export: warning: the PEFT adapter_config.json records "
              f"base_model_name_or_path {recorded!r}, as no Hub id is known for the base model "
              f"(no --base-model-id, and no Hub id in {'/'.join(HUB_ID_KEYS)} of "
              f"{config_path}). Pass --base-model-id ORG/NAME so `PeftModel.from_pretrained` "
              f"finds the base model elsewhere.", file=sys.stderr)
    return recorded


def _write_peft(out: Path, weights: dict[str, mx.array], config: dict,
                kinds: dict[str, str] | None, base_model: str | None,
                n_layers: int | None) -> dict:
    tensors, peft_config = to_peft(weights, config, kinds, base_model, n_layers)
    save_safetensors_atomic(out / PEFT_WEIGHTS, tensors, metadata={"format": "pt"})
    atomic_write_json(out / CONFIG_FILE, peft_config)
    return peft_config


def _checked(model_spec: str | None, adapter: Path
             ) -> tuple[dict, dict[str, mx.array], nn.Module | None]:
    """(config, weights, base model with the adapter's layers attached) after every check."""
    config = read_config(adapter)
    weights = read_weights(adapter)
    check_weights(weights, config, adapter)
    model = None
    if model_spec:
        model = _load_base(model_spec)
        attach(model, config, adapter)
        check_fits(model, weights, config, adapter)
    return config, weights, model


def export_peft(model_spec: str | None, adapter: str | Path, out: str | Path,
                base_model_name: str | None = None) -> dict:
    """Write OUT/adapter_model.safetensors + OUT/adapter_config.json in PEFT's format."""
    config, weights, model = _checked(model_spec, Path(adapter))
    kinds = adapted_kinds(model) if model is not None else None
    n_layers = len(model.layers) if model is not None else None
    return _write_peft(Path(out), weights, config, kinds,
                       resolve_base_model(model_spec, base_model_name), n_layers)


def export_fused(model_dir: str, adapter: str | Path, out: str | Path,
                 dequantize: bool = False) -> None:
    """`mlx_lm.fuse`'s steps: load with the adapter, fuse each LoRA layer, save with mlx-lm."""
    if not Path(model_dir).is_dir():
        raise ValueError("--fuse needs --model to be a model directory (with a tokenizer)")
    model, tokenizer, config = load(model_dir, return_config=True)
    mount(model, adapter)
    model.eval()
    fused = [(n, m.fuse(dequantize=dequantize)) for n, m in model.named_modules()
             if hasattr(m, "fuse")]
    if fused:
        model.update_modules(tree_unflatten(fused))
    if dequantize:
        model = dequantize_model(model)
        config.pop("quantization", None)
        config.pop("quantization_config", None)
    with atomic_dir(out) as tmp:
        save(tmp, model_dir, model, tokenizer, config, donate_model=False)


def _check_out(out: Path) -> None:
    """OUT is replaced as a whole: refuse one that holds anything but an earlier export."""
    if out.is_dir():
        other = sorted(p.name for p in out.iterdir() if p.name not in OUT_PARTS)
        if other:
            raise FileExistsError(f"--out {out} exists and holds {', '.join(other[:3])}"
                                  f"{' ...' if len(other) > 3 else ''}, which is not an export "
                                  f"({'/'.join(OUT_PARTS)}): export replaces OUT as a whole, so "
                                  f"pass a new or empty directory.")
    elif out.exists():
        raise FileExistsError(f"--out {out} exists and is not a directory; pass a new or empty "
                              "directory.")


def export(model: str | None, adapter: str | Path, out: str | Path, fuse: bool = False,
           peft: bool = True, base_model_name: str | None = None,
           dequantize: bool = False, base_model_id: str | None = None) -> dict[str, Any]:
    """OUT/mlx (copy), OUT/peft (PEFT format), OUT/fused (optional); returns what was written.

    The adapter is checked first (readable, finite, rank as configured and, given `model`,
    fitting that model's modules and shapes); OUT is built in a scratch directory beside it and
    renamed into place at the end, so a failed export writes nothing.
    """
    adapter, out = Path(adapter), Path(out)
    if fuse and not model:
        raise ValueError("--fuse needs --model (the base model directory)")
    config, weights, base = _checked(model, adapter)
    _check_out(out)
    kinds = adapted_kinds(base) if base is not None and peft else None
    base_id = resolve_base_model(model, base_model_id or base_model_name) if peft else None
    done: dict[str, Any] = {"mlx": str(out / "mlx")}
    with atomic_dir(out) as tmp:
        (tmp / "mlx").mkdir()
        for f in (WEIGHTS_FILE, CONFIG_FILE):
            shutil.copy2(adapter / f, tmp / "mlx" / f)
        if peft:
            n_layers = len(base.layers) if base is not None else None
            done["peft_config"] = _write_peft(tmp / "peft", weights, config, kinds, base_id,
                                              n_layers)
            done["peft"] = str(out / "peft")
        if fuse:
            export_fused(model, adapter, tmp / "fused", dequantize)
            done["fused"] = str(out / "fused")
    return done


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="base model dir (or geometry name, no --fuse)")
    p.add_argument("--adapter", required=True, help="mlx-lm adapter dir (segback train output)")
    p.add_argument("--out", required=True,
                   help="writes OUT/mlx, OUT/peft, OUT/fused (OUT is replaced as a whole)")
    p.add_argument("--fuse", action="store_true", help="also write a fused model (mlx_lm.fuse)")
    p.add_argument("--dequantize", action="store_true", help="fused model in full precision")
    p.add_argument("--no-peft", dest="peft", action="store_false", help="skip the PEFT copy")
    p.add_argument("--base-model-id", "--base-model-name", dest="base_model_id", default=None,
                   help="Hub id of the base model, recorded as PEFT's base_model_name_or_path "
                        "(default: a Hub id in --model's config.json `base_model` or "
                        "`_name_or_path`, else --model's absolute path, with a warning)")


def main(args: argparse.Namespace) -> int:
    try:
        done = export(args.model, args.adapter, args.out, fuse=args.fuse, peft=args.peft,
                      base_model_id=args.base_model_id, dequantize=args.dequantize)
    except (OSError, ValueError, NotImplementedError) as e:
        print(f"segback export: error: {e}", file=sys.stderr)
        return 2
    for k in ("mlx", "peft", "fused"):
        if k in done:
            print(f"segback export: {k} -> {done[k]}", file=sys.stderr)
    return 0
