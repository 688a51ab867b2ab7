"""Exactness of segmented backward against mlx-lm's own `nn.value_and_grad(model, default_loss)`."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten, tree_map
from mlx_lm.tuner.trainer import default_loss
from mlx_lm.tuner.utils import linear_to_lora_layers

from segback.engine import PlanError, segments_of, value_and_grad
from segback.engine.host_table import park_tables, parked_bytes, table_bytes
from segback.models.random_init import build_model, geometry_config, wrap_multimodal
from segback.engine.stack import get_stack

TOL = 1e-5


def lora_model(config, quantize_bits=None, rank=4, num_layers=None):
    model = build_model(config, quantize_bits=quantize_bits, group_size=32)
    model.freeze()
    n = len(model.layers)
    linear_to_lora_layers(model, num_layers or n, {"rank": rank, "scale": 2.0, "dropout": 0.0})
    mx.random.seed(1)  # LoRA B starts at zero in mlx-lm: make every factor non-zero
    model.update(tree_map(lambda p: mx.random.normal(p.shape) * 0.05,
                          model.trainable_parameters()))
    return model


def batch_of(vocab, B=2, T=40, seed=3):
    mx.random.seed(seed)
    batch = mx.random.randint(0, vocab, (B, T))
    lengths = mx.array([[5, T - 1], [3, T - 15]][:B])  # different prompt and total lengths
    return batch, lengths


def assert_matches(model, segments, batch, lengths, **options):
    (l0, n0), g0 = nn.value_and_grad(model, default_loss)(model, batch, lengths)
    (l1, n1), g1 = value_and_grad(model, batch, lengths, segments, **options)
    assert int(n1) == int(n0)
    assert abs(float(l1) - float(l0)) <= TOL * abs(float(l0))
    f0, f1 = dict(tree_flatten(g0)), dict(tree_flatten(g1))
    assert f0.keys() == f1.keys() and len(f0) > 0
    for k in f0:
        ref = float(mx.linalg.norm(f0[k]))
        assert ref > 0, k
        err = float(mx.linalg.norm(f1[k] - f0[k])) / ref
        assert err <= TOL, (k, err)
    # the tree structure itself, including empty sub-trees of frozen layers
    shape = str(tree_map(lambda x: 0, model.trainable_parameters()))
    assert str(tree_map(lambda x: 0, g1)) == shape


DENSE = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral", "tiny-minicpm"]


@pytest.mark.parametrize("name", DENSE + ["tiny-gemma3", "tiny-e4b"])
@pytest.mark.parametrize("cut", ["one", "per-layer", "uneven"])
def test_matches_mlx_lm(name, cut):
    model = lora_model(name)
    n = len(model.layers)
    segments = {"one": [(0, n)], "per-layer": 1, "uneven": [(0, 1), (1, n - 1), (n - 1, n)]}[cut]
    assert_matches(model, segments, *batch_of(model.args.vocab_size))


@pytest.mark.parametrize("segments", [
    [(0, 8), (8, 12)],                        # every sharer after both donors' segment
    [(0, 6), (6, 7), (7, 9), (9, 11), (11, 12)],  # donor 7 and its sharers split apart
    [(0, 5), (5, 6), (6, 8), (8, 10), (10, 12)],  # full donor 5 alone; sharers in two segments
])
def test_gemma4_kv_sharing_cuts(segments):
    model = lora_model("tiny-e4b")
    stack = get_stack(model)
    assert stack.kv_source[8:] == [7, 7, 7, 5]  # sliding sharers read 7, full sharer reads 5
    assert_matches(model, segments, *batch_of(model.args.vocab_size))


def test_gemma4_multimodal_wrapper():
    model = lora_model(wrap_multimodal(geometry_config("tiny-e4b")))
    assert_matches(model, [(0, 3), (3, 9), (9, 12)], *batch_of(256))


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-e4b"])
def test_quantized_base(name):
    model = lora_model(name, quantize_bits=4)
    assert any(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules())
    assert_matches(model, 2, *batch_of(model.args.vocab_size))


def test_partial_lora_layers_and_trainable_embedding():
    model = lora_model("tiny-llama", num_layers=2)
    model.model.embed_tokens.unfreeze()  # outer parameters: dh must be threaded to the embedding
    model.model.norm.unfreeze()
    assert_matches(model, 1, *batch_of(256))


def test_head_chunking_bounds_logits():
    model = lora_model("tiny-qwen3")
    batch, lengths = batch_of(256)
    (l0, _), g0 = value_and_grad(model, batch, lengths, 2)
    (l1, _), g1 = value_and_grad(model, batch, lengths, 2, head_chunk=256 * 7)
    assert abs(float(l0) - float(l1)) <= TOL * abs(float(l0))
    for a, b in zip(tree_flatten(g0), tree_flatten(g1)):
        assert float(mx.linalg.norm(a[1] - b[1])) <= TOL * float(mx.linalg.norm(a[1]))


def test_segments_validation():
    assert segments_of(2, 5) == [(0, 2), (2, 4), (4, 5)]
    assert segments_of([[0, 3], [3, 5]], 5) == [(0, 3), (3, 5)]
    with pytest.raises(PlanError, match="cover layers"):
        segments_of([(0, 2), (3, 5)], 5)
    with pytest.raises(PlanError, match="has 5 layers"):
        segments_of([(0, 2)], 5)
    for bad in ([(0, 2.5), (2.5, 5)], [("0", "5")], 2.0, "2"):  # never truncated silently
        with pytest.raises(PlanError, match="whole"):
            segments_of(bad, 5)


def test_unsupported_model_type_is_named():
    model = build_model(dict(model_type="gpt2", n_embd=32, n_layer=1, n_head=2, n_ctx=64,
                             n_positions=64, vocab_size=64, layer_norm_epsilon=1e-5))
    with pytest.raises(ValueError, match="supported: llama"):
        value_and_grad(model, mx.zeros((1, 4), mx.int32), mx.array([[0, 3]]), 1)


@pytest.mark.parametrize("name,num_layers", [("tiny-llama", 2), ("tiny-e4b", 5), ("tiny-e4b", 3)])
def test_lora_on_top_layers_only(name, num_layers):
    """mlx-lm's --num-layers: frozen bottom segments need no backward at all."""
    model = lora_model(name, num_layers=num_layers)
    assert_matches(model, 1, *batch_of(model.args.vocab_size))
    assert_matches(model, 4, *batch_of(model.args.vocab_size))


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3", "tiny-e4b"])
def test_chunked_attention_matches_mlx_lm(name, monkeypatch):
    """Chunked attention (issue 7) inside the engine: same loss and grads as mlx-lm's fused."""
    import segback.engine.attention as attn

    calls = []
    inner = attn.chunked_sdpa
    monkeypatch.setattr(attn, "chunked_sdpa", lambda *a, **k: calls.append(k) or inner(*a, **k))
    model = lora_model(name)
    batch, lengths = batch_of(model.args.vocab_size, T=70)  # > sliding windows of 8/16
    (l0, _), g0 = nn.value_and_grad(model, default_loss)(model, batch, lengths)
    (l1, _), g1 = value_and_grad(model, batch, lengths, 3, attention="chunked")
    assert len(calls) >= 2 * len(model.layers)  # every layer, forward and recompute
    assert abs(float(l1) - float(l0)) <= TOL * abs(float(l0))
    f0, f1 = dict(tree_flatten(g0)), dict(tree_flatten(g1))
    top = max(float(mx.abs(v).max()) for v in f0.values())
    for k, v in f0.items():  # a floor: layer_scalar's grad before a norm is 0 up to rounding
        err = float(mx.linalg.norm(f1[k] - v))
        assert err <= 5e-5 * float(mx.linalg.norm(v)) + 1e-5 * top, (k, err)


