"""The model's geometry as the planner sees it: per-layer widths, attention kinds, donors
and sharers, weight and LoRA bytes; read from an mlx-lm model, a config, a geometry name or a
checkpoint directory without materializing weights."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model

from segback.engine.host_table import table_bytes
from segback.engine.stack import WRAPPER_TYPES
from segback.models.family import check_checkpoint, check_family
from segback.models.random_init import GEOMETRIES, build_model, geometry_config

GB = 1024**3  # as segback.engine.memory


DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass
class LayerGeom:
    """What one decoder layer costs, per token, in compute-dtype elements or FLOPs."""

    kind: str
    window: int | None
    heads: int
    head_dim: int
    kv_width: int  # K (= V) width of the K/V this layer attends to (own or shared)
    kv_source: int
    act_elems: int  # activations kept for the backward, elements per token
    bwd_elems: int  # cotangents alive during this layer's backward, elements per token
    linear_flops: float  # forward FLOPs per token of its linear layers (incl. LoRA)
    weight_bytes: int
    bits: int | None
    lora_params: int
    q_width: int = 0  # query projection width (heads x head_dim)
    kv_own: int = 0  # width of this layer's own K (= V) projection; 0 for a KV sharer
    qkv_flops: float = 0.0  # forward FLOPs per token of the q/k/v projections (incl. LoRA)
    inter: int = 0  # MLP intermediate width (gate/up outputs)
    mlp_flops: float = 0.0  # forward FLOPs per token of the MLP's linears (incl. LoRA)


@dataclass
class Geometry:
    model_id: str
    model_type: str
    hidden: int
    vocab: int
    softcap: bool
    dtype: str
    dtype_bytes: int
    layers: list[LayerGeom]
    per_layer_width: int  # Gemma-4 per-layer input elements per token (all layers), else 0
    weight_bytes: int
    lora_params: int
    quant_bits: list[int] = field(default_factory=list)
    table_bytes: int = 0  # of weight_bytes: the per-layer embedding table offload parks

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def sharers(self) -> dict[int, list[int]]:
        """Donor layer -> the later layers that attend to its K/V."""
        out: dict[int, list[int]] = {}
        for i, g in enumerate(self.layers):
            if g.kv_source != i:
                out.setdefault(g.kv_source, []).append(i)
        return out


def text_parts(model: nn.Module) -> tuple[nn.Module, Any]:
    """The causal LM (gemma3 and gemma4 keep it under `language_model`) and its args."""
    outer = model.language_model if getattr(model, "model_type", None) in WRAPPER_TYPES \
        else model
    return outer, outer.args


def linears(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, linear) for every linear in `module`, looking through LoRA wrappers."""
    out = []
    for path, m in module.named_modules():
        if isinstance(m, (nn.Linear, nn.QuantizedLinear)) and not path.endswith(".linear"):
            out.append((path, m))
        elif hasattr(m, "lora_a") and hasattr(m, "linear"):
            out.append((path, m.linear))
    return out


def _linear_dims(m: nn.Module) -> tuple[int, int, int | None]:
    """(in, out, bits) of a (quantized) linear, from its stored weight."""
    out_dims, stored = m.weight.shape
    if isinstance(m, nn.QuantizedLinear):
        return stored * 32 // m.bits, out_dims, m.bits
    return stored, out_dims, None


def _layer_types(args: Any, n: int) -> list[str]:
    if getattr(args, "layer_types", None):
        return [FULL if t == FULL else SLIDING for t in args.layer_types[:n]]
    pattern = getattr(args, "sliding_window_pattern", None)
    if getattr(args, "model_type", "") == "gemma3_text" and pattern:
        return [FULL if i % pattern == pattern - 1 else SLIDING for i in range(n)]
    return [FULL] * n


