"""Gemma-4's per-layer embedding table in host memory, read at the batch's token ids.

e4b's per-layer table (262144 ids x 42 layers x 256) is 1.59 GB at 4 bits (5.6 GB in bf16): a
third of the model's weights, of which a step reads only the rows of its token ids. Gemma's
design keeps these per-layer embeddings off the accelerator; with offload (the tiled engine
already parks boundaries and per-layer inputs in host memory) segback does the same.

`park_tables(model)` swaps mlx-lm's frozen (Quantized)Embedding for a `HostEmbedding` holding the
same arrays in numpy. Its call gathers the rows on the host and dequantizes them on the device
with mlx's own kernel, the order `QuantizedEmbedding.__call__` uses, so values are bit-identical.
The arrays leave the model's parameters: nothing saves, casts or trains them (LoRA never does).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

# Modules that hold a per-layer table, by the attribute mlx-lm's Gemma-4 text model uses.
TABLES = ("embed_tokens_per_layer",)


def _host(x: mx.array) -> tuple[np.ndarray, mx.Dtype]:
    raw = x.view(mx.uint16) if x.dtype == mx.bfloat16 else x  # numpy has no bfloat16
    return np.array(raw), x.dtype


def _device(rows: np.ndarray, dtype: mx.Dtype) -> mx.array:
    x = mx.array(rows)
    return x.view(mx.bfloat16) if dtype == mx.bfloat16 else x


class HostEmbedding(nn.Module):
    """An embedding (plain or quantized) whose table lives in host memory."""

    def __init__(self, emb: nn.Module):
        super().__init__()
        quant = None
        if isinstance(emb, nn.QuantizedEmbedding):
            quant = dict(group_size=emb.group_size, bits=emb.bits, mode=emb.mode)
        names = ("weight", "scales", "biases") if quant else ("weight",)
        # Plain attributes, not parameters: nn.Module would register dicts as its children.
        object.__setattr__(self, "quant", quant)
        object.__setattr__(self, "host", {k: _host(emb[k]) for k in names if k in emb})
        self.nbytes = sum(a.nbytes for a, _ in self.host.values())

    def __call__(self, ids: mx.array) -> mx.array:
        idx = np.array(ids)
        rows = {k: _device(a[idx], dt) for k, (a, dt) in self.host.items()}
        if self.quant is None:
            return rows["weight"]
        return mx.dequantize(rows["weight"], scales=rows["scales"], biases=rows.get("biases"),
                             **self.quant)


def _inner(model: nn.Module) -> nn.Module | None:
    outer = getattr(model, "language_model", model)  # the gemma4 wrapper keeps it there
    return getattr(outer, "model", None)


def table_bytes(model: nn.Module) -> int:
    """Device bytes of the tables `park_tables` would move (0 if none or already parked)."""
    inner = _inner(model)
    return sum(v.nbytes for name in TABLES
               if isinstance(getattr(inner, name, None), nn.Module)
               and not isinstance(getattr(inner, name), HostEmbedding)
               for _, v in tree_flatten(getattr(inner, name).parameters()))


def parked_bytes(model: nn.Module) -> int:
    """Host bytes of the model's parked tables."""
    inner = _inner(model)
    return sum(getattr(inner, name).nbytes for name in TABLES
               if isinstance(getattr(inner, name, None), HostEmbedding))


def park_tables(model: nn.Module) -> int:
    """Move the model's per-layer embedding tables to host memory; returns the bytes moved.

    A table with trainable parameters stays on the device (its gradient needs it there).
    """
    inner, moved = _inner(model), 0
    for name in TABLES:
        emb = getattr(inner, name, None)
        if not isinstance(emb, (nn.Embedding, nn.QuantizedEmbedding)):
            continue
        if tree_flatten(emb.trainable_parameters()):
            continue
        host = HostEmbedding(emb)
        setattr(inner, name, host)
        moved += host.nbytes
    return moved