def assert_close(g0, g1, rel=5e-5, floor=1e-5):
    """Chunked attention sums in another order: relative error plus a floor for near-zero grads
    (layer_scalar's grad before a norm is 0 up to rounding)."""
    f0, f1 = dict(tree_flatten(g0)), dict(tree_flatten(g1))
    assert f0.keys() == f1.keys() and len(f0) > 0
    top = max(float(mx.abs(v).max()) for v in f0.values())
    for k, v in f0.items():
        err = float(mx.linalg.norm(f1[k] - v))
        assert err <= rel * float(mx.linalg.norm(v)) + floor * top, (k, err)


def _cast(model, src, dst):
    model.update(tree_map(lambda p: p.astype(dst) if p.dtype == src else p, model.parameters()))


def assert_as_exact_as_mlx_lm(model, g32, ours, batch, lengths, factor=5.0, floor=1e-6):
    """Our float32 grads are as close to the exact (float64) grads as mlx-lm's own float32 ones.

    Tiling changes matmul shapes, so BLAS rounds differently; on tiny-e4b (attention scale 1
    after q/k norms, sharp softmax) mlx-lm's own float32 grads are ~6e-5 (relative) from the
    float64 result, so a fixed 5e-5 bound against them tests rounding luck, not correctness.
    Any real error (a mask, position or cotangent off) is orders of magnitude above this bound.
    """
    _cast(model, mx.float32, mx.float64)
    try:
        _, g64 = nn.value_and_grad(model, default_loss)(model, batch, lengths)
    finally:
        _cast(model, mx.float64, mx.float32)
    f32, f64, f1 = (dict(tree_flatten(g)) for g in (g32, g64, ours))
    assert f1.keys() == f64.keys() and len(f64) > 0
    top = max(float(mx.abs(v).max()) for v in f64.values())
    for k, exact in f64.items():
        ref_err = float(mx.linalg.norm(f32[k] - exact))
        err = float(mx.linalg.norm(f1[k] - exact))
        bound = factor * ref_err + floor * (float(mx.linalg.norm(exact)) + top)
        assert err <= bound, (k, err, ref_err)


