"""The fused loss head (issue 42): loss and dh equal autodiff's and mlx-lm's, in every head shape
the stack adapters build (untied, tied, minicpm's scaled head, softcap, 4-bit) and every mask
(prompts per row, one range, packed rows)."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_map
from test_engine import _cast, assert_matches, batch_of, lora_model

import segback.engine.head as head_module
from segback.engine import Packed
from segback.engine.head import contiguous, head_vjp, loss_mask
from segback.engine.stack import Head, get_stack
from segback.models.random_init import geometry_config

EPS32 = float(np.finfo(np.float32).eps)


def hidden(model, B, T, seed=5):
    mx.random.seed(seed)
    return mx.random.normal((B, T - 1, model.args.hidden_size))


def masks(vocab, T=40):
    """(batch, lengths) per mask kind; `contiguous` says which take the slice path."""
    batch2, lengths2 = batch_of(vocab, B=2, T=T)
    batch1, _ = batch_of(vocab, B=1, T=T)
    segments = np.array([[1] * 12 + [2] * 20 + [3] * 5 + [0] * 3], np.int32)
    targets = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] > 0)
    targets[0, :4] = False  # a prompt in the first example
    return {
        "prompts": (batch2, np.array(lengths2)),            # two rows: gathered
        "prefix": (batch1, np.array([[6, T - 1]])),         # B=1 prompt prefix: one range
        "all": (batch1, np.array([[0, T]])),                # every target: one range
        "packed": (batch1, Packed(segments, targets)),      # gaps between examples: gathered
    }


def spy_fused(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = head_module.fused_chunk

    def counted(*args):
        calls.append(1)
        return real(*args)
    monkeypatch.setattr(head_module, "fused_chunk", counted)
    return calls


def run_head(model, h, batch, lengths, fused, max_elements):
    stack = get_stack(model)
    loss, ntoks, dh, _ = head_vjp(stack.head, h, batch, lengths, model.args.vocab_size,
                                  max_elements=max_elements, fused=fused)
    mx.eval(loss, dh)
    return loss, ntoks, dh


def float64_head(head: Head) -> Head:
    """`head` of a model cast to float64; a 4-bit LM head as its dequantized weight (MLX has no
    float64 quantized matmul VJP), which is the matrix the 4-bit one multiplies by."""
    m = getattr(head.linear, "__self__", head.linear)  # a tied embedding's as_linear
    if not hasattr(m, "bits"):
        return head
    w = mx.dequantize(m.weight, m.scales, m.biases, m.group_size, m.bits)
    assert w.dtype == mx.float64
    return Head(head.norm, lambda x: x @ w.T, head.softcap)


def exact_head(model, h, batch, lengths):
    """Loss and dh of the whole head in float64, unchunked (mlx-lm's cross-entropy)."""
    rows = mx.array(np.flatnonzero(loss_mask(lengths, batch.shape[1]).reshape(-1)))
    targets = batch[:, 1:].reshape(-1)[rows]
    head = get_stack(model).head
    _cast(model, mx.float32, mx.float64)
    try:
        head = float64_head(head)
        def loss(x):
            x = x.reshape(-1, x.shape[-1])[rows]
            return nn.losses.cross_entropy(head(x), targets).sum() / rows.size

        out, dh = mx.value_and_grad(loss)(h.astype(mx.float64))
        mx.eval(out, dh)
    finally:
        _cast(model, mx.float64, mx.float32)
    assert out.dtype == dh.dtype == mx.float64
    return float(out), dh


# A softcap of 0.5 saturates tanh (tiny-e4b's logits reach several units), where 1 - tanh^2
# is small and its rounding matters.
SATURATED = geometry_config("tiny-e4b", final_logit_softcapping=0.5)
HEADS = [("tiny-llama", None), ("tiny-qwen3", None), ("tiny-minicpm", None),
         ("tiny-gemma3", None), ("tiny-e4b", None),
         pytest.param(SATURATED, None, id="saturated-softcap"), ("tiny-llama", 4),
         ("tiny-e4b", 4)]


@pytest.mark.parametrize("name,bits", HEADS)
@pytest.mark.parametrize("kind", ["prompts", "prefix", "all", "packed"])
def test_fused_head_is_as_exact_as_autodiff(name, bits, kind, monkeypatch):
    """Loss and dh of the fused head against the float64 head, no further from it than the
    autodiff head in float32 is, or than float32 rounding of a sum over the vocabulary can be.

    Both paths evaluate the same expression in float32 in another order; their sums run over at
    most V terms (the log-sum-exp; dlogits @ W), whose roundings of relative size eps add up
    like a random walk: sqrt(V) * eps relative, times 4 for four standard deviations. A wrong
    softcap derivative, target or row is far above either bound."""
    model = lora_model(name, quantize_bits=bits)
    head = get_stack(model).head
    capped = model.args.model_type == "gemma4_text"
    assert isinstance(head, Head) and (head.softcap is not None) == capped
    V = model.args.vocab_size
    batch, lengths = masks(V)[kind]
    h = hidden(model, *batch.shape)
    rows = np.flatnonzero(loss_mask(lengths, batch.shape[1]).reshape(-1))
    assert contiguous(rows) == (kind in ("prefix", "all"))
    max_elements = V * 7  # chunks of 7 rows and a shorter last one
    calls = spy_fused(monkeypatch)
    l1, n1, d1 = run_head(model, h, batch, lengths, True, max_elements)
    assert len(calls) == math.ceil(rows.size / 7) and int(n1) == rows.size
    l0, n0, d0 = run_head(model, h, batch, lengths, False, max_elements)
    assert len(calls) == math.ceil(rows.size / 7) and int(n0) == rows.size
    exact, d64 = exact_head(model, h, batch, lengths)
    rtol = 4 * math.sqrt(V) * EPS32
    assert abs(float(l1) - exact) <= max(2 * abs(float(l0) - exact), rtol * abs(exact))
    norm = float(mx.linalg.norm(d64))
    err0, err1 = (float(mx.linalg.norm(d.astype(mx.float64) - d64)) for d in (d0, d1))
    assert norm > 0 and err1 <= max(2 * err0, rtol * norm), (err1, err0, norm)
    # rows that count no target get no gradient
    flat = np.array(d1.reshape(-1, d1.shape[-1]))
    assert not np.delete(flat, rows, axis=0).any() and flat[rows].any(axis=1).all()


@pytest.mark.parametrize("name,bits", [("tiny-llama", None), ("tiny-e4b", None),
                                       ("tiny-qwen3", 4)])
@pytest.mark.parametrize("kind", ["prefix", "all"])
def test_contiguous_rows_match_mlx_lm(name, bits, kind):
    """The engine with the slice path (B=1) against `nn.value_and_grad(model, default_loss)`;
    the engine tests cover the gathered rows."""
    model = lora_model(name, quantize_bits=bits)
    batch, lengths = masks(model.args.vocab_size)[kind]
    assert_matches(model, 2, batch, mx.array(lengths), head_chunk=model.args.vocab_size * 9)


def test_trainable_head_leaves_take_autodiff(monkeypatch):
    """A trainable final norm is a head leaf: its gradient needs autodiff of the whole head."""
    model = lora_model("tiny-llama")
    model.model.norm.unfreeze()
    calls = spy_fused(monkeypatch)
    assert_matches(model, 2, *batch_of(256))
    assert calls == []


def test_plain_callable_head_takes_autodiff(monkeypatch):
    """A head the adapters did not take apart runs as before; its result equals the fused one."""
    model = lora_model("tiny-e4b")
    head = get_stack(model).head
    batch, lengths = masks(256)["prefix"]
    h = hidden(model, *batch.shape)
    calls = spy_fused(monkeypatch)
    l0, _, d0, _ = head_vjp(lambda x: head(x), h, batch, lengths, 256)
    assert calls == []
    l1, _, d1, _ = head_vjp(head, h, batch, lengths, 256)
    assert calls == [1]
    rtol = 4 * math.sqrt(256) * EPS32
    assert abs(float(l1) - float(l0)) <= rtol * abs(float(l0))
    assert float(mx.linalg.norm(d1 - d0)) <= rtol * float(mx.linalg.norm(d0))


def test_fused_head_keeps_bfloat16_gradients():
    """dlogits go back through the LM head in the logits' dtype (no float32 copy of W), and
    the loss is float32."""
    model = lora_model("tiny-e4b")
    model.update(tree_map(lambda p: p.astype(mx.bfloat16), model.parameters()))
    batch, lengths = masks(256)["prompts"]
    h = hidden(model, *batch.shape).astype(mx.bfloat16)
    loss, _, dh = run_head(model, h, batch, lengths, True, 256 * 7)
    assert loss.dtype == mx.float32 and dh.dtype == mx.bfloat16
    l0, _, d0 = run_head(model, h, batch, lengths, False, 256 * 7)
    # bfloat16 keeps 8 bits: both paths agree to a few of its ulps
    assert abs(float(loss) - float(l0)) <= 4 * 2.0**-8 * abs(float(l0))
    err = float(mx.linalg.norm((dh - d0).astype(mx.float32)))
    assert err <= 4 * 2.0**-8 * float(mx.linalg.norm(d0.astype(mx.float32)))
