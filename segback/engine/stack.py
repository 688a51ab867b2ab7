"""Per-family layer-stack adapters: run a *range* of an mlx-lm model's layers, and its head.

The engine never forks attention or MLP code: it calls mlx-lm's own decoder layers. An adapter
only knows what the model's `__call__` does around them — the embedding (and its scale), masks
per layer type, Gemma-4 per-layer inputs and KV sharing — and the head (final norm, LM head or
tied embedding, logit softcap).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.gemma4_text import logit_softcap

from segback.engine.masks import Blocks, MaskSpec
from segback.engine.packing import attention_mask

DENSE_TYPES = ("llama", "mistral", "qwen2", "qwen3", "minicpm")
SUPPORTED_TYPES = (*DENSE_TYPES, "gemma3_text", "gemma3", "gemma4_text", "gemma4")
WRAPPER_TYPES = ("gemma3", "gemma4")  # multimodal: the text model is `language_model`


def has_dropout(module: nn.Module) -> bool:
    """Whether `module` draws random masks (a LoRA dropout with p > 0): replays of it must
    reseed, and compiled traces cannot replay it."""
    return any(isinstance(m, nn.Dropout) and m._p_1 < 1.0 for _, m in module.named_modules())


def binder(module: nn.Module, keys: list[str]) -> Callable[[list[mx.array]], None]:
    """A function that puts values of `module`'s leaves at `keys` (dotted paths, as
    `tree_flatten` names them) into it, as `module.update(...)` would; a key the module does
    not have is a KeyError, not skipped.

    It walks each path and assigns: the engine binds a layer's leaves once per tile, and
    `update`'s tree rebuilding costs more host time than a tile's graph. Paths are walked at
    every call, so a module swapped in since (LoRA applied again) is the one bound.
    """
    paths = [[int(p) if p.isdigit() else p for p in key.split(".")] for key in keys]

    def bind(leaves: list[mx.array]) -> None:
        for path, value in zip(paths, leaves):
            obj = module
            for part in path[:-1]:
                obj = obj[part]
            obj[path[-1]] = value
    return bind


@dataclass
class Head:
    """A model's head as its mlx-lm `__call__` applies it: final norm, LM head (a linear, a
    quantized one or a tied embedding's `as_linear`), then an optional logit softcap.

    Called, it is that composition; kept apart, the loss head can fuse the softcap and the
    cross-entropy and take the VJP of the norm and of the LM head alone.
    """

    norm: Callable[[mx.array], mx.array]
    linear: Callable[[mx.array], mx.array]  # normed rows -> logits before the softcap
    softcap: float | None = None

    def __call__(self, x: mx.array) -> mx.array:
        out = self.linear(self.norm(x))
        if self.softcap is None:
            return out
        return logit_softcap(self.softcap, out)


# A layer's mask: mlx-lm's own value ("causal", None or a boolean array), built once per step.
Mask = Any


@dataclass
class Stack:
    """What the engine needs to run a model segment by segment."""

    model_type: str
    layers: list[nn.Module]
    layers_path: str  # key prefix of the layers in model.parameters(), e.g. "model.layers"
    embed: Callable[[mx.array], tuple[mx.array, mx.array | None]]  # ids -> (h0, per-layer in)
    head: Head  # hidden rows (pre final norm) -> logits
    layer_types: list[str]  # "full_attention" / "sliding_attention" per layer
    window: int | None = None
    kv_source: list[int] = field(default_factory=list)  # layer -> layer whose K/V it reads
    call_layer: Callable[..., tuple[mx.array, Any]] | None = None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def module(self) -> ModuleType:
        """The mlx-lm module defining the layers (where attention is looked up by name)."""
        return sys.modules[type(self.layers[0]).__module__]

    def masks(self, h: mx.array, descriptors: bool = False,
              segments: np.ndarray | None = None) -> dict[str, Mask]:
        """One mask per attention type, as mlx-lm builds them for a cache-less call.

        With `descriptors`, a `MaskSpec` per type instead: chunked attention builds each chunk's
        mask from positions, so no [L, L] array ever exists. With `segments` ([B, L] example
        ids of a packed batch), block-diagonal causal masks (`segback.engine.packing`): arrays,
        or with `descriptors` `MaskSpec`s that chunked attention runs block-sparse.
        """
        sliding = "sliding_attention" in self.layer_types
        if segments is not None and not descriptors:
            ids = mx.array(segments)
            out = {"full_attention": attention_mask(ids)}
            if sliding:
                out["sliding_attention"] = attention_mask(ids, self.window)
            return out
        if descriptors:
            blocks = None if segments is None else Blocks(segments)
            out: dict[str, Mask] = {"full_attention": MaskSpec("causal", blocks=blocks)}
            if sliding:
                out["sliding_attention"] = MaskSpec("sliding", self.window, blocks=blocks)
            return out
        out = {"full_attention": create_attention_mask(h, None)}
        if "sliding_attention" in self.layer_types:
            out["sliding_attention"] = create_attention_mask(h, None, window_size=self.window)
        return out

    def donors_read_by(self, start: int, stop: int) -> list[int]:
        """Donor layers before `start` whose K/V layers in [start, stop) read."""
        return sorted({self.kv_source[i] for i in range(start, stop) if self.kv_source[i] < start})

    def run(
        self,
        start: int,
        stop: int,
        h: mx.array,
        masks: dict[str, Mask],
        per_layer: mx.array | None = None,
        kv_in: dict[int, tuple[mx.array, mx.array]] | None = None,
        kv_out: tuple[int, ...] = (),
    ) -> tuple[mx.array, dict[int, tuple[mx.array, mx.array]]]:
        """Run layers [start, stop); return the hidden state and the K/V of donors in `kv_out`."""
        kvs: dict[int, tuple[mx.array, mx.array]] = dict(kv_in or {})
        for i in range(start, stop):
            pli = None if per_layer is None else per_layer[:, :, i, :]
            src = self.kv_source[i]
            h, kv = self.layer(i, h, masks[self.layer_types[i]], pli,
                               kvs.get(src) if src != i else None)
            if src == i and kv is not None:
                kvs[i] = kv
        return h, {d: kvs[d] for d in kv_out}

    def layer(
        self,
        i: int,
        h: mx.array,
        mask: Mask,
        per_layer: mx.array | None = None,
        shared: tuple[mx.array, mx.array] | None = None,
        cache: Any = None,
    ) -> tuple[mx.array, tuple[mx.array, mx.array] | None]:
        """Call mlx-lm's layer i; `cache` is the stand-in the tiled engine passes (positions)."""
        if self.call_layer is None:
            return self.layers[i](h, mask, cache), None
        return self.call_layer(self.layers[i], h, mask, per_layer, shared, cache)