@pytest.mark.parametrize("name", DENSE + ["tiny-gemma3", "tiny-e4b"])
@pytest.mark.parametrize("segments,tile,offload", [
    (1, 23, False),    # one layer per segment, ragged last tile
    (3, 16, True),     # boundaries recomputed inside segments; host-parked boundaries
    (None, 128, False),  # one segment, one tile
])
def test_tiled_matches_mlx_lm(name, segments, tile, offload):
    """Sequence-tiled layers (issue 7): mlx-lm's layers run a tile of tokens at a time."""
    model = lora_model(name)
    batch, lengths = batch_of(model.args.vocab_size, T=70)  # > sliding windows of 8/16
    (l0, n0), g0 = nn.value_and_grad(model, default_loss)(model, batch, lengths)
    stats = {}
    (l1, n1), g1 = value_and_grad(model, batch, lengths, segments, tile=tile, offload=offload,
                                  stats=stats)
    assert int(n1) == int(n0)
    assert abs(float(l1) - float(l0)) <= TOL * abs(float(l0))
    assert_as_exact_as_mlx_lm(model, g0, g1, batch, lengths)
    assert (stats["host_gb"] > 0) == offload


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3", "tiny-e4b"])
@pytest.mark.parametrize("segments,chunk", [(1, 16), (None, 23), (2, 128)])
def test_mlp_chunks_match_mlx_lm(name, segments, chunk):
    """`mlp_chunk`: each MLP keeps only its input and output and its VJP recomputes it a chunk
    of tokens at a time (ragged last chunk; one chunk when it covers the sequence)."""
    model = lora_model(name)
    batch, lengths = batch_of(model.args.vocab_size, T=70)
    (l0, n0), g0 = nn.value_and_grad(model, default_loss)(model, batch, lengths)
    (l1, n1), g1 = value_and_grad(model, batch, lengths, segments, mlp_chunk=chunk)
    assert int(n1) == int(n0) and abs(float(l1) - float(l0)) <= TOL * abs(float(l0))
    assert_as_exact_as_mlx_lm(model, g0, g1, batch, lengths)
    assert type(model.layers[0].mlp).__module__.startswith("mlx_lm")  # swapped back


