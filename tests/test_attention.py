"""chunked_sdpa: values and all three gradients equal mx.fast's, and the mlx-lm patch is exact."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import base, gemma3_text, gemma4_text, llama
from mlx_lm.models.base import create_causal_mask

from segback.engine.masks import MaskSpec
from segback.engine.chunked import (
    Rows,
    attention_backward,
    attention_forward,
    chunked_sdpa,
    default_chunk_size,
)
from segback.engine.attention import mlx_causal, mlx_heads_per_call, sdpa_for_mlx_lm, use_attention
from segback.models.random_init import build_model

RTOL = 1e-5


def _inputs(B, H, Hkv, Lq, D, Lk=None, seed=0):
    Lk = Lk or Lq
    keys = mx.random.split(mx.random.key(seed), 4)
    shapes = [(B, H, Lq, D), (B, Hkv, Lk, D), (B, Hkv, Lk, D), (B, H, Lq, D)]
    return [mx.random.normal(s, key=k) for s, k in zip(shapes, keys)]


def _reference(q, k, v, scale, window):
    Lq, Lk = q.shape[2], k.shape[2]
    mask = "causal"
    if window is not None:
        mask = create_causal_mask(Lq, offset=Lk - Lq, window_size=window)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def _assert_close(got, want, rtol=RTOL, atol=0.0):
    err = mx.abs(got - want).max().item()
    assert err <= rtol * mx.abs(want).max().item() + atol, err


CASES = [
    # B, H, Hkv, L, D, window, chunk, Lk
    (1, 4, 4, 37, 16, None, 16, None),  # causal, ragged last chunk
    (2, 4, 2, 101, 32, None, 16, None),  # GQA 2, B=2
    (2, 4, 1, 101, 16, None, 16, None),  # GQA 4 (one KV head)
    (1, 4, 2, 101, 16, 7, 16, None),  # window smaller than the chunk, not dividing L
    (1, 4, 1, 101, 32, 40, 16, None),  # window larger than the chunk
    (2, 4, 2, 64, 16, 16, 16, None),  # window equal to the chunk, L a multiple
    (1, 4, 2, 37, 16, 100, 16, None),  # window wider than L: plain causal
    (1, 4, 2, 37, 16, None, 64, None),  # one chunk
    (1, 4, 2, 30, 16, None, 16, 50),  # fewer queries than keys (bottom-right causal)
    (1, 4, 2, 30, 16, 9, 16, 50),
]


@pytest.mark.parametrize("B,H,Hkv,L,D,window,chunk,Lk", CASES)
def test_matches_fused_values_and_grads(B, H, Hkv, L, D, window, chunk, Lk):
    q, k, v, cot = _inputs(B, H, Hkv, L, D, Lk)
    scale = D**-0.5
    want_out, want_grads = mx.vjp(lambda *a: _reference(*a, scale, window), [q, k, v], [cot])
    got_out, got_grads = mx.vjp(
        lambda *a: chunked_sdpa(*a, scale, window=window, chunk_size=chunk), [q, k, v], [cot]
    )
    _assert_close(got_out[0], want_out[0])
    for g, w, p in zip(got_grads, want_grads, (q, k, v)):
        assert g.shape == p.shape and g.dtype == p.dtype
        _assert_close(g, w)


@pytest.mark.parametrize("axis", [1, 2])
def test_rows_read_any_range_of_their_pieces(axis):
    """Rows give the rows [a, b) of the concatenation of their pieces, across piece edges."""
    mx.random.seed(4)
    sizes = [5, 1, 7, 3]
    shape = [2, 3, 4, 6]
    pieces = [mx.random.normal(shape[:axis] + [n] + shape[axis + 1:]) for n in sizes]
    whole, rows = mx.concatenate(pieces, axis=axis), Rows(pieces, axis=axis)
    lead = (slice(None),) * axis
    for a, b in [(0, 16), (0, 5), (4, 6), (5, 6), (6, 13), (2, 15), (15, 16)]:
        assert mx.array_equal(rows(a, b), whole[lead + (slice(a, b),)]), (a, b)
    rows.release(7)  # pieces [0, 5) and [5, 6) go; [6, 13) is still partly unread
    assert rows.pieces[0] is None and rows.pieces[1] is None and rows.pieces[2] is not None
    assert mx.array_equal(rows(6, 16), whole[lead + (slice(6, 16),)])


def test_backward_on_rows_equals_backward_on_arrays():
    """The tiled engine's call (dO, delta as Rows, dQ back as Rows) gives the same bits."""
    q, k, v, do = _inputs(1, 4, 2, 45, 8)
    o = attention_forward(q, k, v, 0.3, None, 16)
    delta = (do * o).sum(-1, keepdims=True)
    want = attention_backward(q, k, v, None, do, 0.3, None, 16, delta=delta)
    cut = [0, 10, 11, 30, 45]  # tiles that do not line up with the 16-row chunks
    tiles = [(a, b) for a, b in zip(cut, cut[1:])]
    got = attention_backward(q, k, v, None, Rows([do[:, :, a:b] for a, b in tiles]), 0.3, None,
                             16, delta=Rows([delta[:, :, a:b] for a, b in tiles]), dq_rows=True)
    assert isinstance(got[0], Rows)
    assert mx.array_equal(got[0](0, 45), want[0])
    assert mx.array_equal(got[1], want[1]) and mx.array_equal(got[2], want[2])


