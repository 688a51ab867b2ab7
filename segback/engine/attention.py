"""Attention for training, as a drop-in for mlx-lm's `scaled_dot_product_attention`: each call
goes to the fastest kernel that is exact for its mask and keeps the backward O(L).

- `attention="fused"` (the default) takes the fastest exact kernel per call (`fused_sdpa`): on
  CUDA, MLX's own fused kernel where it runs forward and backward fused (causal, head dim <= 128,
  16-bit, up to MLX_FUSED_MAX_LEN keys), segback's flash kernel (`segback.engine.flash`) for the
  rest (head dims 256 and 512, sliding windows, packed examples, longer sequences); elsewhere
  mlx-lm's own path.
- `attention="chunked"` runs `segback.engine.chunked`, an O(L) kernel of MLX ops, on every
  device.
- `use_attention` swaps the routing into mlx-lm's model modules for the length of a block.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Any

import mlx.core as mx
from mlx_lm.models import base as _base

from segback.engine import flash
from segback.engine.chunked import (Rows, attention_backward, attention_forward, attention_shape,
                                    chunked_sdpa)
from segback.engine.masks import Blocks, MaskSpec

# mlx-lm's own function, captured before any patching: the fallback for what we do not handle.
_MLX_SDPA = _base.scaled_dot_product_attention


# MLX's fused VJP on CUDA runs only for query lengths that are a multiple of its tile.
MLX_FUSED_TILE = 128
# Past this many keys MLX's CUDA backward ran out of memory as if it scored every key.
MLX_FUSED_MAX_LEN = 32768


def fast_kernel_for(head_dim: int, half: bool, masked: bool, length: int) -> str | None:
    """The O(L) fused kernel a layer runs on CUDA: "mlx" where MLX's own attention runs fused
    in both directions (cuDNN: causal, head dims up to 128 in multiples of 8, 16-bit, up to
    MLX_FUSED_MAX_LEN keys), "flash" (segback's) for the rest it handles, None where neither
    does. `masked`: a window or packed examples; `length`: keys per call. The engine
    (`fused_kernel`) and the planner (`CostModel.kernel`) both ask this."""
    if not half:
        return None
    if (not masked and head_dim <= 128 and head_dim % 8 == 0
            and length + (-length % MLX_FUSED_TILE) <= MLX_FUSED_MAX_LEN):
        return "mlx"
    return "flash" if head_dim in flash.HEAD_DIMS else None


def mlx_fused_covers(queries: mx.array, keys: mx.array, window: int | None,
                     blocks: Blocks | None) -> bool:
    """Whether MLX's own fused attention runs this training call fused in both directions;
    what it does not cover it runs composed, scoring every key into [L, L] arrays."""
    D = queries.shape[-1]
    half = queries.dtype in (mx.bfloat16, mx.float16)
    masked = window is not None or blocks is not None
    return (flash.available() and keys.shape[-1] == D and queries.shape[2] == keys.shape[2]
            and fast_kernel_for(D, half, masked, keys.shape[2]) == "mlx")


def fused_kernel(queries: mx.array, keys: mx.array, window: int | None = None,
                 blocks: Blocks | None = None) -> str:
    """The kernel `attention="fused"` runs for this call: "mlx" (MLX's fused), "flash"
    (segback's, CUDA), or "composed" (mlx-lm's own path with its mask array)."""
    if window is not None and window >= keys.shape[2]:
        window = None
    if mlx_fused_covers(queries, keys, window, blocks):
        return "mlx"
    if flash.supports(queries, keys):
        return "flash"
    return "composed"


# segback's flash v2 (128 query rows a CTA of 8 warps, cp.async pipelined) is faster than v1
# once a call has enough query rows over all heads to fill the GPU with its larger CTAs, slower
# below: on one H100 (bench/RESULTS.md, runs h100-run25 and h100-run27) e4b's 4096-row tiles
# over 8 heads (32768 rows) ran 7% slower a step, its untiled 8K step (65536) 9% faster, and
# Llama-8B's heads (32 x 8K and more) 25-33% faster in attention alone.
FLASH_V2_MIN_ROWS = 65536


def flash_variant(queries: mx.array) -> str:
    """The flash kernel variant for a call of these queries [B, H, Lq, D]."""
    B, H, Lq, _ = queries.shape
    return "v2" if B * H * Lq >= FLASH_V2_MIN_ROWS else "v1"


# cuDNN failed to build its fused backward's graph for a call whose float32 dQ accumulator
# (batch x heads x length x head dim) was 2^31 bytes; calls stay below that in head groups
# (a guard: that call was also past MLX_FUSED_MAX_LEN, so which limit it hit is not known).
MLX_FUSED_MAX_ELEMENTS = 1 << 28


def mlx_heads_per_call(B: int, H: int, Hkv: int, L: int, D: int,
                       max_elements: int = MLX_FUSED_MAX_ELEMENTS) -> int:
    """The most query heads one MLX fused call may take: a divisor of H that keeps whole KV
    groups together (or splits one group evenly) with B * heads * L * D <= max_elements."""
    rep = H // Hkv
    fits = [h for h in range(1, H + 1) if H % h == 0 and (h % rep == 0 or rep % h == 0)
            and B * h * L * D <= max_elements]
    return max(fits, default=1)


def mlx_causal(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
               max_elements: int = MLX_FUSED_MAX_ELEMENTS) -> mx.array:
    """MLX's fused causal attention, the sequence zero-padded to a multiple of MLX_FUSED_TILE:
    causal, so no real query sees a padded key, and the padded queries, sliced off, send back
    no cotangent (their dS is exactly zero). Heads are independent, so a call too large for
    cuDNN runs as head groups (`mlx_heads_per_call`), exactly the same arithmetic per head."""
    B, H, L, D = queries.shape
    pad = -L % MLX_FUSED_TILE
    if pad:
        widths = [(0, 0), (0, 0), (0, pad), (0, 0)]
        queries, keys, values = (mx.pad(x, widths) for x in (queries, keys, values))
    Hkv = keys.shape[1]
    h = mlx_heads_per_call(B, H, Hkv, L + pad, D, max_elements)
    if h == H:
        out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale,
                                                   mask="causal")
    else:
        rep = H // Hkv
        kv_per_call = max(h // rep, 1)
        qs = mx.split(queries, H // h, axis=1)
        ks = mx.split(keys, Hkv // kv_per_call, axis=1)
        vs = mx.split(values, Hkv // kv_per_call, axis=1)
        kv = [(i * h // rep) // kv_per_call for i in range(len(qs))]
        out = mx.concatenate(
            [mx.fast.scaled_dot_product_attention(q, ks[j], vs[j], scale=scale, mask="causal")
             for q, j in zip(qs, kv)], axis=1)
    return out[:, :, :L] if pad else out


def fused_sdpa(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
               mask: MaskSpec) -> mx.array:
    """Attention through the fastest exact kernel for this call (`fused_kernel`)."""
    window = mask.window if mask.kind == "sliding" else None
    kernel = fused_kernel(queries, keys, window, mask.blocks)
    if kernel == "mlx":
        return mlx_causal(queries, keys, values, scale)
    if kernel == "flash":
        return flash.flash_attention(queries, keys, values, scale, window, mask.blocks,
                                     variant=flash_variant(queries))
    return _MLX_SDPA(queries, keys, values, cache=None, scale=scale,
                     mask=mask.to_mlx(queries.shape[2], keys.shape[2]))


def fused_routed() -> bool:
    """Whether `attention="fused"` goes through segback's dispatch (CUDA, where MLX's fused
    kernel leaves cases out); elsewhere mlx-lm's own attention runs unrouted."""
    return flash.available()


def core_forward(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                 mask: MaskSpec, kind: str) -> tuple[mx.array, Any]:
    """A whole sequence's attention output for the tiled engine, and what `core_backward` needs
    of the forward besides Q, K, V (the flash kernel's row LSE). `kind` is the engine option
    ("fused" or "chunked"); where no fused kernel covers the call, it runs chunked (the tiled
    engine never materializes a mask)."""
    B, H, L, _ = queries.shape
    window = mask.window if mask.kind == "sliding" else None
    if kind == "fused":
        kernel = fused_kernel(queries, keys, window, mask.blocks)
        if kernel == "mlx":
            return mlx_causal(queries, keys, values, scale), "mlx"
        if kernel == "flash":
            return flash.flash_forward(queries, keys, values, scale, window, mask.blocks,
                                       variant=flash_variant(queries))
    window, chunk = attention_shape(B, H, L, keys.shape[2], window)
    return attention_forward(queries, keys, values, scale, window, chunk, mask.blocks), None


def core_backward(queries: mx.array, keys: mx.array, values: mx.array, saved: Any,
                  d_output: Rows, delta: Rows, scale: float, mask: MaskSpec
                  ) -> tuple[Rows, mx.array, mx.array]:
    """(dQ as `Rows`, dK, dV) of `core_forward`, from dO and rowsum(dO * O) kept in pieces."""
    B, H, L, _ = queries.shape
    window = mask.window if mask.kind == "sliding" else None
    if saved is None:
        window, chunk = attention_shape(B, H, L, keys.shape[2], window)
        return attention_backward(queries, keys, values, None, d_output, scale, window, chunk,
                                  delta=delta, dq_rows=True, blocks=mask.blocks)
    do = d_output(0, L)
    if isinstance(saved, str):  # MLX's kernel: its VJP recomputes the forward (with its LSE)
        _, (dq, dk, dv) = mx.vjp(lambda q, k, v: mlx_causal(q, k, v, scale),
                                 [queries, keys, values], [do])
    else:
        dq, dk, dv = flash.flash_backward(queries, keys, values, None, saved, do, scale,
                                          window, mask.blocks, delta=delta(0, L),
                                          variant=flash_variant(queries))
    return Rows([dq]), dk, dv


def _is_causal_string(mask: Any) -> bool:
    return isinstance(mask, str) and mask == "causal"


def sdpa_for_mlx_lm(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: Any,
    scale: float,
    mask: mx.array | str | MaskSpec | None,
    sinks: mx.array | None = None,
    *,
    kind: str = "chunked",
    chunk_size: int | None = None,
) -> mx.array:
    """`mlx_lm.models.base.scaled_dot_product_attention` with the O(L) backward where it applies.

    Training calls (no KV cache, no sinks) with mask "causal" or a `MaskSpec` go to
    `chunked_sdpa` (`kind="chunked"`) or `fused_sdpa`
    (`kind="fused"`). Everything else keeps mlx-lm's path (a `MaskSpec` made into mlx-lm's mask):
    inference with a cache, attention sinks, explicit mask arrays (which we cannot read without
    evaluating them) and `mask=None`.
    """
    hook = getattr(cache, "segback_attend", None)
    if hook is not None:  # the tiled engine's stand-in cache (segback.engine.tiled.TileCache)
        return hook(queries, keys, values, scale)
    chunkable = isinstance(mask, MaskSpec) or _is_causal_string(mask)
    if cache is not None or sinks is not None or not chunkable:
        if isinstance(mask, MaskSpec):
            mask = mask.to_mlx(queries.shape[2], keys.shape[2])
        return _MLX_SDPA(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
    if kind == "fused":
        spec = mask if isinstance(mask, MaskSpec) else MaskSpec("causal")
        return fused_sdpa(queries, keys, values, scale, spec)
    window = mask.window if isinstance(mask, MaskSpec) and mask.kind == "sliding" else None
    blocks = mask.blocks if isinstance(mask, MaskSpec) else None
    return chunked_sdpa(queries, keys, values, scale, window=window, chunk_size=chunk_size,
                        blocks=blocks)


@contextlib.contextmanager
def use_attention(
    modules: Sequence[ModuleType | str], kind: str = "chunked", chunk_size: int | None = None
) -> Iterator[None]:
    """Route the given mlx-lm model modules' attention through `sdpa_for_mlx_lm` (`kind`:
    "chunked" or "fused"), then restore.

    mlx-lm model files import `scaled_dot_product_attention` from `.base` by name, so the name is
    swapped in each module (e.g. `mlx_lm.models.llama`, or the string "mlx_lm.models.llama").
    """
    def sdpa(queries, keys, values, cache, scale, mask, sinks=None):
        return sdpa_for_mlx_lm(
            queries, keys, values, cache, scale, mask, sinks, kind=kind, chunk_size=chunk_size
        )

    with swap_attention(modules, sdpa):
        yield


@contextlib.contextmanager
def swap_attention(modules: Sequence[ModuleType | str], sdpa: Any) -> Iterator[None]:
    """Put `sdpa` in place of each module's `scaled_dot_product_attention`, then restore."""
    mods = [importlib.import_module(m) if isinstance(m, str) else m for m in modules]
    saved = [(m, m.scaled_dot_product_attention) for m in mods]
    try:
        for m in mods:
            m.scaled_dot_product_attention = sdpa
        yield
    finally:
        for m, original in reversed(saved):
            m.scaled_dot_product_attention = original
