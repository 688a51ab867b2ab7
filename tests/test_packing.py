"""Sequence packing (issue 19): packed rows train exactly as mlx-lm on the unpacked examples."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.tuner.trainer import default_loss
from test_engine import TOL, assert_as_exact_as_mlx_lm, assert_close, lora_model

from segback.data.dataset import batch_at, collate, TokenDataset
from segback.engine import Packed, value_and_grad
from segback.data.packing import collate_packed, pack_dataset, pack_rows


def examples_of(sizes, offsets, vocab=256, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.integers(1, vocab, n).tolist(), o) for n, o in zip(sizes, offsets)]


# Lengths above tiny-gemma3's window of 8; one example (offset 0) counts from its second token.
SIZES, OFFSETS = [23, 9, 17, 30, 12, 6], [5, 0, 3, 11, 2, 1]


def packed_and_unpacked(rows_of, max_len=64):
    """((batch, Packed), (batch, lengths)) of the same examples: `rows_of` lists the examples
    of each packed row; unpacked, every example is a row of its own."""
    exs = examples_of(SIZES, OFFSETS)
    packed = collate_packed([[exs[i] for i in row] for row in rows_of], max_len)
    return packed, collate(exs, max_len)


def test_pack_rows_is_deterministic_and_within_capacity():
    rng = np.random.default_rng(1)
    sizes = rng.integers(1, 60, 200).tolist()
    rows = pack_rows(sizes, 64)
    assert rows == pack_rows(list(sizes), 64)  # a pure function of the lengths
    assert sorted(i for r in rows for i in r) == list(range(200))  # each example once
    assert all(sum(sizes[i] for i in r) <= 64 for r in rows)
    assert rows == sorted(rows) and all(r == sorted(r) for r in rows)
    assert len(rows) <= 1.15 * sum(sizes) / 64 + 1  # best-fit decreasing packs tightly
    assert pack_rows([5, 5, 5, 5, 6, 4], 10) == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(ValueError, match="more than a packed row's 10"):
        pack_rows([4, 11], 10)


def test_collate_packed_marks_examples_and_targets():
    exs = [([1, 2, 3, 4], 2), ([5, 6, 7], 0)]
    batch, p = collate_packed([exs], max_len=64)
    assert batch.shape == (1, 33) and batch[0, :8].tolist() == [1, 2, 3, 4, 5, 6, 7, 0]
    assert p.segments[0, :8].tolist() == [1, 1, 1, 1, 2, 2, 2, 0]
    # targets: token 2..3 of example 1 (steps 1..2), tokens 1..2 of example 2 (steps 4..5);
    # never step 3 (token 4 -> 5 crosses into example 2)
    assert np.flatnonzero(p.targets[0]).tolist() == [1, 2, 4, 5]
    assert int(p.tokens_per_row().sum()) == 7


def test_packed_dataset_batches_and_counts():
    ds = TokenDataset(examples_of(SIZES, OFFSETS))
    packed = pack_dataset(ds, 40)
    assert packed.num_examples == len(ds) and packed.loss_tokens == ds.loss_tokens
    assert all(len(ids) <= 40 for ids, _ in packed.examples)
    batch, lengths = batch_at(packed, 0, 1, seed=0, max_len=40)
    assert isinstance(lengths, Packed) and batch.shape[1] <= 40
    counted = sum(int(lengths.targets.sum()) for lengths in
                  (batch_at(packed, i, 1, 0, 40)[1] for i in range(len(packed))))
    assert counted == ds.loss_tokens


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3"])
@pytest.mark.parametrize("attention", ["fused", "chunked"])
def test_packed_equals_mlx_lm_on_unpacked_rows(name, attention):
    """Loss, token count and LoRA grads of 2 packed rows = mlx-lm's on 6 unpacked rows. The
    examples sit at other positions than in their own row and are longer than gemma3's sliding
    window of 8.

    RoPE turns by the position in the row; the angles are float32 even in a float64 model, so
    packed and unpacked differ by rounding (tiny-gemma3: ~1e-5 relative, as far as mlx-lm's own
    float32 grads are from float64 ones). The grads are checked as close to the float64 ones
    as mlx-lm's float32 grads are; a mask or target off by one is orders of magnitude above."""
    model = lora_model(name)
    (pb, packed), (ub, lengths) = packed_and_unpacked([[0, 1, 2], [3, 4, 5]])
    (l0, n0), g0 = nn.value_and_grad(model, default_loss)(model, ub, lengths)
    (l1, n1), g1 = value_and_grad(model, pb, packed, 2, attention=attention)
    assert int(n1) == int(n0) == int(packed.targets.sum())
    assert abs(float(l1) - float(l0)) <= TOL * abs(float(l0))
    assert_close(g0, g1, rel=5e-5, floor=1e-6)
    assert_as_exact_as_mlx_lm(model, g0, g1, ub, lengths)


