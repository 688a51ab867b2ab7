"""Quantized linears that run long inputs as dequantize-then-matmul.

Training pushes thousands of tokens through each frozen quantized linear three times a step
(forward, recompute, input gradient). `mx.quantized_matmul` dequantizes inside its kernel; where
that kernel reaches a small share of the device's dense matmul rate, materializing the layer's
weight in the compute dtype for the one matmul and dropping it after is faster, at the cost of
one transient weight (52 MB for an e4b MLP projection in bf16); the backward dequantizes again,
so nothing dense is kept between the passes. Short inputs (decoding) keep the quantized kernel,
which reads 4x fewer bytes. Modes without biases (e.g. mxfp4) keep it too.
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx
import mlx.nn as nn

MIN_TOKENS = 256  # tokens per sequence from which the dense path is taken


@cache
def _dense_matmul(group_size: int, bits: int, mode: str):
    """x @ dequantize(w).T whose backward dequantizes again instead of keeping the dense weight:
    a segment's graph then holds only the quantized weights, as with `quantized_matmul`."""

    def dense(w, scales, biases, dtype):
        w = mx.dequantize(w, scales, biases, group_size=group_size, bits=bits, mode=mode)
        return w.astype(dtype)

    @mx.custom_function
    def matmul(x, w, scales, biases):
        return x @ dense(w, scales, biases, x.dtype).T

    @matmul.vjp
    def matmul_vjp(primals, cotangent, output):
        x, w, scales, biases = primals
        dx = cotangent @ dense(w, scales, biases, cotangent.dtype)
        return dx, mx.zeros_like(w), mx.zeros_like(scales), mx.zeros_like(biases)

    return matmul


@cache
def _dense_class(base: type) -> type:
    def __call__(self, x: mx.array) -> mx.array:
        # by tokens per sequence, not rows in the batch: a prompt takes the same path decoded
        # alone or batched, so batched greedy decoding stays equal to unbatched
        tokens = x.shape[-2] if x.ndim > 1 else 1
        if tokens < self.dense_min_tokens or self.get("biases") is None:
            return base.__call__(self, x)
        matmul = _dense_matmul(self.group_size, self.bits, self.mode)
        y = matmul(x, self["weight"], self["scales"], self["biases"])
        return y + self["bias"] if "bias" in self else y

    return type(f"Dense{base.__name__}", (base,), {"__call__": __call__})


def use_dequantized_matmul(model: nn.Module, min_tokens: int = MIN_TOKENS) -> int:
    """Swap every `nn.QuantizedLinear` of `model` in place; return how many were swapped."""
    n = 0
    for _, m in model.named_modules():
        if isinstance(m, nn.QuantizedLinear) and not hasattr(m, "dense_min_tokens"):
            m.__class__ = _dense_class(type(m))
            m.dense_min_tokens = min_tokens
            n += 1
    return n