def test_bfloat16_returns_input_dtypes():
    q, k, v, cot = (x.astype(mx.bfloat16) for x in _inputs(1, 4, 2, 40, 16))
    out, grads = mx.vjp(lambda *a: chunked_sdpa(*a, 0.25, window=9, chunk_size=16), [q, k, v],
                        [cot])
    want_out, want_grads = mx.vjp(lambda *a: _reference(*a, 0.25, 9), [q, k, v], [cot])
    assert out[0].dtype == mx.bfloat16 and all(g.dtype == mx.bfloat16 for g in grads)
    for g, w in zip(out + grads, want_out + want_grads):
        _assert_close(g.astype(mx.float32), w.astype(mx.float32), rtol=3e-2)


def test_default_chunk_size():
    assert default_chunk_size(1, 4, 100, 100) == 100  # one chunk for short inputs
    assert default_chunk_size(1, 8, 32768, 32768) == 256  # budget-bound at long L
    assert default_chunk_size(1, 8, 32768, 32768, window=512) == 512  # at most the window
    assert default_chunk_size(1, 8, 32768, 32768, window=8) == 64  # but not below MIN_CHUNK


def test_sdpa_for_mlx_lm_routes_masks():
    q, k, v, _ = _inputs(1, 4, 2, 37, 16)
    want = _reference(q, k, v, 0.25, 8)
    _assert_close(sdpa_for_mlx_lm(q, k, v, None, 0.25, MaskSpec("sliding", 8)), want)
    array_mask = create_causal_mask(37, window_size=8)
    _assert_close(sdpa_for_mlx_lm(q, k, v, None, 0.25, array_mask), want)
    causal = _reference(q, k, v, 0.25, None)
    _assert_close(sdpa_for_mlx_lm(q, k, v, None, 0.25, "causal"), causal)
    _assert_close(sdpa_for_mlx_lm(q, k, v, None, 0.25, MaskSpec("causal")), causal)
    full = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=None)
    _assert_close(sdpa_for_mlx_lm(q, k, v, None, 0.25, None), full)
    # Sinks (or a cache) keep mlx-lm's path; a MaskSpec becomes mlx-lm's mask there.
    sinks = mx.zeros((4,))
    want = mx.fast.scaled_dot_product_attention(
        q, k, v, scale=0.25, mask=array_mask, sinks=sinks
    )
    _assert_close(sdpa_for_mlx_lm(q, k, v, None, 0.25, MaskSpec("sliding", 8), sinks), want)
    with pytest.raises(ValueError):
        MaskSpec("sliding")
    with pytest.raises(ValueError):
        MaskSpec("causal", 8)


