"""Named random-init model geometries built from mlx-lm's own model classes.

Tests use the tiny ones (seconds on CPU); memory benchmarks use the real e4b geometry with random
weights, which needs no download.
"""

from __future__ import annotations

import copy

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map
from mlx_lm.utils import _get_classes

_E4B_TYPES = (["sliding_attention"] * 5 + ["full_attention"]) * 7

GEOMETRIES: dict[str, dict] = {
    "tiny-llama": dict(
        model_type="llama", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256,
        tie_word_embeddings=False,
    ),
    "tiny-qwen3": dict(
        model_type="qwen3", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
        vocab_size=256, rope_theta=10000.0, max_position_embeddings=4096,
        tie_word_embeddings=True,
    ),
    "tiny-qwen2": dict(
        model_type="qwen2", hidden_size=64, num_hidden_layers=3, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=256,
        rope_theta=10000.0, tie_word_embeddings=True,
    ),
    "tiny-mistral": dict(
        model_type="mistral", hidden_size=64, num_hidden_layers=3, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256,
        tie_word_embeddings=False,
    ),
    "tiny-minicpm": dict(
        model_type="minicpm", hidden_size=64, num_hidden_layers=3, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256,
        dim_model_base=32, scale_depth=1.4, scale_emb=12.0, max_position_embeddings=4096,
        rope_theta=10000.0, tie_word_embeddings=True,
    ),
    "tiny-gemma3": dict(
        model_type="gemma3_text", hidden_size=64, num_hidden_layers=6, intermediate_size=128,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, rms_norm_eps=1e-6,
        vocab_size=256, query_pre_attn_scalar=32, sliding_window=8, sliding_window_pattern=3,
        rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
    ),
    # Same structure as e4b: 5 sliding + 1 full, KV sharing with a sliding and a full donor,
    # per-layer inputs, logit softcap; small enough for CPU tests.
    "tiny-e4b": dict(
        model_type="gemma4_text", hidden_size=64, num_hidden_layers=12, intermediate_size=128,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, global_head_dim=32,
        rms_norm_eps=1e-6, vocab_size=256, vocab_size_per_layer_input=256,
        num_kv_shared_layers=4, hidden_size_per_layer_input=8, sliding_window=16,
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 2,
        final_logit_softcapping=30.0, tie_word_embeddings=True,
    ),
    # e4b's depth and layer pattern (42 layers, 18 sharing K/V) at tiny-e4b's widths: the host
    # time of building a step's graphs grows with the layers and tiles, not the widths, so this
    # shows e4b's on a CPU (bench/step_profile.py).
    "tiny-e4b-42": dict(
        model_type="gemma4_text", hidden_size=64, num_hidden_layers=42, intermediate_size=128,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, global_head_dim=32,
        rms_norm_eps=1e-6, vocab_size=256, vocab_size_per_layer_input=256,
        num_kv_shared_layers=18, hidden_size_per_layer_input=8, sliding_window=16,
        layer_types=_E4B_TYPES, final_logit_softcapping=30.0, tie_word_embeddings=True,
    ),
    # Gemma-4 e4b (mlx-community/gemma-4-e4b-it-4bit) text geometry, for memory benchmarks.
    "e4b": dict(
        model_type="gemma4_text", hidden_size=2560, num_hidden_layers=42,
        intermediate_size=10240, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
        global_head_dim=512, rms_norm_eps=1e-6, vocab_size=262144,
        vocab_size_per_layer_input=262144, num_kv_shared_layers=18,
        hidden_size_per_layer_input=256, sliding_window=512, layer_types=_E4B_TYPES,
        final_logit_softcapping=30.0, tie_word_embeddings=True,
    ),
    # Six layers of e4b at full width (MLP 10240, 20480 on the two KV-sharing layers, which read
    # donors 2 and 3), with a small vocabulary: where a layer's token-wise activations dominate,
    # for CPU benchmarks of the tiled engine.
    "e4b-slice": dict(
        model_type="gemma4_text", hidden_size=2560, num_hidden_layers=6,
        intermediate_size=10240, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
        global_head_dim=512, rms_norm_eps=1e-6, vocab_size=16384,
        vocab_size_per_layer_input=16384, num_kv_shared_layers=2,
        hidden_size_per_layer_input=256, sliding_window=512,
        layer_types=["sliding_attention"] * 3 + ["full_attention", "sliding_attention",
                                                 "full_attention"],
        final_logit_softcapping=30.0, tie_word_embeddings=True,
    ),
    # A small dense model with a real-sized vocabulary, for CPU benchmarks in minutes.
    "dense-256": dict(
        model_type="llama", hidden_size=256, num_hidden_layers=8, intermediate_size=768,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=32000,
        tie_word_embeddings=False,
    ),
    # The dense model of the early CPU measurements (docs/performance.md, "Early measurements":
    # 16-layer llama, hidden 512, vocab 8192).
    "dense-512": dict(
        model_type="llama", hidden_size=512, num_hidden_layers=16, intermediate_size=1536,
        num_attention_heads=8, num_key_value_heads=4, rms_norm_eps=1e-5, vocab_size=8192,
        tie_word_embeddings=False,
    ),
}