@pytest.mark.parametrize("window", [None, 5])
def test_chunked_attention_is_block_sparse_and_exact(window):
    """Packed chunked attention reads keys from the earliest example of a chunk on, and equals
    mlx's attention under the dense block-diagonal mask, values and gradients."""
    from segback.engine.masks import Blocks
    from segback.engine.chunked import _chunks, chunked_sdpa

    segs = np.array([[1] * 7 + [2] * 12 + [3] * 9 + [0] * 4, [1] * 20 + [2] * 10 + [0] * 2])
    blocks = Blocks(segs)
    mx.random.seed(0)
    q = mx.random.normal((2, 4, 32, 8))
    k, v, = mx.random.normal((2, 2, 32, 8)), mx.random.normal((2, 2, 32, 8))
    w = mx.random.normal((2, 4, 32, 8))

    def ours(q, k, v):
        return (chunked_sdpa(q, k, v, 0.3, window, chunk_size=4, blocks=blocks) * w).sum()

    def ref(q, k, v):
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=blocks.dense(window))
        return (out * w).sum()

    (a, ga), (b, gb) = (mx.value_and_grad(f, argnums=(0, 1, 2))(q, k, v) for f in (ours, ref))
    assert abs(float(a) - float(b)) <= 1e-5 * abs(float(b))
    for x, y in zip(ga, gb):
        assert float(mx.abs(x - y).max()) <= 1e-5 * float(mx.abs(y).max())
    spans = [(k0, k1) for _, _, k0, k1, _ in _chunks(32, 4, 0, window, blocks)]
    # from the earliest example start over the rows (or the window's start), not from key 0
    assert spans[5] == (19, 24) and spans[-1] == ((20, 32) if window is None else (24, 32))


def test_packing_order_does_not_matter():
    """The same examples packed in another order and grouping give the same loss and grads
    (up to RoPE's float32 rounding, see above)."""
    model = lora_model("tiny-gemma3")
    (pa, a), _ = packed_and_unpacked([[0, 1, 2], [3, 4, 5]])
    (pb, b), _ = packed_and_unpacked([[5, 3], [2, 0, 4, 1]])
    (la, _), ga = value_and_grad(model, pa, a, 3)
    (lb, _), gb = value_and_grad(model, pb, b, 3)
    assert abs(float(la) - float(lb)) <= TOL * abs(float(la))
    assert_close(ga, gb, rel=5e-5, floor=1e-6)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3"])