def _act_elems(layer: nn.Module, hidden: int, q: int, kv_own: int, inter: int, ple: int) -> int:
    """Activations a layer keeps for its backward, per token (elements).

    Counted: the layer input and each norm's input (hidden), each linear's output and LoRA's
    input (q, o, MLP gate/up/act/product), rope'd and normed Q/K/V, the attention output and its
    transposed copy, and the Gemma-4 per-layer-input gate (gate, gelu, product, projection).
    """
    norms = sum(1 for p, m in layer.named_modules()
                if "self_attn" not in p and "mlp" not in p
                and isinstance(m, (nn.RMSNorm, nn.LayerNorm)))
    head_norms = sum(1 for n in ("q_norm", "k_norm", "v_norm")
                     if hasattr(getattr(layer, "self_attn", None), n))
    attn = 4 * q + 3 * kv_own + head_norms * (q + kv_own) // 2
    mlp = 4 * inter
    residual = hidden * (3 + 2 * norms)
    extra = (3 * ple + 3 * hidden) if ple else 0
    return residual + attn + mlp + extra


def _bwd_elems(hidden: int, inter: int) -> int:
    """Cotangents alive while one layer runs its backward, per token (elements): those of the
    MLP's gate/up/product and a few hidden-sized ones; fitted on CPU layers (1.3-1.5x 3I+6d)."""
    return 4 * inter + 8 * hidden


def _lora_params(layer: nn.Module, rank: int, add_lora: bool) -> int:
    """Trainable elements of a layer: what is attached, or `rank` on every linear if `add_lora`."""
    if not add_lora:
        return sum(v.size for _, v in tree_flatten(layer.trainable_parameters()))
    return sum(rank * (i + o) for i, o, _ in (_linear_dims(m) for _, m in linears(layer)))