def test_mlp_chunks_replay_lora_dropout_in_the_recompute():
    """With LoRA dropout each chunk draws its masks from a seed of (step, layer, chunk), in the
    forward and in the recompute alike: the gradient is the derivative of the loss the step
    reports (central difference along a random direction, the step's seed fixed)."""
    model = build_model("tiny-llama")
    model.freeze()
    linear_to_lora_layers(model, len(model.layers), {"rank": 4, "scale": 2.0, "dropout": 0.5})
    mx.random.seed(1)
    model.update(tree_map(lambda p: mx.random.normal(p.shape) * 0.05,
                          model.trainable_parameters()))
    batch, lengths = batch_of(model.args.vocab_size, T=70)
    params = model.trainable_parameters()
    direction = tree_map(lambda p: mx.random.normal(p.shape), params)

    def step(scale):
        model.update(tree_map(lambda p, d: p + scale * d, params, direction))
        mx.random.seed(7)
        return value_and_grad(model, batch, lengths, 2, mlp_chunk=16)

    (loss, _), grads = step(0.0)
    eps = 1e-3
    (up, _), _ = step(eps)
    (down, _), _ = step(-eps)
    model.update(params)
    slope = sum(float((g * d).sum()) for (_, g), (_, d) in
                zip(tree_flatten(grads), tree_flatten(direction)))
    assert abs((float(up) - float(down)) / (2 * eps) - slope) <= 2e-2 * abs(slope)
    mx.random.seed(7)
    (again, _), _ = value_and_grad(model, batch, lengths, 2, mlp_chunk=None)
    assert float(again) != float(loss)  # dropout is on: the chunked masks are their own


@pytest.mark.parametrize("bits", [None, 4])
def test_untiled_with_the_table_on_the_host_matches_mlx_lm(bits):
    """`host_table=True` parks Gemma-4's per-layer table in host memory for the untiled engine
    too (the step gathers its rows there): the gradients stay mlx-lm's, the table leaves the
    model's parameters and `stats` counts it as host memory."""
    model = lora_model("tiny-e4b", quantize_bits=bits)
    batch, lengths = batch_of(model.args.vocab_size)
    size, stats = table_bytes(model), {}
    assert_matches(model, 2, batch, lengths, host_table=True, stats=stats)
    assert size > 0 and parked_bytes(model) == size and table_bytes(model) == 0
    assert stats["host_gb"] == size / 1024**3
    kept = lora_model("tiny-e4b", quantize_bits=bits)
    value_and_grad(kept, batch, lengths, 2, host_table=False)
    assert parked_bytes(kept) == 0 and table_bytes(kept) == size


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-e4b"])
@pytest.mark.parametrize("tile,light_tile,keep", [
    (16, 48, 0),   # light passes in 2 tiles (one ragged), the post VJP in 5
    (32, 8, 2),    # light tiles smaller than the heavy ones; last 2 boundaries on the device
])
def test_light_tiles_and_kept_boundaries_match_mlx_lm(name, tile, light_tile, keep):
    """The pre pass, its VJP and the forward post pass on their own tiles; the last `keep`
    segments' boundaries stay on the device while the others are parked."""
    model = lora_model(name)
    batch, lengths = batch_of(model.args.vocab_size, T=70)
    (l0, n0), g0 = nn.value_and_grad(model, default_loss)(model, batch, lengths)
    stats = {}
    (l1, n1), g1 = value_and_grad(model, batch, lengths, 1, tile=tile, offload=True,
                                  light_tile=light_tile, boundaries_on_device=keep,
                                  stats=stats)
    assert int(n1) == int(n0)
    assert abs(float(l1) - float(l0)) <= TOL * abs(float(l0))
    assert_as_exact_as_mlx_lm(model, g0, g1, batch, lengths)
    a = model.args
    per_layer = getattr(a, "hidden_size_per_layer_input", 0) * a.num_hidden_layers
    parked = (a.num_hidden_layers - keep) * a.hidden_size + per_layer
    table = parked_bytes(model)  # Gemma-4's per-layer embedding table, parked for good
    assert (table > 0) == (name == "tiny-e4b")
    assert stats["host_gb"] == pytest.approx((2 * 69 * parked * 4 + table) / 1024**3)


