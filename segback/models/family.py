"""Which model families segback can segment, decided from config.json before any weights load.

The engine runs a range of an mlx-lm model's decoder layers through a per-family adapter
(segback.engine.stack); the planner counts a layer's attention and dense MLP. A family without an
adapter, or with layers neither knows (mixture-of-experts routing, state-space or linear-attention
mixers), is refused here with its name and the list of what is supported, instead of failing deep
inside a step (or planning a wrong peak) after minutes of loading weights.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from mlx_lm.utils import MODEL_REMAPPING

from segback.engine.stack import SUPPORTED_TYPES, WRAPPER_TYPES

# config.json keys that mean routed experts (mixtral, qwen*_moe, deepseek, gemma4's MoE block...).
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size",
            "num_experts_per_tok", "enable_moe_block")
# model_type fragments of families whose layers are not all attention + MLP.
HYBRID_TYPES = ("mamba", "jamba", "hybrid", "falcon_h1", "qwen3_next", "lfm2", "recurrent",
                "rwkv", "ssm", "plamo2", "nemotron_h")


class UnsupportedModelError(ValueError):
    """A model family segback cannot segment (one line: the family, and what is supported)."""


def supported() -> str:
    """The families segback segments, as users name them (model_type of config.json)."""
    return ", ".join(SUPPORTED_TYPES)


def text_config(config: dict) -> dict:
    """The text model's config: a multimodal wrapper's `text_config`, else the config itself."""
    if config.get("model_type") in WRAPPER_TYPES and isinstance(config.get("text_config"), dict):
        return {"model_type": f"{config['model_type']}_text", **config["text_config"]}
    return config


def _moe(config: dict) -> bool:
    def on(v) -> bool:
        return bool(v) and v not in (0, 1)  # one expert (or a flag set false) is dense

    return "moe" in str(config.get("model_type", "")) or config.get("enable_moe_block") is True \
        or any(on(config.get(k)) for k in MOE_KEYS if k != "enable_moe_block")


def unsupported_reason(config: dict) -> str | None:
    """Why segback cannot segment a model of this config, or None if it can."""
    text = text_config(config)
    model_type = str(text.get("model_type") or "")
    if _moe(text) or _moe(config):
        return "its layers are mixture-of-experts (routed experts)"
    if any(h in model_type for h in HYBRID_TYPES):
        return "it is a hybrid of attention and state-space / linear-attention layers"
    if not model_type:
        return "config.json has no model_type"
    if model_type not in SUPPORTED_TYPES:
        known = importlib.util.find_spec(
            f"mlx_lm.models.{MODEL_REMAPPING.get(model_type, model_type)}") is not None
        return ("segback has no layer-stack adapter for it" if known
                else "mlx-lm does not know this architecture either")
    return None


def check_family(config: dict, where: str | Path = "the model") -> None:
    """Raise UnsupportedModelError naming the family and what is supported, if segback cannot
    segment a model of this config."""
    reason = unsupported_reason(config)
    if reason is None:
        return
    family = config.get("model_type")
    inner = text_config(config).get("model_type")
    named = f"{family!r}" + (f" ({inner!r})" if inner != family else "")
    raise UnsupportedModelError(
        f"segback cannot segment {where}: model type {named}: {reason}. Supported families "
        f"(config.json model_type, dense layers): {supported()}")


def check_checkpoint(path: str | Path) -> None:
    """check_family on a checkpoint directory's config.json (no weights are read)."""
    path = Path(path)
    try:
        config = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise UnsupportedModelError(f"{path / 'config.json'} is not valid JSON ({e}): fix or "
                                    "re-download the checkpoint") from None
    if not isinstance(config, dict):
        raise UnsupportedModelError(f"{path / 'config.json'} is not a JSON object: fix or "
                                    "re-download the checkpoint")
    check_family(config, str(path))
