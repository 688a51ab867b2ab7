"""Segment planner: choose the layer ranges of a segmented backward from the model's geometry.

Peak memory of one training step (segback.engine.value_and_grad + AdamW) is modelled as a
sequence of events, each adding its transient to what is alive at that moment:

    resting   = weights + LoRA params, grads and AdamW state (float32, 2x); with offload
                less Gemma-4's per-layer embedding table (host memory)
    constants = per-layer inputs (Gemma-4) + materialized [L, L] masks + saved donor K/V
    embed     = prologue: building h0 and the per-layer inputs
    head      = every hidden boundary + the final hidden + dh + one chunk of logits
    segment k = hidden boundaries 0..k + dh + donor K/V cotangents still pending
                + the segment's recomputed activations (+ attention scores) + h_out, dh_in
    peak      = resting + constants + max(events)

The engine frees a boundary once its segment's backward is done, so early segments see fewer
boundaries. Time is counted in FLOPs: the engine recomputes every layer's forward once, and each
segment adds a small fixed overhead. The search is an O(N^3) min-max DP over contiguous cuts for
every segment count, with a branch per choice of which Gemma-4 donors stay uncut from their
sharers (no saved K/V). `--calibrate` scales the analytic activation and attention sizes by a
fit to a 1-layer and a 2-layer segment of the real model, measured at two lengths.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import sys
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from segback.engine import offload as offload_module
from segback.engine.host_table import table_bytes
from segback.engine.offload import MAX_PENDING

GB = 1024**3  # as segback.engine.memory
SCHEMA_PATH = Path(__file__).resolve().parent.parent / "workflow" / "schemas" / "plan.schema.json"

# Fused attention (mx.fast.scaled_dot_product_attention under grad tracing runs MLX's composed
# fallback on every backend) in units of one [B, H, L, L] array in the compute dtype: each layer
# of a segment keeps ~0.8 copy until its backward, and one layer's backward adds ~2.4 (scores,
# dP, dS). Fitted on CPU llama and gemma4 layers, 1-3 per segment; a lone sdpa on the H200
# (DESIGN.md, 3.6 GB at 8K, 8 heads, bf16) is 3.4 in all.
FUSED_RETAINED_COPIES = 0.8
FUSED_TRANSIENT_COPIES = 2.4
# Chunked attention (segback.engine.attention): the backward keeps ~4 float32 [B, H, chunk,
# visible] arrays per chunk, plus float32 dK/dV and dQ over the whole sequence.
CHUNKED_SCORE_COPIES = 4.0
# Loss head: a chunk of logits is held ~4.5 times (logits, log-softmax, grads), ~6.5 with a
# logit softcap (tanh and its derivative), measured on CPU in float32 and bfloat16.
HEAD_COPIES, SOFTCAP_COPIES = 4.5, 2.0
HEAD_MAX_ELEMENTS = 1 << 26  # segback.engine.head.DEFAULT_MAX_ELEMENTS
# Per-segment fixed cost (graph build, evals, boundary copies) as a fraction of a step; a rough
# figure: at long L the recompute forward dominates and this barely moves the ratio.
SEGMENT_OVERHEAD = 0.003
# Backward/forward FLOP ratios: a frozen linear only needs dX (1x), attention needs dQ, dK, dV
# and dP (2x) and chunked attention also recomputes its probabilities (3x).
BWD_LINEAR, BWD_ATTN_FUSED, BWD_ATTN_CHUNKED = 1.0, 2.0, 3.0
# Ties within this fraction of the minimum peak go to fewer segments (faster, better fusion).
TIE_FRACTION = 0.005
# Tile sizes (tokens) `--tile auto` weighs, largest (fastest) first.
TILE_SIZES = (4096, 2048, 1024, 512, 256)
CALIBRATION_LENGTHS = (512, 1024)

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
FULL, SLIDING = "full_attention", "sliding_attention"


# --------------------------------------------------------------------------------------------
# Geometry read from the model


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


def _text_parts(model: nn.Module) -> tuple[nn.Module, Any]:
    """The causal LM (gemma4 keeps it under `language_model`) and its args."""
    outer = model.language_model if getattr(model, "model_type", None) == "gemma4" else model
    return outer, outer.args


def _linears(module: nn.Module) -> list[tuple[str, nn.Module]]:
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
    return sum(rank * (i + o) for i, o, _ in (_linear_dims(m) for _, m in _linears(layer)))


def read_geometry(
    model: nn.Module,
    lora_rank: int = 8,
    lora_layers: int | None = None,
    dtype: mx.Dtype | str | None = None,
    model_id: str = "model",
) -> Geometry:
    """Read everything the cost model needs from an mlx-lm model (lazy weights are fine)."""
    outer, args = _text_parts(model)
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
        dims = {p.rsplit(".", 1)[-1]: _linear_dims(m) for p, m in _linears(layer.self_attn)}
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
        lin = [_linear_dims(m) for _, m in _linears(layer)]
        qkv = [_linear_dims(m) for p, m in _linears(layer.self_attn)
               if p.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj")]
        mlp_dims = {p.rsplit(".", 1)[-1]: _linear_dims(m) for p, m in _linears(layer.mlp)} \
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
    from segback.models.geometry import build_model

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
        return lazy_model(model_or_config, dt, quant_bits), model_or_config["model_type"]
    path = Path(model_or_config)
    if path.is_dir():
        from mlx_lm.utils import load_model

        model, _ = load_model(path, lazy=True, strict=False)
        model.freeze()  # a base checkpoint: LoRA is what will train
        return model, str(model_or_config)
    from segback.models.geometry import GEOMETRIES, geometry_config

    if str(model_or_config) not in GEOMETRIES:
        raise ValueError(f"model {str(model_or_config)!r} is neither an MLX checkpoint directory "
                         f"nor a geometry name ({', '.join(sorted(GEOMETRIES))})")
    return lazy_model(geometry_config(str(model_or_config)), dt, quant_bits), str(model_or_config)


# --------------------------------------------------------------------------------------------
# Cost model


@dataclass
class Coefficients:
    """Multipliers on the analytic sizes (1.0 = uncalibrated): activations (kept ones and one
    layer's backward cotangents), the attention scores each layer keeps until its backward, and
    the scores one layer's backward adds."""

    activation: float = 1.0
    attention: float = 1.0
    attention_transient: float = 1.0
    calibrated: bool = False
    lengths: list[int] = field(default_factory=list)
    segments: list[list[int]] = field(default_factory=list)
    measured_gb: list[list[float]] = field(default_factory=list)  # [segment][length]


def _chunk_size(B: int, H: int, L: int, window: int | None) -> int:
    """The query chunk segback.engine.attention picks for this shape."""
    from segback.engine.attention import default_chunk_size

    return default_chunk_size(B, H, L, L, window)


class CostModel:
    """Bytes and FLOPs of every piece of a segmented step for one (geometry, L, B, attention).

    With `tile` (tokens), the step is the sequence-tiled engine's (segback.engine.tiled): every
    layer runs its token-wise parts a tile at a time, attention is chunked, a segment keeps only
    its input boundary (and recomputes those inside it in its backward), every Gemma-4 donor's
    K/V is kept, and with `offload` the boundaries and per-layer inputs live in host memory.
    """

    def __init__(self, geom: Geometry, seq_len: int, batch_size: int = 1,
                 attention: str = "fused", coef: Coefficients | None = None,
                 tile: int | None = None, offload: bool = False,
                 light_tile: int | None = None, offload_keep: int = 0):
        if attention not in ("fused", "chunked"):
            raise ValueError(f"attention must be 'fused' or 'chunked', not {attention!r}")
        if tile is not None and tile < 1:
            raise ValueError(f"tile must be a positive number of tokens, not {tile}")
        if offload and not tile:
            raise ValueError("offload needs a tile size: it is part of the tiled engine")
        if (light_tile and not tile) or (offload_keep and not offload):
            raise ValueError("light_tile needs a tile size and offload_keep needs offload")
        if tile:
            attention = "chunked"  # the tiled engine always runs chunked attention
        self.g, self.L, self.B, self.attention = geom, seq_len, batch_size, attention
        self.tile, self.offload = (min(int(tile), seq_len) if tile else None), bool(offload)
        self.light = min(int(light_tile or tile), seq_len) if tile else None
        self.offload_keep = int(offload_keep)
        self.prefetch = self.offload and offload_module.PREFETCH
        self.coef = coef or Coefficients()
        s, L, B = geom.dtype_bytes, seq_len, batch_size
        self.hidden_bytes = B * L * geom.hidden * s  # one [B, L, hidden] boundary
        layers = geom.layers
        if self.tile:
            self.act = np.array([self._tiled_layer(g) for g in layers], float)
            self.bwd = np.zeros(len(layers))
        else:
            self.act = np.array([B * L * g.act_elems * s for g in layers], float)
            self.bwd = np.array([B * L * g.bwd_elems * s for g in layers], float)
        ret, trans = zip(*(self._attention(g) for g in layers))
        self.attn_retained, self.attn_transient = np.array(ret), np.array(trans)
        self.kv_bytes = {d: 2 * B * L * layers[d].kv_width * s for d in geom.sharers()}
        # A stored segment boundary on the device, and what a segment's backward always holds
        # besides its transient: its own input boundary and dh (untiled), or only dh (tiled:
        # the segment's inputs are part of its transient).
        self.boundary_bytes = 0.0 if self.offload else float(self.hidden_bytes)
        self.fixed_bytes = float(self.hidden_bytes if self.tile else 2 * self.hidden_bytes)
        if self.prefetch:  # the next segment's boundary, fetched back while this one runs
            self.fixed_bytes += self.hidden_bytes

    def _pre_elems(self, g: LayerGeom) -> int:
        """Elements per token of the pre pass's VJP on one light tile: its input, norm and
        projections (Q, own K/V, before and after norms and RoPE) and their cotangents."""
        return 2 * (3 * self.g.hidden + 3 * (g.q_width + 2 * g.kv_own))

    def whole_sequence_bytes(self, g: LayerGeom) -> float:
        """What a tiled layer's backward holds over the whole sequence (bench/
        tiled_layer_memory.py measures it): Q, dO, dQ, the own K, V, float32 dK/dV, their
        update copies and casts, rowsum(dO * O) and the post pass's dh."""
        s = self.g.dtype_bytes
        return float(self.B * self.L * (3 * g.q_width * s + 2 * g.kv_own * s
                                         + 2 * g.kv_width * (8 + s) + g.heads * 4)
                     + self.hidden_bytes)

    def _tiled_layer(self, g: LayerGeom) -> float:
        """One tiled layer's backward, bytes: Q, dO, dQ and the own K, V over the whole sequence,
        float32 dK/dV accumulators, their update copies and casts, rowsum(dO * O), dh_in, one
        tile's activations and cotangents (the post pass's on a tile, or the pre pass's on a
        light tile), and (offload) the layer's per-layer input fetched back."""
        s, L, B = self.g.dtype_bytes, self.L, self.B
        whole = self.whole_sequence_bytes(g)
        tile = self.coef.activation * B * self.tile * (g.act_elems + g.bwd_elems) * s
        light = self.coef.activation * B * self.light * self._pre_elems(g) * s
        pli = B * L * self.g.per_layer_width // max(1, self.g.num_layers) * s
        # offload: this layer's per-layer input fetched back (and the next one's, prefetching)
        fetched = (2 if self.prefetch else 1) * pli if self.offload else 0
        return float(whole + max(tile, light) + fetched)

    def forward_bytes(self) -> float:
        """The tiled forward's worst layer, bytes: Q, K, V, O over the whole sequence and its
        output, one light tile of the post pass (at most its kept activations: nothing is
        kept, so this bounds what is alive) or the attention forward's scores."""
        s, L, B = self.g.dtype_bytes, self.L, self.B
        worst = 0.0
        for g, attn in zip(self.g.layers, self.attn_transient):
            whole = B * L * (2 * g.q_width + 2 * g.kv_own) * s + self.hidden_bytes
            light = self.coef.activation * B * self.light * g.act_elems * s
            worst = max(worst, whole + max(light, attn / 2))
        return float(worst)

    def _attention(self, g: LayerGeom) -> tuple[float, float]:
        """(kept until the layer's backward, transient during it) for one layer, in bytes."""
        B, L, s = self.B, self.L, self.g.dtype_bytes
        if self.attention == "fused":
            scores = B * g.heads * L * L * s
            return FUSED_RETAINED_COPIES * scores, FUSED_TRANSIENT_COPIES * scores
        window = g.window if g.window is not None and g.window < L else None
        chunk = _chunk_size(B, g.heads, L, window)
        visible = L if window is None else min(L, chunk + window - 1)
        scores = CHUNKED_SCORE_COPIES * B * g.heads * chunk * visible * 4
        if self.tile:  # the whole-sequence arrays are counted in _tiled_layer
            return 0.0, scores
        linear = B * L * (2 * g.kv_width * 4 + g.heads * g.head_dim * s)  # dK, dV f32 + dQ
        return 0.0, scores + linear

    # --- memory ---------------------------------------------------------------------------

    def per_layer_input_bytes(self) -> float:
        return float(self.B * self.L * self.g.per_layer_width * self.g.dtype_bytes)

    def constants(self) -> float:
        """Alive for the whole step besides the boundaries: per-layer inputs and masks (and, tiled,
        every donor's K/V)."""
        g, L = self.g, self.L
        if self.tile:
            pli = 0.0 if self.offload else self.per_layer_input_bytes()
            return pli + float(sum(self.kv_bytes.values()))
        windows = {x.window for x in g.layers if x.window is not None and x.window < L}
        masks = L * L * len(windows) if self.attention == "fused" else 0  # bool [L, L]
        return float(self.per_layer_input_bytes() + masks)

    def segment_matrix(self) -> np.ndarray:
        """S[a, b]: the transient of segment [a, b)'s backward, for all 0 <= a < b <= N (inf
        elsewhere). Untiled: its activations, attention, h_out and dh_in; tiled: the recomputed
        inputs of its layers up to the one running, plus that layer's backward."""
        n, c = self.g.num_layers, self.coef
        S = np.full((n + 1, n + 1), np.inf)
        if self.tile:
            per_layer = self.act + c.attention_transient * self.attn_transient
            for a in range(n):
                inner = (np.arange(a, n) - a + 1) * self.hidden_bytes
                S[a, a + 1:] = np.maximum.accumulate(inner + per_layer[a:])
            return S
        cum_act = np.concatenate([[0.0], np.cumsum(self.act)])
        cum_ret = np.concatenate([[0.0], np.cumsum(self.attn_retained)])
        for a in range(n):
            peak = np.maximum.accumulate(self.attn_transient[a:])
            bwd = np.maximum.accumulate(self.bwd[a:])
            b = np.arange(a + 1, n + 1)
            S[a, a + 1:] = (c.activation * (cum_act[b] - cum_act[a] + bwd)
                            + c.attention * (cum_ret[b] - cum_ret[a])
                            + c.attention_transient * peak
                            + 2 * self.hidden_bytes)
        return S

    def head_bytes(self) -> float:
        """Transient of the chunked loss head: one chunk of logits, dh and its update copy."""
        g = self.g
        rows = max(1, min(self.B * (self.L - 1), HEAD_MAX_ELEMENTS // g.vocab))
        copies = HEAD_COPIES + (SOFTCAP_COPIES if g.softcap else 0.0)
        return copies * rows * g.vocab * g.dtype_bytes + 2 * self.hidden_bytes

    def embed_bytes(self) -> float:
        """Prologue transient: the per-layer inputs are built through ~3 full-size temporaries
        (tiled: tile by tile, then split per layer, up to MAX_PENDING slices waiting for their
        copy to the host if offloaded)."""
        pli = self.per_layer_input_bytes()
        if self.tile:
            waiting = MAX_PENDING * pli / max(1, self.g.num_layers) if self.offload else 0.0
            return pli + waiting + self.hidden_bytes
        return 3.0 * pli

    def kept(self, n_segments: int) -> int:
        """Boundaries on the device: all without offload, else the last `offload_keep`."""
        return n_segments if not self.offload else min(self.offload_keep, n_segments)

    def host_bytes(self, n_segments: int) -> float:
        """Host memory of an offloaded step: one boundary per parked segment, the per-layer
        inputs and the per-layer embedding table."""
        if not self.offload:
            return 0.0
        parked = n_segments - self.kept(n_segments)
        return float(parked * self.hidden_bytes + self.per_layer_input_bytes()
                     + self.g.table_bytes)

    def resting(self) -> tuple[float, float]:
        """(weights incl. LoRA factors, LoRA grads + AdamW's two float32 moments); offload
        keeps the per-layer embedding table in host memory."""
        weights = self.g.weight_bytes - (self.g.table_bytes if self.offload else 0)
        return float(weights), float(self.g.lora_params * 4 * 3)

    def saved_donors(self, segments: Sequence[tuple[int, int]]) -> dict[int, list[int]]:
        """Donor -> indices of later segments that read its saved K/V (tiled: every donor's K/V
        is kept, and read by the segments of its sharers)."""
        seg_of = {i: k for k, (a, b) in enumerate(segments) for i in range(a, b)}
        out: dict[int, list[int]] = {}
        for d, readers in self.g.sharers().items():
            ks = sorted({seg_of[r] for r in readers if self.tile or seg_of[r] != seg_of[d]})
            if ks:
                out[d] = ks
        return out

    def evaluate(self, segments: Sequence[tuple[int, int]]) -> dict[str, Any]:
        """Predicted peak (bytes), its breakdown and the event where it happens."""
        n_seg = len(segments)
        weights, lora_opt = self.resting()
        saved = self.saved_donors(segments)
        kv_saved = 0.0 if self.tile else sum(self.kv_bytes[d] for d in saved)  # tiled: constant
        const = self.constants() + kv_saved
        hb = self.hidden_bytes
        first_kept = n_seg - self.kept(n_seg)  # boundaries k >= this one live on the device

        def on_device(k: int) -> float:  # bytes of the boundaries of segments 0..k-1
            return max(0, k - first_kept) * hb

        S = self.segment_matrix()
        seg_t = [float(S[a, b]) for a, b in segments]
        events = [("embedding", float(hb), self.embed_bytes() + (0.0 if self.tile else hb)),
                  ("loss head", on_device(n_seg) + hb, self.head_bytes())]
        if self.tile:  # offload: up to MAX_PENDING boundaries' device copies await the host
            waiting = MAX_PENDING * hb if self.offload else 0.0
            events.append(("layer forward", on_device(n_seg) + waiting, self.forward_bytes()))
        for k, (_, b) in enumerate(segments):
            pending = sum(self.kv_bytes[d] for d in saved if d < b)  # dK/dV not yet consumed
            events.append((f"segment {k} backward", on_device(k) + self.fixed_bytes + pending,
                           seg_t[k]))
        name, alive, transient = max(events, key=lambda e: e[1] + e[2])
        peak = weights + lora_opt + const + alive + transient
        return dict(
            peak=peak, peak_at=name,
            breakdown=dict(weights=weights, lora_optimizer=lora_opt, boundaries=const + alive,
                           worst_segment=max(seg_t), head=self.head_bytes()),
            saved=saved, segment_bytes=seg_t,
        )

    # --- time -----------------------------------------------------------------------------

    def _flops(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(forward, backward, q/k/v projection forward) FLOPs of each layer for the whole batch
        (fused: the attention MLX's plain backward runs; chunked: ours)."""
        L, B = self.L, self.B
        fwd, bwd, qkv = [], [], []
        for g in self.g.layers:
            quant = 1.0 + 0.02 * g.bits if g.bits else 1.0  # dequantization work, a guess
            lin = g.linear_flops * quant * L * B
            if self.attention == "fused":  # the composed fallback scores every key
                keys, ratio = L, BWD_ATTN_FUSED
            else:
                chunk = _chunk_size(B, g.heads, L, g.window if g.window and g.window < L
                                    else None)
                keys = (L + chunk) / 2 if g.window is None or g.window >= L \
                    else min(L, g.window + chunk / 2)
                ratio = BWD_ATTN_CHUNKED
            attn = 4.0 * g.heads * g.head_dim * keys * L * B
            fwd.append(lin + attn)
            bwd.append(BWD_LINEAR * lin + ratio * attn)
            qkv.append(g.qkv_flops * quant * L * B)
        return np.array(fwd), np.array(bwd), np.array(qkv)

    def relative_step_time(self, segments: Sequence[tuple[int, int]]) -> float:
        """Segmented step time over one plain forward+backward (same loss head).

        Untiled: the recompute costs one forward in total. Tiled: the forward is the layer's
        own (the post pass's Q/K/V projections feed nothing, so MLX never computes them); a
        layer's backward recomputes Q/K/V and the attention output, runs the post pass, its
        VJP, attention's VJP and the pre pass's VJP (which recomputes Q/K/V once more); and
        each segment first recomputes the inputs of its layers above the first.
        """
        fwd, bwd, qkv = self._flops()
        rows = self.B * (self.L - 1)
        head = 2.0 * self.g.hidden * self.g.vocab * rows * 3  # forward + dX
        base = fwd.sum() + bwd.sum() + head
        n_seg = len(segments)
        if not self.tile:
            return float(1.0 + fwd.sum() / base + SEGMENT_OVERHEAD * n_seg)
        vjp = fwd + bwd + qkv  # recompute + post/attention/pre VJPs + the pre-VJP's Q/K/V
        inner = sum(fwd[a:b - 1].sum() for a, b in segments)
        return float((fwd.sum() + vjp.sum() + inner + head) / base + SEGMENT_OVERHEAD * n_seg)


# --------------------------------------------------------------------------------------------
# Search


def _best_by_count(cost: CostModel) -> dict[int, list[tuple[int, int]]]:
    """For every segment count, the contiguous cut minimising the peak (min-max DP).

    The worst backward event of a plan is max_k(k * stored boundary + fixed + pending dK/dV +
    S[a_k, b_k]); dp[j][i] is its minimum over plans of layers [0, i) in j segments. Donors
    whose sharers may stay in their segment (no saved K/V) are a separate branch that forbids
    cuts between them, so the DP's count is exact in the branch matching a plan's real saved
    set. The tiled engine keeps every donor's K/V, so it has only the all-saved branch.
    """
    n = cost.g.num_layers
    S = cost.segment_matrix()
    bb, fixed = cost.boundary_bytes, cost.fixed_bytes
    spans = {d: (d, max(r)) for d, r in cost.g.sharers().items()}
    donors = sorted(spans)
    branches = (itertools.product([False, True], repeat=len(donors))
                if len(donors) <= 4 and not cost.tile else [tuple([True] * len(donors))])
    best: dict[int, tuple[float, list[tuple[int, int]]]] = {}
    for saved_flags in branches:
        allowed = np.ones(n + 1, bool)
        pending = np.zeros(n + 1)  # pending[i]: dK/dV alive while a segment ending at i runs
        for d, saved in zip(donors, saved_flags):
            lo, hi = spans[d]
            if saved:
                pending[d + 1:] += cost.kv_bytes[d]
            else:
                allowed[lo + 1: hi + 1] = False
        allowed[n] = True
        dp = np.full((n + 1, n + 1), np.inf)  # dp[j, i]
        arg = np.zeros((n + 1, n + 1), int)
        dp[1, 1:] = fixed + pending[1:] + S[0, 1:]
        for j in range(2, n + 1):
            event = (j - 1) * bb + fixed + pending[None, :] + S  # [p, i]
            cand = np.maximum(dp[j - 1][:, None], event)
            cand[~allowed, :] = np.inf
            arg[j] = np.argmin(cand, axis=0)
            dp[j] = cand[arg[j], np.arange(n + 1)]
        for j in range(1, n + 1):
            if not np.isfinite(dp[j, n]):
                continue
            cuts, i = [], n
            for jj in range(j, 0, -1):
                p = 0 if jj == 1 else int(arg[jj, i])
                cuts.append((p, i))
                i = p
            plan = cuts[::-1]
            peak = cost.evaluate(plan)["peak"]
            if j not in best or peak < best[j][0]:
                best[j] = (peak, plan)
    return {j: plan for j, (_, plan) in best.items()}


def choose(
    cost: CostModel, target_gb: float | None, time_budget: float | None
) -> tuple[list[tuple[int, int]], bool, bool, str]:
    """(segments, meets_target, meets_time_budget, message) under the strategy of the brief:
    the fastest plan whose peak meets the target, else the minimum-peak plan (ties go to the
    faster). Untiled, fewer segments are faster; tiled, more are (a segment of k layers
    recomputes k - 1 layer inputs in its backward)."""
    plans = _best_by_count(cost)
    peaks = {j: cost.evaluate(p)["peak"] for j, p in plans.items()}
    times = {j: cost.relative_step_time(p) for j, p in plans.items()}
    in_time = [j for j in plans if time_budget is None or times[j] <= time_budget]
    meets_time = bool(in_time)
    def fastest(js):
        return min(js, key=lambda j: (times[j], j))

    if not in_time:
        j = fastest(plans)
        return plans[j], target_gb is None or peaks[j] <= target_gb * GB, False, (
            f"time budget {time_budget} is below the fastest plan's relative step time "
            f"{times[j]:.3f} (the recompute forward alone costs that): returning that plan "
            f"({j} segments)")
    floor = min(peaks[j] for j in in_time)
    near_floor = [j for j in in_time if peaks[j] <= floor * (1 + TIE_FRACTION)]
    j_min = fastest(near_floor)
    if target_gb is None:
        return plans[j_min], True, meets_time, (
            f"minimum-peak plan: {j_min} segments, {peaks[j_min] / GB:.2f} GB")
    ok = [j for j in in_time if peaks[j] <= target_gb * GB]
    if ok:
        j = fastest(ok)
        return plans[j], True, meets_time, (
            f"{j} segments meet the {target_gb:g} GB target at {peaks[j] / GB:.2f} GB")
    what = " within the time budget" if time_budget is not None else ""
    return plans[j_min], False, meets_time, (
        f"target {target_gb:g} GB cannot be met{what}: the smallest achievable peak is "
        f"{peaks[j_min] / GB:.2f} GB ({j_min} segments); returning that plan")


# --------------------------------------------------------------------------------------------
# Calibration


def _attach_lora(layers: Sequence[nn.Module], rank: int) -> list[tuple[nn.Module, list]]:
    """Wrap the linears of `layers` in LoRA (if they have none); returns what to restore."""
    from mlx_lm.tuner.lora import LoRALinear

    undo = []
    for layer in layers:
        if any(v.size for _, v in tree_flatten(layer.trainable_parameters())):
            continue
        originals = _linears(layer)
        layer.update_modules(tree_unflatten(
            [(p, LoRALinear.from_base(m, r=rank, scale=20.0)) for p, m in originals]))
        undo.append((layer, originals))
    return undo


def measure_segment(model: nn.Module, start: int, stop: int, seq_len: int,
                    batch_size: int = 1, lora_rank: int = 8) -> float:
    """Peak bytes above the inputs of one segment's vjp, as the engine runs it.

    Runs segback's stack adapter on random hidden states (no embedding or head), with LoRA
    attached to the segment's layers if the model has none; only those layers are touched.
    """
    import gc

    from segback.engine.memory import reset_peak
    from segback.models.stack import get_stack

    stack = get_stack(model)
    if any(stack.kv_source[i] < start for i in range(start, stop)):
        raise ValueError("calibration segment must not read K/V from an earlier segment")
    layers = stack.layers[start:stop]
    undo = _attach_lora(layers, lora_rank)
    try:
        mx.random.seed(0)
        outer, args = _text_parts(model)
        dtype = DTYPES[read_geometry(model).dtype]
        h = mx.random.normal((batch_size, seq_len, args.hidden_size)).astype(dtype)
        pli = None
        if stack.call_layer is not None and getattr(args, "hidden_size_per_layer_input", 0):
            pli = mx.random.normal((batch_size, seq_len, stack.num_layers,
                                    args.hidden_size_per_layer_input)).astype(dtype)
        masks = stack.masks(h)
        flat = [(i, k, v) for i, layer in enumerate(layers)
                for k, v in tree_flatten(layer.trainable_parameters())]
        params = [v for _, _, v in flat]
        dh = mx.random.normal(h.shape).astype(dtype) * 1e-2
        mx.eval(h, pli, dh, params, [m for m in masks.values() if isinstance(m, mx.array)],
                [layer.parameters() for layer in layers])

        def seg_fn(h_in, *leaves):
            for i, layer in enumerate(layers):
                own = [(k, v) for (j, k, _), v in zip(flat, leaves) if j == i]
                layer.update(tree_unflatten(own), strict=False)
            return [stack.run(start, stop, h_in, masks, pli)[0]]

        gc.collect()
        reset_peak()
        base = mx.get_active_memory()
        _, vjps = mx.vjp(seg_fn, [h, *params], [dh])
        mx.eval(vjps)
        peak = mx.get_peak_memory() - base
        for i, k, v in flat:  # put the untraced leaves back
            layers[i].update(tree_unflatten([(k, v)]), strict=False)
        return float(peak)
    finally:
        for layer, originals in undo:
            layer.update_modules(tree_unflatten(originals))


def calibration_segments(geom: Geometry) -> list[tuple[int, int]]:
    """The first full-attention layer alone, and with the layer before it: both attention kinds
    are measured when the model mixes them, and no segment reads shared K/V."""
    n = geom.num_layers
    f = next((i for i, g in enumerate(geom.layers) if g.kind == FULL), 0)
    if n == 1:
        return [(0, 1)]
    return [(f, f + 1), (f - 1, f + 1) if f > 0 else (0, 2)]


@contextlib.contextmanager
def _attention_mode(model: nn.Module, attention: str) -> Iterator[None]:
    """Measure with the attention the plan is for: route the model's module through
    segback.engine.attention's chunked sdpa when `attention` is "chunked"."""
    if attention != "chunked":
        yield
        return
    from segback.engine.attention import use_chunked_attention

    layer = _text_parts(model)[0].model.layers[0]
    with use_chunked_attention([sys.modules[type(layer).__module__]]):
        yield


def _nonneg_lstsq(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with x >= 0 by trying every subset of free variables (3 unknowns)."""
    best, best_res = np.zeros(X.shape[1]), np.inf
    for k in range(1, X.shape[1] + 1):
        for cols in itertools.combinations(range(X.shape[1]), k):
            sol = np.linalg.lstsq(X[:, cols], y, rcond=None)[0]
            if np.any(sol <= 0):
                continue
            x = np.zeros(X.shape[1])
            x[list(cols)] = sol
            res = float(np.sum((X @ x - y) ** 2))
            if res < best_res:
                best, best_res = x, res
    return best


def fit_coefficients(model: nn.Module, geom: Geometry, batch_size: int = 1, lora_rank: int = 8,
                     attention: str = "fused", lengths: Sequence[int] = CALIBRATION_LENGTHS,
                     ) -> Coefficients:
    """Fit the three multipliers to a 1-layer and a 2-layer segment measured at two lengths.

    measured - h_out - dh_in = a * activations + r * kept scores + t * backward scores, one
    equation per (segment, length), solved by non-negative least squares: the lengths separate
    the linear from the quadratic terms, the segment sizes what each layer keeps from what only
    one layer's backward needs. A coefficient the data cannot see stays near its analytic 1.
    """
    segs = calibration_segments(geom)
    rows, ys, measured = [], [], []
    for a, b in segs:
        measured.append([])
        for L in lengths:
            cost = CostModel(geom, L, batch_size, attention)
            with _attention_mode(model, attention):
                m = measure_segment(model, a, b, L, batch_size, lora_rank)
            measured[-1].append(m / GB)
            rows.append([cost.act[a:b].sum() + cost.bwd[a:b].max(),
                         cost.attn_retained[a:b].sum(), cost.attn_transient[a:b].max()])
            ys.append(m - 2 * cost.hidden_bytes)
    X, y = np.array(rows), np.array(ys)
    scale = X.max(axis=0)
    scale[scale == 0] = 1.0
    sol = _nonneg_lstsq(X / scale, y) / scale
    sol = np.where(X.max(axis=0) > 0, np.clip(sol, 0.05, 100.0), 1.0)
    return Coefficients(*map(float, sol), calibrated=True, lengths=list(lengths),
                        segments=[list(s) for s in segs], measured_gb=measured)


# --------------------------------------------------------------------------------------------
# API and CLI


def plan_segments(
    model_or_config: nn.Module | dict | str,
    seq_len: int,
    batch_size: int = 1,
    target_gb: float | None = None,
    time_budget: float | None = None,
    calibrate: bool = False,
    lora_rank: int = 8,
    lora_layers: int | None = None,
    dtype: str | None = None,
    attention: str = "fused",
    quant_bits: int | None = None,
    calibration_lengths: Sequence[int] = CALIBRATION_LENGTHS,
    coefficients: Coefficients | dict | None = None,
    segments: Any = None,
    tile: int | str | None = None,
    offload: bool | str = False,
    light_tile: int | None = None,
    offload_keep: int | str = "auto",
) -> dict[str, Any]:
    """Plan the segments of a segmented backward; returns the plan dict of plan.schema.json.

    `model_or_config` is an mlx-lm model, a config dict, a geometry name (segback.models.geometry)
    or an MLX checkpoint directory; the last three are read lazily, nothing is materialized.
    `quant_bits` quantizes a config/geometry (a model or checkpoint carries its own bits);
    calibrating a config/geometry builds it with random weights.
    `coefficients` reuses an earlier calibration (a plan's `inputs.calibration`); `segments`
    (ranges or layers per segment, as the engine takes them) skips the search and only predicts.
    `tile` (tokens) plans the sequence-tiled engine, `offload` with host-parked boundaries;
    `tile="auto"` (and `offload="auto"`) also weigh untiled and every tile size of TILE_SIZES
    (with and without offload): with a target, the fastest that meets it, else the smallest
    peak. `light_tile` plans the tiled engine's light passes on their own tile (default: the
    tile); `offload_keep` keeps the last N segments' boundaries on the device, "auto" (default)
    as many as the target leaves room for (none without one): on the H200 that took e4b's 8K
    step from 6.1 to 4.9 s. The chosen `attention`, `tile`, `offload`, `light_tile` and
    `offload_keep` are top-level keys the engine reads.
    """
    if seq_len < 2:
        raise ValueError("seq_len must be at least 2")
    from segback.engine.segmented import check_tiling_extras, tiling_options

    tile, offload = tiling_options(tile, offload)
    check_tiling_extras(tile, offload, light_tile, offload_keep)
    configs = tile_configs(seq_len, attention, tile, offload)
    if calibrate and _is_lazy_random(model_or_config):  # measuring needs real weights
        from segback.models.geometry import build_model, geometry_config

        if dtype is None:  # bfloat16 matmuls are slow on CPU
            dtype = "bfloat16" if mx.default_device() == mx.gpu else "float32"
        config = model_or_config if isinstance(model_or_config, dict) \
            else geometry_config(model_or_config)
        model_id = str(model_or_config if isinstance(model_or_config, str)
                       else config["model_type"])
        model_or_config = build_model(config, dtype=DTYPES[dtype], quantize_bits=quant_bits)
        model_or_config.freeze()  # calibration attaches LoRA to the layers it measures
    else:
        model_id = None
    model, default_id = resolve_model(model_or_config, dtype, quant_bits)
    model_id = model_id or default_id
    geom = read_geometry(model, lora_rank, lora_layers, dtype, model_id)
    coef = Coefficients(**coefficients) if isinstance(coefficients, dict) else \
        coefficients or Coefficients()
    if calibrate:
        kinds = {att for att, _, _ in configs}  # measure the attention the plan will run
        coef = fit_coefficients(model, geom, batch_size, lora_rank,
                                kinds.pop() if len(kinds) == 1 else attention,
                                calibration_lengths)
    given = segments
    options = []  # (cost, segments, meets_target, meets_time, message) per configuration
    for att, t, off in configs:  # boundaries kept on the device are chosen after the cut
        cost = CostModel(geom, seq_len, batch_size, att, coef, t, off,
                         light_tile if t else None)
        if given is None:
            options.append((cost, *choose(cost, target_gb, time_budget)))
            continue
        from segback.engine.segmented import resolve_segments

        segs = resolve_segments(given, geom.num_layers)
        peak = cost.evaluate(segs)["peak"]
        options.append((cost, segs, target_gb is None or peak <= target_gb * GB,
                        time_budget is None or cost.relative_step_time(segs) <= time_budget,
                        f"given plan of {len(segs)} segments: {peak / GB:.2f} GB"))
    cost, segments, meets_target, meets_time, message = _pick(options, target_gb)
    if cost.offload and offload_keep == "auto":
        if target_gb is not None and meets_target:
            cost.offload_keep = _most_kept(cost, segments, target_gb)
    elif cost.offload:
        cost.offload_keep = offload_keep
        meets_target = target_gb is None or cost.evaluate(segments)["peak"] <= target_gb * GB
    if cost.offload and cost.offload_keep:
        message += f"; the last {cost.kept(len(segments))} boundaries stay on the device"
    if len(options) > 1:
        what = f"tile {cost.tile}" + (", offload" if cost.offload else "") if cost.tile \
            else "untiled"
        message = f"{what} (best of {len(options)} configurations): {message}"
    ev = cost.evaluate(segments)
    sharers = geom.sharers()
    saved_kv = [dict(donor=d, kind=geom.layers[d].kind, read_by_segments=ks,
                     sharer_layers=sharers[d], gb=cost.kv_bytes[d] / GB)
                for d, ks in sorted(ev["saved"].items())]
    return dict(
        segments=[[a, b] for a, b in segments],
        saved_kv=saved_kv,
        predicted_peak_gb=ev["peak"] / GB,
        breakdown={k: v / GB for k, v in ev["breakdown"].items()},
        peak_at=ev["peak_at"],
        segment_gb=[x / GB for x in ev["segment_bytes"]],
        predicted_relative_step_time=cost.relative_step_time(segments),
        predicted_host_gb=cost.host_bytes(len(segments)) / GB,
        attention=cost.attention,
        tile=cost.tile,
        offload=cost.offload,
        light_tile=cost.light if cost.tile and cost.light != cost.tile else None,
        offload_keep=cost.kept(len(segments)) if cost.offload else 0,
        meets_target=bool(meets_target),
        meets_time_budget=bool(meets_time),
        message=message,
        layer_types=[g.kind for g in geom.layers],
        inputs=dict(
            model=model_id,
            model_type=geom.model_type,
            seq_len=seq_len,
            batch_size=batch_size,
            target_gb=target_gb,
            time_budget=time_budget,
            dtype=geom.dtype,
            attention=attention,
            tile=tile,
            offload=offload,
            light_tile=light_tile,
            offload_keep=offload_keep,
            lora_rank=lora_rank,
            lora_layers=lora_layers,
            quant_bits=quant_bits if quant_bits is not None else
            (geom.quant_bits[0] if len(geom.quant_bits) == 1 else geom.quant_bits or None),
            calibration=asdict(coef) if coef.calibrated else None,
        ),
    )


def _most_kept(cost: CostModel, segments: list[tuple[int, int]], target_gb: float) -> int:
    """The most boundaries (of the last segments) that can stay on the device within the
    target: the peak only grows with each one kept."""
    best = 0
    for keep in range(1, len(segments) + 1):
        cost.offload_keep = keep
        if cost.evaluate(segments)["peak"] > target_gb * GB:
            break
        best = keep
    cost.offload_keep = best
    return best


def tile_configs(seq_len: int, attention: str, tile: int | str | None,
                 offload: bool | str) -> list[tuple[str, int | None, bool]]:
    """(attention, tile, offload) configurations the planner weighs for these options (as
    `segback.engine.segmented.tiling_options` returns them)."""
    if offload is True and tile is None:
        raise ValueError("offload needs a tile size (--tile N or --tile auto)")
    offloads = [False, True] if offload == "auto" else [bool(offload)]
    if tile != "auto":
        if tile is None:
            return [(attention, None, False)]
        return [("chunked", tile, off) for off in offloads]
    sizes = [t for t in TILE_SIZES if t < seq_len] or [seq_len]
    untiled = [] if offload is True else [(attention, None, False)]
    return untiled + [("chunked", t, off) for off in offloads for t in sizes]


def _pick(options: list[tuple], target_gb: float | None) -> tuple:
    """Among (cost, segments, meets_target, meets_time, message): with a target, the fastest
    option meeting it (and the time budget); else, or if none does, the smallest peak (ties
    within TIE_FRACTION go to the faster)."""
    def peak(o):
        return o[0].evaluate(o[1])["peak"]

    def time(o):
        return o[0].relative_step_time(o[1])

    if len(options) == 1:
        return options[0]
    ok = [o for o in options if o[2] and o[3]]
    if target_gb is not None and ok:
        return min(ok, key=time)
    in_time = [o for o in options if o[3]] or options
    floor = min(peak(o) for o in in_time)
    return min((o for o in in_time if peak(o) <= floor * (1 + TIE_FRACTION)), key=time)


def _is_lazy_random(model_or_config: Any) -> bool:
    """A config dict or geometry name (an nn.Module is a dict too, hence the first check)."""
    if isinstance(model_or_config, nn.Module):
        return False
    return isinstance(model_or_config, dict) or not Path(model_or_config).is_dir()


def validate(plan: dict[str, Any]) -> None:
    """Raise jsonschema.ValidationError unless `plan` matches workflow/schemas/plan.schema.json."""
    import json

    import jsonschema

    schema = json.loads(SCHEMA_PATH.read_text())
    jsonschema.Draft202012Validator(schema).validate(plan)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="MLX checkpoint directory or geometry name (e.g. e4b, tiny-llama)")
    parser.add_argument("--seq", type=int, required=True, help="sequence length L")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--target-gb", type=float, default=None, help="peak memory target")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="max step time relative to a plain forward+backward (e.g. 1.5)")
    parser.add_argument("--calibrate", action="store_true",
                        help="measure a 1- and a 2-layer segment at two lengths and fit the "
                        "cost model (a geometry is built with random weights)")
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--lora-layers", type=int, default=None,
                        help="LoRA on the last N layers (default: all)")
    parser.add_argument("--attention", choices=["fused", "chunked"], default="fused")
    parser.add_argument("--tile", default=None,
                        help="tokens per tile for the sequence-tiled engine (implies chunked "
                        "attention), or 'auto' to weigh untiled and every tile size")
    parser.add_argument("--offload", nargs="?", const=True, default=False,
                        choices=[True, False, "auto"],
                        type=lambda v: {"auto": "auto", "true": True, "false": False}.get(
                            v.lower(), v),
                        help="park boundaries and per-layer inputs in host memory (with --tile); "
                        "'--offload auto' weighs both")
    parser.add_argument("--light-tile", type=int, default=None,
                        help="tokens per tile of the tiled engine's light passes (the pre pass, "
                        "its VJP and the forward post pass); default: --tile")
    parser.add_argument("--offload-keep", default="auto",
                        type=lambda v: v if v == "auto" else int(v),
                        help="with --offload: the last N segments keep their boundary on the "
                        "device (no host copies); 'auto' (default): as many as --target-gb "
                        "allows, none without a target")
    parser.add_argument("--quant-bits", type=int, default=None,
                        help="quantize a geometry's weights to N bits (checkpoints carry theirs)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="compute dtype (default: the checkpoint's, bfloat16 for geometries)")
    parser.add_argument("--out", required=True, help="plan JSON to write")


def main(args: argparse.Namespace) -> int:
    from segback.io import atomic_write_json

    try:
        plan = plan_segments(args.model, args.seq, args.batch, args.target_gb, args.time_budget,
                             args.calibrate, args.lora_rank, args.lora_layers, args.dtype,
                             args.attention, args.quant_bits, tile=args.tile,
                             offload=args.offload, light_tile=args.light_tile,
                             offload_keep=args.offload_keep)
    except (ValueError, FileNotFoundError) as e:  # user-fixable: no traceback
        print(f"segback plan: error: {e}", file=sys.stderr)
        return 2
    plan["inputs"]["model"] = str(args.model)
    validate(plan)
    atomic_write_json(args.out, plan)
    print(describe(plan))
    print(f"predicted peak {plan['predicted_peak_gb']:.2f} GB (at {plan['peak_at']}), "
          f"relative step time {plan['predicted_relative_step_time']:.2f}"
          + (f", tile {plan['tile']}" if plan["tile"] else "")
          + (f", {plan['predicted_host_gb']:.2f} GB in host memory" if plan["offload"] else ""))
    if not (plan["meets_target"] and plan["meets_time_budget"]):
        print(f"warning: {plan['message']}", file=sys.stderr)
    return 0


def describe(plan: dict[str, Any]) -> str:
    """One line per segment, for humans."""
    lines = [plan["message"]]
    for (a, b), gb in zip(plan["segments"], plan["segment_gb"]):
        kinds = "".join("F" if plan["layer_types"][i] == FULL else "s" for i in range(a, b))
        lines.append(f"  [{a:>2}, {b:>2}) {kinds:<8} {gb:7.2f} GB")
    return "\n".join(lines)


__all__ = ["plan_segments", "read_geometry", "CostModel", "fit_coefficients", "measure_segment",
           "validate", "add_arguments", "main"]