def test_no_attention_across_examples(name):
    """Changing example 1's tokens changes nothing of example 2's loss or gradients (example 1
    counts no target here); without the block mask it would."""
    model = lora_model(name)
    exs = examples_of([20, 20], [20, 3])  # example 1: prompt only
    changed = [(list(reversed(exs[0][0])), 20), exs[1]]
    outs = []
    for row in (exs, changed):
        batch, packed = collate_packed([row], 64)
        outs.append(value_and_grad(model, batch, packed, 1))
    (l0, n0), g0 = outs[0]
    (l1, n1), g1 = outs[1]
    assert int(n0) == int(n1) == 17
    assert abs(float(l0) - float(l1)) <= 1e-6 * abs(float(l0))
    for (k, a), (_, b) in zip(tree_flatten(g0), tree_flatten(g1)):
        assert float(mx.abs(a - b).max()) <= 1e-6 * float(mx.abs(a).max()) + 1e-9, k
    # the same row unmasked (plain causal) does see example 1
    batch, _ = collate_packed([changed], 64)
    lengths = mx.array([[23, 39]])
    (l2, _), _ = value_and_grad(model, batch, lengths, 1)
    assert abs(float(l2) - float(l1)) > 1e-4 * abs(float(l1))


def test_tiled_engine_refuses_packed_batches():
    model = lora_model("tiny-llama")
    (pb, packed), _ = packed_and_unpacked([[0, 1, 2], [3, 4, 5]])
    with pytest.raises(ValueError, match="untiled engine"):
        value_and_grad(model, pb, packed, 1, tile=16)


def test_train_pack_counts_tokens_and_equals_mlx_lm(tmp_path):
    """`segback train --pack`: the first step's loss and trained tokens are mlx-lm's on the
    row's examples unpacked; a tiled plan is refused."""
    from test_train import chat_rows, read_log, small_cfg

    from segback.data.tokens import ByteTokenizer
    from segback.models.random_init import build_model
    from segback.trainer import cli, loop
    from segback.trainer.config import TrainConfigError

    cfg = small_cfg(tmp_path, pack=True, max_seq_length=256, iters=1, batch_size=1,
                    grad_accumulation_steps=1, lora_dropout=0.0)
    model = build_model("tiny-llama")
    cli.attach(model, cfg)
    train_set = loop.as_dataset(chat_rows(8), ByteTokenizer(), cfg, "train")
    packed = loop.packed(train_set, cfg)
    assert packed.num_examples == len(train_set) and len(packed) < len(train_set)
    batch, lengths = batch_at(packed, 0, 1, cfg.seed, cfg.max_seq_length)
    n = int(lengths.tokens_per_row()[0])
    row = [ids for ids, _ in packed.examples].index(batch[0, :n].tolist())
    ub, ul = collate(packed.parts[row], cfg.max_seq_length)
    loss, ntoks = default_loss(model, ub, ul)
    summary = loop.train(model, cli.build_optimizer(cfg), train_set, None, cfg,
                         loop.segmented_grad_fn(cli.resolve_plan(cfg, model)))
    log = read_log(tmp_path / "train_log.jsonl")[0]
    assert log["tokens"] == int(ntoks) and log["input_tokens"] == n
    assert log["loss"] == pytest.approx(float(loss), rel=1e-5)
    assert summary["pack"] is True
    with pytest.raises(TrainConfigError, match="--pack needs an untiled plan"):
        cli.resolve_plan(small_cfg(tmp_path, pack=True, tile=16), model)


def test_each_rank_reads_its_packed_rows_padded_alone():
    """Data parallel with --pack: rank r's rows are those of one process of the global batch,
    collated as if alone (its own width, its own example ids and targets)."""
    from segback.trainer import distributed
    from segback.trainer.distributed import World

    ds = pack_dataset(TokenDataset(examples_of([60, 50, 40, 9, 8, 7, 20, 10], [3] * 8)), 64)
    for index in range(3):
        whole, wl = batch_at(ds, index, 4, seed=5, max_len=64)
        for r in range(2):
            got, gl = distributed.batch_at(ds, index, 4, 5, 64, World(None, r, 2))
            lo = 2 * r
            parts = [ds.parts[[ids for ids, _ in ds.examples].index(
                whole[lo + j, :int(wl.tokens_per_row()[lo + j])].tolist())] for j in range(2)]
            want, want_l = collate_packed(parts, 64)
            assert got.tolist() == want.tolist()
            assert (gl.segments == want_l.segments).all()
            assert (gl.targets == want_l.targets).all()