def _text_model(model: nn.Module) -> tuple[nn.Module, str]:
    """The causal LM inside a wrapper (gemma3 and gemma4 keep it under `language_model`)."""
    if getattr(model, "model_type", None) in WRAPPER_TYPES:
        return model.language_model, "language_model."
    return model, ""


def _lm_head(outer: nn.Module, inner: nn.Module, tied: bool) -> Callable[[mx.array], mx.array]:
    if tied or not hasattr(outer, "lm_head"):
        return inner.embed_tokens.as_linear
    return outer.lm_head


def get_stack(model: nn.Module) -> Stack:
    """Build the stack adapter for a supported mlx-lm model, or say which types are supported."""
    outer, prefix = _text_model(model)
    model_type = getattr(outer, "model_type", None) or getattr(outer.args, "model_type", None)
    if model_type not in SUPPORTED_TYPES:
        raise ValueError(
            f"segback does not support model type {model_type!r}; supported: "
            f"{', '.join(SUPPORTED_TYPES)}"
        )
    inner, args = outer.model, outer.args
    layers = list(inner.layers)
    n = len(layers)
    path = f"{prefix}model.layers"

    if model_type in DENSE_TYPES:
        types = list(getattr(args, "layer_types", None) or ["full_attention"] * n)
        scale = getattr(args, "scale_emb", None) if model_type == "minicpm" else None
        tied = bool(getattr(args, "tie_word_embeddings", False))

        def embed(ids):
            h = inner.embed_tokens(ids)
            return (h * scale if scale is not None else h), None

        if model_type == "minicpm":
            def lm(x):
                if tied:
                    return x @ inner.embed_tokens.weight.T
                return outer.lm_head(x / (args.hidden_size / args.dim_model_base))
        else:
            lm = _lm_head(outer, inner, tied)

        return Stack(model_type, layers, path, embed, Head(inner.norm, lm), types,
                     window=getattr(args, "sliding_window", None), kv_source=list(range(n)))

    if model_type == "gemma3_text":
        pattern = args.sliding_window_pattern
        types = ["full_attention" if i % pattern == pattern - 1 else "sliding_attention"
                 for i in range(n)]
        tied = getattr(outer, "tie_word_embeddings", False) or not hasattr(outer, "lm_head")
        lm = _lm_head(outer, inner, tied)

        def embed(ids):
            h = inner.embed_tokens(ids)
            return h * mx.array(args.hidden_size**0.5, mx.bfloat16).astype(h.dtype), None

        return Stack(model_type, layers, path, embed, Head(inner.norm, lm), types,
                     window=args.sliding_window, kv_source=list(range(n)))

    # gemma4_text (and the gemma4 wrapper): per-layer inputs, KV sharing, logit softcap.
    lm = _lm_head(outer, inner, outer.tie_word_embeddings)

    def embed(ids):
        emb = inner.embed_tokens(ids)
        h = emb * inner.embed_scale
        pli = None
        if inner.hidden_size_per_layer_input:
            pli = inner._project_per_layer_inputs(h, inner._get_per_layer_inputs(ids, emb))
        return h, pli

    def call_layer(layer, h, mask, pli, shared, cache=None):
        # A sharer's queries take their RoPE offset from the caller; a donor's from the cache.
        offset = None if shared is None else (cache.offset if cache is not None else 0)
        h, kv, _ = layer(h, mask, cache, per_layer_input=pli, shared_kv=shared, offset=offset)
        return h, kv

    head = Head(inner.norm, lm, outer.final_logit_softcapping)
    return Stack(model_type, layers, path, embed, head, list(args.layer_types),
                 window=args.sliding_window, kv_source=list(inner.previous_kvs),
                 call_layer=call_layer)