# The families people fine-tune, at their real sizes (the text configs of their config.json;
# random weights, quantized as `--quant-bits 4` asks): benchmarks and plans of real geometries.
# Each has a `tiny-` twin (`tiny_widths`): its depth, layer pattern and RoPE at tiny widths.
REAL: dict[str, dict] = {
    # meta-llama/Llama-3.1-8B: llama3 RoPE scaling to 128K.
    "llama-3.1-8b": dict(
        model_type="llama", hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
        vocab_size=128256, rope_theta=500000.0, max_position_embeddings=131072,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=8192),
        tie_word_embeddings=False,
    ),
    # mistralai/Mistral-7B-v0.3: full attention everywhere (sliding_window null).
    "mistral-7b-v0.3": dict(
        model_type="mistral", hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
        vocab_size=32768, rope_theta=1_000_000.0, max_position_embeddings=32768,
        tie_word_embeddings=False,
    ),
    # google/gemma-3-12b-pt's text_config: 5 sliding (window 1024) + 1 full, global RoPE
    # scaled linearly by 8; the head is the tied embedding.
    "gemma-3-12b": dict(
        model_type="gemma3_text", hidden_size=3840, num_hidden_layers=48,
        intermediate_size=15360, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
        rms_norm_eps=1e-6, vocab_size=262208, query_pre_attn_scalar=256, sliding_window=1024,
        sliding_window_pattern=6, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
        rope_scaling=dict(rope_type="linear", factor=8.0), max_position_embeddings=131072,
        tie_word_embeddings=True,
    ),
}


def tiny_widths(config: dict) -> dict:
    """A real geometry at tiny widths (hidden 64, 16-wide heads, vocab 256, window 16): the same
    mlx-lm class, depth, query/KV head ratio, layer pattern and RoPE, built in milliseconds."""
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    q = min(heads // kv, 4)  # query heads per KV head, as the real model (at most 4)
    tiny = dict(config, hidden_size=64, intermediate_size=128, num_attention_heads=q,
                num_key_value_heads=1, head_dim=16, vocab_size=256)
    if "sliding_window" in config:
        tiny["sliding_window"] = 16
    if "query_pre_attn_scalar" in config:  # its ratio to head_dim, as the real model's
        tiny["query_pre_attn_scalar"] = 16 * config["query_pre_attn_scalar"] / config["head_dim"]
    return tiny


GEOMETRIES.update(REAL)
GEOMETRIES.update({f"tiny-{name}": tiny_widths(cfg) for name, cfg in REAL.items()})


def geometry_config(name: str, **overrides) -> dict:
    """Return a copy of a named geometry's config, with overrides applied."""
    if name not in GEOMETRIES:
        raise ValueError(f"unknown geometry {name!r}; known: {', '.join(sorted(GEOMETRIES))}")
    cfg = copy.deepcopy(GEOMETRIES[name])
    cfg.update(overrides)
    return cfg


# Text model types whose checkpoints ship inside a multimodal wrapper (text under
# `language_model`): Gemma-4 e4b as `gemma4`, Gemma-3 4B-27B as `gemma3`.
WRAPPERS = {"gemma4_text": "gemma4", "gemma3_text": "gemma3"}


def wrap_multimodal(cfg: dict) -> dict:
    """Wrap a gemma4_text / gemma3_text config in its multimodal model type, as the real
    checkpoints ship (e4b as `gemma4`, Gemma-3-12B as `gemma3`)."""
    text = dict(cfg)
    return {"model_type": WRAPPERS[text["model_type"]], "vocab_size": text["vocab_size"],
            "text_config": text}


def build_model(
    config: dict | str,
    seed: int = 0,
    dtype: mx.Dtype = mx.float32,
    quantize_bits: int | None = None,
    group_size: int = 64,
    materialize: bool = True,
) -> nn.Module:
    """Instantiate an mlx-lm model from a config dict (or geometry name) with random weights.

    With `materialize=False` nothing is evaluated: MLX is lazy, so the init, cast and
    quantization stay graph nodes and shapes/bytes are known without allocating the weights.
    """
    cfg = geometry_config(config) if isinstance(config, str) else copy.deepcopy(config)
    model_class, args_class = _get_classes(cfg)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(cfg))
    text = getattr(model, "language_model", model)
    if cfg.get("text_config", cfg).get("tie_word_embeddings") and "lm_head" in text \
            and getattr(text, "tie_word_embeddings", None) is False:
        text.sanitize({})  # gemma3_text ties as mlx-lm loads a checkpoint without a head
    model.update(tree_map(lambda p: p.astype(dtype) if mx.issubdtype(p.dtype, mx.floating)
                          else p, model.parameters()))
    if quantize_bits:
        nn.quantize(model, group_size=group_size, bits=quantize_bits,
                    class_predicate=lambda _, m: hasattr(m, "to_quantized")
                    and m.weight.shape[-1] % group_size == 0)
    if materialize:
        mx.eval(model.parameters())
    return model


def parameter_bytes(model: nn.Module) -> int:
    """Total bytes of a model's parameters (quantized weights counted as stored)."""
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))