def read_geometry(
    model: nn.Module,
    lora_rank: int = 8,
    lora_layers: int | None = None,
    dtype: mx.Dtype | str | None = None,
    model_id: str = "model",
) -> Geometry:
    """Read everything the cost model needs from an mlx-lm model (lazy weights are fine)."""
    outer, args = text_parts(model)
    inner = outer.model
    layers = list(inner.layers)
    n = len(layers)
    hidden = args.hidden_size
    if isinstance(dtype, str):
        dtype = DTYPES[dtype]
    if dtype is None:  # the embedding's output dtype is the hidden state's
        emb = inner.embed_tokens
        dtype = emb.scales.dtype if isinstance(emb, nn.QuantizedEmbedding) else emb.weight.dtype
    types = _layer_types(args, n)
    window = getattr(args, "sliding_window", None)
    kv_source = list(getattr(inner, "previous_kvs", range(n)))
    ple_width = getattr(args, "hidden_size_per_layer_input", 0) or 0
    has_ple = bool(ple_width) and getattr(inner, "embed_tokens_per_layer", None) is not None
    n_lora = n if lora_layers is None else max(0, min(lora_layers, n))
    attached = any(v.size for _, v in tree_flatten(model.trainable_parameters()))

    # K/V width of each layer's own K/V (sharers read their donor's).
    own_kv: dict[int, int] = {}
    q_widths, head_dims, heads = [], [], []
    for i, layer in enumerate(layers):
        dims = {p.rsplit(".", 1)[-1]: _linear_dims(m) for p, m in linears(layer.self_attn)}
        q = dims["q_proj"][1]
        nh = getattr(layer.self_attn, "n_heads", None) or args.num_attention_heads
        hd = q // nh
        q_widths.append(q)
        heads.append(nh)
        head_dims.append(hd)
        if "k_proj" in dims:
            own_kv[i] = dims["k_proj"][1]

    geoms, bits_seen = [], []
    for i, layer in enumerate(layers):
        lin = [_linear_dims(m) for _, m in linears(layer)]
        qkv = [_linear_dims(m) for p, m in linears(layer.self_attn)
               if p.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj")]
        mlp_dims = {p.rsplit(".", 1)[-1]: _linear_dims(m) for p, m in linears(layer.mlp)} \
            if hasattr(layer, "mlp") else {}
        inter = (mlp_dims.get("gate_proj") or mlp_dims.get("up_proj") or (0, 0, None))[1]
        kv_w = own_kv.get(kv_source[i], own_kv.get(i, q_widths[i]))
        lora = _lora_params(layer, lora_rank, not attached and i >= n - n_lora)
        bits = sorted({b for _, _, b in lin if b})
        bits_seen += bits
        geoms.append(LayerGeom(
            kind=types[i],
            window=window if types[i] == SLIDING else None,
            heads=heads[i],
            head_dim=head_dims[i],
            kv_width=kv_w,
            kv_source=kv_source[i],
            act_elems=_act_elems(layer, hidden, q_widths[i], own_kv.get(i, 0), inter,
                                 ple_width if has_ple else 0),
            bwd_elems=_bwd_elems(hidden, inter),
            linear_flops=2.0 * (sum(a * b for a, b, _ in lin) + lora),
            weight_bytes=sum(v.nbytes for _, v in tree_flatten(layer.parameters())),
            bits=max(bits) if bits else None,
            lora_params=lora,
            q_width=q_widths[i],
            kv_own=own_kv.get(i, 0),
            qkv_flops=2.0 * sum(a * b + (lora_rank * (a + b) if lora else 0) for a, b, _ in qkv),
            inter=inter,
            mlp_flops=2.0 * sum(a * b + (lora_rank * (a + b) if lora else 0)
                                for a, b, _ in mlp_dims.values()),
        ))

    all_bytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    lora_total = sum(g.lora_params for g in geoms)
    if not attached:
        all_bytes += lora_total * 4  # LoRA factors are float32 in mlx-lm
    return Geometry(
        model_id=model_id,
        model_type=getattr(args, "model_type", "?"),
        hidden=hidden,
        vocab=args.vocab_size,
        softcap=bool(getattr(args, "final_logit_softcapping", None)),
        dtype=str(dtype).split(".")[-1],
        dtype_bytes=dtype.size,
        layers=geoms,
        per_layer_width=n * ple_width if has_ple else 0,
        weight_bytes=all_bytes,
        lora_params=lora_total,
        quant_bits=sorted(set(bits_seen)),
        table_bytes=table_bytes(model),
    )


def lazy_model(config: dict, dtype: mx.Dtype = mx.bfloat16, quant_bits: int | None = None,
               group_size: int = 64) -> nn.Module:
    """An mlx-lm model from a config dict whose weights are never materialized (frozen: the
    planner counts rank-r LoRA on every linear, not the base weights, as trainable)."""
    model = build_model(config, dtype=dtype, quantize_bits=quant_bits, group_size=group_size,
                        materialize=False)
    model.freeze()
    return model


def resolve_model(
    model_or_config: nn.Module | dict | str, dtype: str | None, quant_bits: int | None
) -> tuple[nn.Module, str]:
    """A model (lazy when read from a config, geometry name or checkpoint dir) and its id."""
    if isinstance(model_or_config, nn.Module):
        return model_or_config, type(model_or_config).__module__.rsplit(".", 1)[-1]
    dt = DTYPES[dtype or "bfloat16"]
    if isinstance(model_or_config, dict):
        check_family(model_or_config, "the config")
        return lazy_model(model_or_config, dt, quant_bits), model_or_config["model_type"]
    path = Path(model_or_config)
    if path.is_dir():
        check_checkpoint(path)
        model, _ = load_model(path, lazy=True, strict=False)
        model.freeze()  # a base checkpoint: LoRA is what will train
        return model, str(model_or_config)
    if str(model_or_config) not in GEOMETRIES:
        raise ValueError(f"model {str(model_or_config)!r} is neither an MLX checkpoint directory "
                         f"nor a geometry name ({', '.join(sorted(GEOMETRIES))})")
    return lazy_model(geometry_config(str(model_or_config)), dt, quant_bits), str(model_or_config)
