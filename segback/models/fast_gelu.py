"""Gemma's GELU (tanh approximation) from multiplies and adds, for MLX's CPU backend.

MLX's CPU `tanh` and `exp` are scalar calls, so on a Linux CPU the MLP activation of Gemma-2/3
costs several times the matmul that feeds it and dominates a training step. Here tanh is Eigen's
float32 rational approximation (odd 13th over even 6th degree, clamped at ±9; within 4e-7 of
tanh), fused into one kernel by `mx.compile`, and the derivative is written out so that the
backward is one fused kernel too instead of a graph of a dozen elementwise passes.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma2, gemma3_text

# Eigen's generic_fast_tanh_float: numerator (odd powers 1..13) and denominator (even 0..6).
_NUM = (4.89352455891786e-03, 6.37261928875436e-04, 1.48572235717979e-05,
        5.12229709037114e-08, -8.60467152213735e-11, 2.00018790482477e-13,
        -2.76076847742355e-16)
_DEN = (4.89352518554385e-03, 2.26843463243900e-03, 1.18534705686654e-04,
        1.19825839466702e-06)
_C = math.sqrt(2.0 / math.pi)
_K = 0.044715


def _tanh(x: mx.array) -> mx.array:
    x = mx.clip(x, -9.0, 9.0)
    x2 = x * x
    p = _NUM[-1]
    for a in reversed(_NUM[:-1]):
        p = p * x2 + a
    q = _DEN[-1]
    for b in reversed(_DEN[:-1]):
        q = q * x2 + b
    return x * p / q


@mx.compile
def _forward(x: mx.array) -> mx.array:
    return 0.5 * x * (1.0 + _tanh(_C * (x + _K * x * x * x)))


@mx.compile
def _backward(x: mx.array, cotangent: mx.array) -> mx.array:
    t = _tanh(_C * (x + _K * x * x * x))
    slope = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _C * (1.0 + 3.0 * _K * x * x)
    return cotangent * slope


@mx.custom_function
def gelu_approx(x: mx.array) -> mx.array:
    """`mlx.nn.gelu_approx` to float32 rounding, at a fraction of its cost on the CPU."""
    return _forward(x)


@gelu_approx.vjp
def _gelu_approx_vjp(x, cotangent, output):  # one input: MLX passes it bare, not in a tuple
    return _backward(x, cotangent)


def _fast_mlp_class(base: type) -> type:
    """`base` (a Gemma MLP: down(gelu_approx(gate(x)) * up(x))) with this module's GELU."""

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(gelu_approx(self.gate_proj(x)) * self.up_proj(x))

    return type(base.__name__, (base,), {"__call__": __call__, "__module__": __name__})


# mlx-lm's MLPs whose forward is exactly down(gelu_approx(gate(x)) * up(x)), and their swaps.
_FAST_MLPS = {cls: _fast_mlp_class(cls) for cls in (gemma2.MLP, gemma3_text.MLP)}


def use_fast_gelu(model: nn.Module) -> int:
    """Swap the GELU of every Gemma-2/3 MLP in `model` for `gelu_approx` above, in place.

    Parameters, LoRA layers and checkpoints are untouched (the class changes, not the module
    tree). Returns how many MLPs were swapped; other architectures are left as they are.
    """
    count = 0
    for _, module in model.named_modules():
        fast = _FAST_MLPS.get(type(module))
        if fast is not None:
            module.__class__ = fast
            count += 1
    return count