def test_prefetch_is_bit_exact(monkeypatch):
    """Fetching parked boundaries and per-layer inputs back early (a side-stream copy) changes
    nothing in the result."""
    from segback.engine import offload

    model = lora_model("tiny-e4b")
    batch, lengths = batch_of(model.args.vocab_size, T=50)
    side, used = offload._side_stream, []
    monkeypatch.setattr(offload, "_side_stream", lambda: used.append(1) or side())
    runs = []
    for on in (False, True):
        runs.append(value_and_grad(model, batch, lengths, 2, tile=16, offload=True,
                                   prefetch=on))
        assert bool(used) == on  # parked arrays came back early, through the side stream
    (l0, _), g0 = runs[0]
    (l1, _), g1 = runs[1]
    assert float(l0) == float(l1)
    for (k, a), (_, b) in zip(tree_flatten(g0), tree_flatten(g1)):
        assert mx.array_equal(a, b), k


def test_shared_traces_match_mlx_lm(monkeypatch):
    """Compiled tile functions shared by the layers of one structure (weights as inputs) give
    mlx-lm's gradients, with fewer traces than layers, and leave every layer its own weights."""
    from segback.engine import tiled

    monkeypatch.setattr(tiled, "_SHARED", {})
    model = lora_model("tiny-e4b")
    batch, lengths = batch_of(model.args.vocab_size, T=70)
    (l0, _), g0 = nn.value_and_grad(model, default_loss)(model, batch, lengths)
    before = [dict(tree_flatten(layer.parameters())) for layer in model.layers]
    (l1, _), g1 = value_and_grad(model, batch, lengths, 1, tile=23, compile=True,
                                  share_traces=True)
    for layer, old in zip(model.layers, before):  # the template's weights are put back
        assert all(v is old[k] for k, v in tree_flatten(layer.parameters()))
    assert abs(float(l1) - float(l0)) <= TOL * abs(float(l0))
    assert_as_exact_as_mlx_lm(model, g0, g1, batch, lengths)
    assert 0 < len({id(f) for f in tiled._SHARED.values()}) < len(model.layers)


def test_light_tile_and_keep_need_their_engine():
    model = lora_model("tiny-llama", num_layers=2)
    batch, lengths = batch_of(model.args.vocab_size, T=20)
    with pytest.raises(ValueError, match="light_tile needs a tile"):
        value_and_grad(model, batch, lengths, 1, light_tile=8)
    with pytest.raises(ValueError, match="boundaries_on_device=1 .* needs offload"):
        value_and_grad(model, batch, lengths, 1, tile=8, boundaries_on_device=1)
    with pytest.raises(ValueError, match="mlp_chunk is for the untiled engine"):
        value_and_grad(model, batch, lengths, 1, tile=8, mlp_chunk=8)
    with pytest.raises(ValueError, match="mlp_chunk must be a positive number of tokens"):
        value_and_grad(model, batch, lengths, 1, mlp_chunk=0)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-e4b"])
def test_tiled_trainable_embedding_and_quantized(name):
    """Per-layer input and embedding grads thread back through tiles; 4-bit base."""
    model = lora_model(name, quantize_bits=4, num_layers=3)
    model.model.norm.unfreeze()
    if name == "tiny-e4b":
        model.model.per_layer_projection_norm.unfreeze()  # reached through per-layer inputs
    batch, lengths = batch_of(model.args.vocab_size, T=50)
    (l0, _), g0 = nn.value_and_grad(model, default_loss)(model, batch, lengths)
    (l1, _), g1 = value_and_grad(model, batch, lengths, 2, tile=16, offload=True)
    assert abs(float(l1) - float(l0)) <= TOL * abs(float(l0))
    assert_close(g0, g1)


