"""segback.models.fast_gelu: mlx.nn.gelu_approx to float32 rounding, and the swap into Gemma MLPs
keeps segmented backward equal to mlx-lm's value_and_grad on the swapped model."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.tuner.trainer import default_loss

from segback.models.fast_gelu import gelu_approx, use_fast_gelu
from segback.models.load import load
from tests.test_engine import assert_matches, batch_of, lora_model


def test_values_and_gradient_match_mlx():
    x = mx.concatenate([mx.linspace(-30, 30, 200_001), mx.array([0.0, 1e-8, -1e-8])])
    assert mx.abs(gelu_approx(x) - nn.gelu_approx(x)).max().item() <= 2e-6
    cot = mx.random.normal(x.shape, key=mx.random.key(0))
    (_,), (ours,) = mx.vjp(gelu_approx, [x], [cot])
    (_,), (ref,) = mx.vjp(nn.gelu_approx, [x], [cot])
    assert mx.abs(ours - ref).max().item() <= 2e-5
    # large |x|: the slope is exactly 0 below and 1 above, as the reference's
    assert mx.grad(lambda v: gelu_approx(v).sum())(mx.array([-30.0, 30.0])).tolist() == [0.0, 1.0]


def test_swap_counts_and_leaves_other_models():
    gemma = lora_model("tiny-gemma3")
    assert use_fast_gelu(gemma) == len(gemma.layers)
    assert type(gemma.layers[0].mlp).__module__ == "segback.models.fast_gelu"
    assert use_fast_gelu(gemma) == 0  # already swapped
    assert use_fast_gelu(lora_model("tiny-llama")) == 0


def _loss_and_grads(model, batch, lengths, loss=default_loss):
    (value, _), grads = nn.value_and_grad(model, loss)(model, batch, lengths)
    return value.astype(mx.float64).item(), {k: g.astype(mx.float64)
                                             for k, g in tree_flatten(grads)}


def _loss64(model, batch, lengths):
    """mlx-lm's default_loss without its cast of the logits to float32: the float64 reference."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    steps = mx.arange(1, targets.shape[1] + 1)
    mask = mx.logical_and(steps >= lengths[:, 0:1], steps <= lengths[:, 1:])
    ntoks = mask.sum()
    return (nn.losses.cross_entropy(model(inputs), targets) * mask).sum() / ntoks, ntoks


def test_swapped_model_is_the_stock_model_to_float32_rounding():
    """The swap costs at most one more float32 rounding's worth of error: against a float64 run
    of the stock model, the swapped float32 model is no further than twice the stock float32
    model (whose own distance is this machine's float32 rounding of the whole computation,
    which differs between BLAS libraries and processors, so a fixed bound fits one of them),
    plus a few units of float32 rounding for values the stock model happens to hit exactly."""
    model = lora_model("tiny-gemma3")
    batch, lengths = batch_of(model.args.vocab_size)
    l0, g0 = _loss_and_grads(model, batch, lengths)
    model.set_dtype(mx.float64)  # exact both ways: float32 -> float64 -> float32
    l64, g64 = _loss_and_grads(model, batch, lengths, _loss64)
    model.set_dtype(mx.float32)
    use_fast_gelu(model)
    l1, g1 = _loss_and_grads(model, batch, lengths)
    unit = 2.0 ** -24  # float32 unit roundoff
    assert abs(l1 - l64) <= 2 * abs(l0 - l64) + 4 * unit * abs(l64), (l0, l1, l64)
    for k in g0:
        scale = float(mx.linalg.norm(g64[k]))
        stock = float(mx.linalg.norm(g0[k] - g64[k])) / scale
        swapped = float(mx.linalg.norm(g1[k] - g64[k])) / scale
        assert swapped <= 2 * stock + 4 * unit, (k, swapped, stock)


@pytest.mark.parametrize("segments", [[(0, 6)], 1])
def test_segmented_backward_stays_exact_on_the_swapped_model(segments):
    model = lora_model("tiny-gemma3")
    use_fast_gelu(model)
    assert_matches(model, segments, *batch_of(model.args.vocab_size))


def test_load_swaps_on_the_cpu_unless_told_not_to():
    assert mx.default_device() == mx.cpu
    fast, _ = load("tiny-gemma3")
    stock, _ = load("tiny-gemma3", fast_gelu=False)
    assert type(fast.layers[0].mlp).__module__ == "segback.models.fast_gelu"
    assert type(stock.layers[0].mlp).__module__ == "mlx_lm.models.gemma3_text"