def _loss(model, tokens):
    logits = model(tokens[:, :-1]).astype(mx.float32)
    return nn.losses.cross_entropy(logits, tokens[:, 1:]).mean()


@pytest.mark.parametrize(
    "geometry,module",
    [("tiny-llama", llama), ("tiny-gemma3", gemma3_text), ("tiny-e4b", gemma4_text)],
)
def test_patch_is_exact_on_mlx_lm_models(geometry, module):
    model = build_model(geometry)
    tokens = mx.random.randint(0, 256, (2, 41), key=mx.random.key(3))
    grad_fn = nn.value_and_grad(model, _loss)
    want_logits = model(tokens)
    want_loss, want_grads = grad_fn(model, tokens)
    original = module.scaled_dot_product_attention
    with use_attention([module], chunk_size=16):
        assert module.scaled_dot_product_attention is not original
        got_logits = model(tokens)
        got_loss, got_grads = grad_fn(model, tokens)
    assert module.scaled_dot_product_attention is original is base.scaled_dot_product_attention
    _assert_close(got_logits, want_logits)
    _assert_close(got_loss, want_loss)
    want_flat = dict(tree_flatten(want_grads))
    # float32 rounding compounds through 12 layers (tiny-e4b: ~2e-5 relative), and a gradient
    # that is zero in exact arithmetic (the last layer_scalar, before a norm) is pure noise.
    atol = RTOL * max(mx.abs(g).max().item() for g in want_flat.values())
    for name, g in tree_flatten(got_grads):
        _assert_close(g, want_flat[name], rtol=5 * RTOL, atol=atol)


@pytest.mark.parametrize("H,Hkv,limit,heads", [
    (8, 2, 8 * 100 * 16, 8),   # fits: one call
    (8, 2, 4 * 100 * 16, 4),   # whole KV groups of 4 query heads (2 calls, one KV head each)
    (8, 2, 2 * 100 * 16, 2),   # half a KV group a call
    (8, 4, 4 * 100 * 16, 4),   # two KV heads a call
    (6, 6, 3 * 100 * 16, 3),   # no GQA
])
def test_mlx_causal_head_groups_equal_one_call(H, Hkv, limit, heads):
    """Past cuDNN's accumulator limit the fused call runs as head groups: the same values and
    gradients as one call over all heads, and the group size is the largest that fits."""
    L, D = 100, 16  # padded to 128 inside
    assert mlx_heads_per_call(1, H, Hkv, 128, D, limit * 128 // 100) == heads
    q, k, v, ct = _inputs(1, H, Hkv, L, D, seed=H + Hkv)
    scale = D ** -0.5

    def run(max_elements):
        def f(q, k, v):
            return (mlx_causal(q, k, v, scale, max_elements) * ct).sum()
        return mx.value_and_grad(f, argnums=(0, 1, 2))(q, k, v)

    (want, dwant), (got, dgot) = run(1 << 40), run(limit * 128 // 100)
    _assert_close(got, want)
    for g, w in zip(dgot, dwant):
        _assert_close(g, w)
    _assert_close(mlx_causal(q, k, v, scale), _reference(q, k, v, scale, None))


def test_flash_variant_follows_the_rows_of_a_call():
    """v2 where a call has FLASH_V2_MIN_ROWS query rows over batch and heads (e4b's untiled 8K,
    Llama's 4096-token tiles), v1 below (e4b's 4096-token tiles, where v2 was slower)."""
    from segback.engine.attention import FLASH_V2_MIN_ROWS, flash_variant

    def q(B, H, L, D):
        return mx.zeros((B, H, L, D), mx.bfloat16)

    assert flash_variant(q(1, 8, 8192, 256)) == "v2"
    assert flash_variant(q(1, 8, 4096, 512)) == "v1"
    assert flash_variant(q(1, 32, 4096, 128)) == "v2"
    assert flash_variant(q(2, 8, 4096, 256)) == "v2"
    assert flash_variant(q(1, 1, FLASH_V2_MIN_ROWS - 1, 64)) == "v1"