def test_offload_host_bytes_and_needs_tile():
    """Offload parks one boundary per segment and every layer's per-layer input."""
    model = lora_model("tiny-e4b")
    a = model.args
    batch, lengths = batch_of(a.vocab_size, B=1, T=65)
    stats = {}
    value_and_grad(model, batch, lengths, 4, tile=32, offload=True, stats=stats)
    per_token = 3 * a.hidden_size + a.num_hidden_layers * a.hidden_size_per_layer_input
    table = a.vocab_size_per_layer_input * a.num_hidden_layers * a.hidden_size_per_layer_input
    assert stats["host_gb"] == pytest.approx((64 * per_token + table) * 4 / 1024**3)
    with pytest.raises(ValueError, match="needs a tile"):
        value_and_grad(model, batch, lengths, 4, offload=True)


def test_host_store_round_trips_bounded_and_counted(monkeypatch):
    """Parked arrays come back bit-exact (bfloat16 too), as often as asked; at most MAX_PENDING
    copies out are in flight; host bytes rise and fall."""
    from segback.engine import offload

    seen = []
    real = offload._to_host

    def watched(x):
        seen.append(len(store._pending))
        return real(x)

    monkeypatch.setattr(offload, "_to_host", watched)
    store = offload.HostStore(True)
    xs = [mx.random.normal((2, 33, 5)).astype(dt) for dt in (mx.bfloat16, mx.float32)] * 3
    handles = [store.put(x) for x in xs]
    assert max(seen) <= offload.MAX_PENDING
    assert store.host_bytes == store.peak_host_bytes == sum(x.nbytes for x in xs)
    for x, h in zip(xs, handles):
        for _ in range(2):
            y = store.get(h)
            assert y.dtype == x.dtype and mx.array_equal(y, x)
    for h in handles:
        store.drop(h)
    assert store.host_bytes == 0
    on_device = offload.HostStore(False)
    assert on_device.get(on_device.put(xs[0])) is xs[0]


def test_tiled_compiled_traces_are_replayed_and_leave_real_parameters():
    """Compiled tile functions: a second step replays the traces and gives the same result;
    the model holds real arrays afterwards (an optimizer can read them); no compile = same."""
    model = lora_model("tiny-e4b")
    batch, lengths = batch_of(model.args.vocab_size, T=50)
    (l1, _), g1 = value_and_grad(model, batch, lengths, 2, tile=16)
    mx.eval(model.parameters())
    (l2, _), g2 = value_and_grad(model, batch, lengths, 2, tile=16)
    (l3, _), g3 = value_and_grad(model, batch, lengths, 2, tile=16, compile=False)
    assert float(l1) == float(l2)
    for (k, a), (_, b), (_, c) in zip(tree_flatten(g1), tree_flatten(g2), tree_flatten(g3)):
        assert mx.array_equal(a, b), k
        assert float(mx.linalg.norm(a - c)) <= 1e-5 * float(mx.linalg.norm(c)), k


