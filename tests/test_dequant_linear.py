"""segback.models.dequant_linear: dequantize-then-matmul equals mlx's quantized matmul to float32
rounding, and segmented backward on a swapped quantized model stays equal to mlx-lm's."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.tuner.trainer import default_loss

from segback.models.dequant_linear import use_dequantized_matmul
from tests.test_engine import assert_matches, batch_of, lora_model


def _loss_and_grads(model, batch, lengths):
    (loss, _), grads = nn.value_and_grad(model, default_loss)(model, batch, lengths)
    return float(loss), dict(tree_flatten(grads))


def test_swap_counts_and_short_inputs_keep_the_quantized_kernel():
    model = lora_model("tiny-llama", quantize_bits=4)
    n = sum(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules())
    assert n > 0 and use_dequantized_matmul(model, min_tokens=8) == n
    assert use_dequantized_matmul(model) == 0  # already swapped
    lin = next(m for _, m in model.named_modules() if isinstance(m, nn.QuantizedLinear))
    x = mx.random.normal((1, 3, lin.weight.shape[1] * 32 // lin.bits), key=mx.random.key(1))
    ref = mx.quantized_matmul(x, lin.weight, lin.scales, lin.biases, group_size=lin.group_size,
                              bits=lin.bits)
    assert mx.array_equal(lin(x), ref)  # 3 tokens < 8: the quantized kernel itself
    wide = mx.concatenate([x] * 4, axis=0)  # a batch of 4 x 3 tokens: still by tokens
    assert mx.array_equal(lin(wide), mx.concatenate([ref] * 4, axis=0))
    x = mx.concatenate([x] * 4, axis=1)
    ref = mx.concatenate([ref] * 4, axis=1)
    assert mx.allclose(lin(x), ref, rtol=1e-5, atol=1e-5)  # 12 tokens: dequantized


def test_swapped_model_is_the_stock_model_to_float32_rounding():
    model = lora_model("tiny-llama", quantize_bits=4)
    batch, lengths = batch_of(model.args.vocab_size)
    l0, g0 = _loss_and_grads(model, batch, lengths)
    use_dequantized_matmul(model, min_tokens=1)
    l1, g1 = _loss_and_grads(model, batch, lengths)
    assert abs(l1 - l0) <= 1e-6 * abs(l0)
    for k in g0:
        err = float(mx.linalg.norm(g1[k] - g0[k])) / float(mx.linalg.norm(g0[k]))
        assert err <= 1e-5, (k, err)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-e4b"])
def test_segmented_backward_stays_exact_on_the_swapped_model(name):
    model = lora_model(name, quantize_bits=4)
    use_dequantized_matmul(model, min_tokens=1)
    assert_matches(model, 1, *batch_of(model.args.vocab_size))


def test_tiled_compiled_engine_on_the_swapped_model():
    """Tile functions trace the swapped linears (compiled on the CPU); reference: mlx-lm's
    value_and_grad on the same swapped model."""
    from segback.engine import value_and_grad
    from tests.test_engine import TOL, assert_close

    model = lora_model("tiny-e4b", quantize_bits=4, num_layers=3)
    use_dequantized_matmul(model, min_tokens=1)
    batch, lengths = batch_of(model.args.vocab_size, T=50)
    (l0, _), g0 = nn.value_and_grad(model, default_loss)(model, batch, lengths)
    (l1, _), g1 = value_and_grad(model, batch, lengths, 2, tile=16, offload=True)
    assert abs(float(l1) - float(l0)) <= TOL * abs(float(l0))
    assert_close(g0, g1)