@pytest.mark.parametrize("light_tile", [None, 24])
def test_tiled_with_lora_dropout_runs_uncompiled(light_tile):
    """Dropout draws random masks, which a compiled trace would freeze: tiles run eagerly, and
    the backward replays the forward's masks, so the grads are those of the loss it returned
    (a central difference with the same seed agrees), light tiles or not."""
    from segback.engine.stack import has_dropout

    model = lora_model("tiny-llama")
    for _, m in model.named_modules():
        if isinstance(m, nn.Dropout):
            m._p_1 = 0.5
    assert all(has_dropout(layer) for layer in get_stack(model).layers)
    batch, lengths = batch_of(256, T=30)

    def loss_at(params, seed=11):
        model.update(params)
        mx.random.seed(seed)
        (loss, _), grads = value_and_grad(model, batch, lengths, 2, tile=8,
                                          light_tile=light_tile)
        return loss, grads

    theta = model.trainable_parameters()
    l0, g0 = loss_at(theta)
    assert float(loss_at(theta, seed=12)[0]) != float(l0)  # dropout is active
    # Directional derivative along the gradient, by central differences with the same masks.
    norm = mx.sqrt(sum((v * v).sum() for _, v in tree_flatten(g0)))
    eps = 1e-2
    plus, _ = loss_at(tree_map(lambda p, g: p + eps * g / norm, theta, g0))
    minus, _ = loss_at(tree_map(lambda p, g: p - eps * g / norm, theta, g0))
    model.update(theta)
    fd = (float(plus) - float(minus)) / (2 * eps)
    assert fd == pytest.approx(float(norm), rel=2e-2)


@pytest.mark.parametrize("bits", [None, 4])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_host_table_is_bit_exact_and_leaves_the_parameters(bits, dtype):
    """Gemma-4's per-layer embedding table parked in host memory gives the same rows, bit for
    bit (quantized: gathered on the host, dequantized on the device), and leaves the model's
    parameters; a trainable table stays where it is."""
    model = build_model("tiny-e4b", dtype=dtype, quantize_bits=bits, group_size=32)
    model.freeze()
    table = model.model.embed_tokens_per_layer
    assert isinstance(table, nn.QuantizedEmbedding) == bool(bits)
    ids = mx.random.randint(0, model.args.vocab_size_per_layer_input, (2, 33))
    before = table(ids)
    size = table_bytes(model)
    total = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    assert size == sum(v.nbytes for _, v in tree_flatten(table.parameters())) > 0
    assert park_tables(model) == size == parked_bytes(model)
    assert table_bytes(model) == 0 and park_tables(model) == 0  # once
    assert total - sum(v.nbytes for _, v in tree_flatten(model.parameters())) == size
    after = model.model.embed_tokens_per_layer(ids)
    assert after.dtype == before.dtype and mx.array_equal(after, before).item()

    trainable = build_model("tiny-e4b", dtype=dtype)
    trainable.freeze()
    trainable.model.embed_tokens_per_layer.unfreeze()
    assert park_tables(trainable) == 0 and table_bytes(trainable) > 0


def test_binder_binds_as_module_update_does():
    """The engine's fast binder leaves a layer as `update(..., strict=False)` leaves it, walks
    list indices (model.layers.3...), and binds into a module swapped in after it was made."""
    from mlx.utils import tree_flatten, tree_unflatten

    from segback.engine.stack import binder

    model = lora_model("tiny-llama")
    flat = tree_flatten(model.trainable_parameters())
    keys = [k for k, _ in flat]
    assert any(".3." in k for k in keys)
    new = [mx.full(v.shape, float(i), v.dtype) for i, (_, v) in enumerate(flat)]
    binder(model, keys)(new)
    for (k, v), expected in zip(tree_flatten(model.trainable_parameters()), new):
        assert v is expected, k
    other = lora_model("tiny-llama")
    other.update(tree_unflatten(list(zip(keys, new))), strict=False)
    for (k, a), (_, b) in zip(tree_flatten(model.parameters()), tree_flatten(other.parameters())):
        assert mx.array_equal(a, b), k

    key = next(k for k in keys if k.endswith("layers.0.self_attn.q_proj.lora_a"))
    bind = binder(model, [key])
    attn = get_stack(model).layers[0].self_attn
    q = attn.q_proj
    attn.q_proj = type(q)(q.lora_a.shape[0], q.lora_b.shape[1], r=q.lora_a.shape[1])
    value = mx.ones(q.lora_a.shape)
    bind([value])
    assert attn.q_proj.lora_a is value and q.lora_a is not value
