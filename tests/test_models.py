"""Model sources: GGUF conversion (on a tiny synthetic GGUF), prepare-model sources, load()."""

from __future__ import annotations

import json
import os
import time

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from segback.models import gguf as gconv
from segback.models import prepare as prep
from segback.models.load import load

# A Gemma-3 with non-square projections, so a transposed weight cannot slip through; 6 layers
# because mlx-lm's gemma3_text needs one full 5-local + 1-global pattern.
CFG = dict(hidden=48, layers=6, ffn=96, heads=2, kv_heads=1, head_dim=32, window=4)
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
PIECES = ["▁", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "llo", "hello", "▁hello",
          "▁w", "or", "▁wor", "ld", "▁world", "\n"]
TEMPLATE = "{% for m in messages %}<start_of_turn>{{ m['content'] }}<end_of_turn>\n{% endfor %}"


def _vocab() -> tuple[list[str], list[int]]:
    tokens = SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + PIECES
    types = [3] * len(SPECIALS) + [6] * 256 + [1] * len(PIECES)
    return tokens, types


def write_tiny_gguf(path, seed: int = 0, chat_template: bool = True) -> dict[str, np.ndarray]:
    """A gemma3 GGUF with llama.cpp's conventions; returns the mlx-lm weights it encodes."""
    import gguf

    rng = np.random.default_rng(seed)
    tokens, types = _vocab()
    h, f, hd = CFG["hidden"], CFG["ffn"], CFG["head_dim"]
    q, kv = CFG["heads"] * hd, CFG["kv_heads"] * hd

    w = gguf.GGUFWriter(str(path), "gemma3")
    ints = {"context_length": 128, "embedding_length": h, "block_count": CFG["layers"],
            "feed_forward_length": f, "attention.head_count": CFG["heads"],
            "attention.head_count_kv": CFG["kv_heads"], "attention.key_length": hd,
            "attention.value_length": hd, "attention.sliding_window": CFG["window"]}
    for key, val in ints.items():
        w.add_uint32(f"gemma3.{key}", val)
    w.add_float32("gemma3.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32("gemma3.rope.freq_base", 1_000_000.0)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([-float(i) for i in range(len(tokens))])
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(True)  # as in the real file: the converter must ignore it
    if chat_template:
        w.add_chat_template(TEMPLATE)

    expected: dict[str, np.ndarray] = {}

    def add(gguf_name: str, mlx: str, shape, norm: bool = False, q8: bool = False):
        x = rng.standard_normal(shape).astype(np.float32) * (0.3 if norm else 0.2)
        if q8:  # stored quantized; the converter must give back exactly the dequantized values
            raw = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(gguf_name, raw, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            x = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0).reshape(shape)
        elif norm:  # llama.cpp stores a Gemma norm weight w as 1 + w (rounded in float32)
            stored = x + np.float32(1.0)
            w.add_tensor(gguf_name, stored)
            x = stored - np.float32(1.0)
        else:
            w.add_tensor(gguf_name, x)
        expected[mlx] = x

    add("token_embd.weight", "model.embed_tokens.weight", (len(tokens), h))
    add("output_norm.weight", "model.norm.weight", (h,), norm=True)
    for i in range(CFG["layers"]):
        b, m = f"blk.{i}", f"model.layers.{i}"
        add(f"{b}.attn_q.weight", f"{m}.self_attn.q_proj.weight", (q, h))
        add(f"{b}.attn_k.weight", f"{m}.self_attn.k_proj.weight", (kv, h))
        add(f"{b}.attn_v.weight", f"{m}.self_attn.v_proj.weight", (kv, h))
        add(f"{b}.attn_output.weight", f"{m}.self_attn.o_proj.weight", (h, q))
        add(f"{b}.attn_q_norm.weight", f"{m}.self_attn.q_norm.weight", (hd,), norm=True)
        add(f"{b}.attn_k_norm.weight", f"{m}.self_attn.k_norm.weight", (hd,), norm=True)
        add(f"{b}.attn_norm.weight", f"{m}.input_layernorm.weight", (h,), norm=True)
        add(f"{b}.post_attention_norm.weight", f"{m}.post_attention_layernorm.weight", (h,),
            norm=True)
        add(f"{b}.ffn_norm.weight", f"{m}.pre_feedforward_layernorm.weight", (h,), norm=True)
        add(f"{b}.post_ffw_norm.weight", f"{m}.post_feedforward_layernorm.weight", (h,),
            norm=True)
        add(f"{b}.ffn_gate.weight", f"{m}.mlp.gate_proj.weight", (f, h))
        add(f"{b}.ffn_up.weight", f"{m}.mlp.up_proj.weight", (f, h))
        add(f"{b}.ffn_down.weight", f"{m}.mlp.down_proj.weight", (h, f), q8=True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SEGBACK_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def tiny_gguf(tmp_path):
    path = tmp_path / "tiny-gemma3.gguf"
    return path, write_tiny_gguf(path)


def test_mlx_name_mapping():
    assert gconv.mlx_name("blk.7.attn_q.weight") == "model.layers.7.self_attn.q_proj.weight"
    assert gconv.mlx_name("blk.0.ffn_norm.weight") == \
        "model.layers.0.pre_feedforward_layernorm.weight"
    assert gconv.mlx_name("blk.0.post_ffw_norm.weight") == \
        "model.layers.0.post_feedforward_layernorm.weight"
    assert gconv.mlx_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gconv.mlx_name("output_norm.weight") == "model.norm.weight"
    with pytest.raises(KeyError, match="blk.0.attn_qkv"):
        gconv.mlx_name("blk.0.attn_qkv.weight")


def test_gguf_conversion_matches_mlx_lm_exactly(tiny_gguf, tmp_path):
    import mlx_lm
    from mlx_lm.utils import _get_classes

    path, expected = tiny_gguf
    out = tmp_path / "converted"
    summary = gconv.convert(path, out, dtype="float32")
    assert summary["tensor_types"] == {"F32": 2 + 12 * CFG["layers"], "Q8_0": CFG["layers"]}
    assert summary["chat_template"] is True

    model, tok = mlx_lm.load(str(out))
    got = dict(tree_flatten(model.parameters()))
    assert set(got) == set(expected)  # tied embeddings: no lm_head
    for name, x in expected.items():
        assert np.array_equal(np.array(got[name]), x), name

    # Reference: mlx-lm's own gemma3_text built from the intended config and weights.
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["hidden_size"], config["head_dim"]) == \
        ("gemma3_text", CFG["hidden"], CFG["head_dim"])
    assert (config["sliding_window_pattern"], config["query_pre_attn_scalar"]) == (6, 32)
    model_class, args_class = _get_classes(config)
    ref = model_class(args_class.from_dict(config))
    weights = ref.sanitize({k: mx.array(v) for k, v in expected.items()})  # ties the head
    ref.load_weights(list(weights.items()))
    ids = mx.array([[2, 271, 280, 273, 5, 281, 6, 1, 279, 278]])
    assert mx.array_equal(model(ids), ref(ids)).item()

    ids = tok.encode("hello world")
    assert ids[0] == 2 and ids[-1] != 1  # <bos> added, <eos> not (despite the GGUF flag)
    assert tok.decode(ids[1:]) == "hello world"
    assert tok.eos_token_ids == {1, 6}  # <eos> and <end_of_turn>
    assert tok.chat_template == TEMPLATE
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [1, 6]


def test_bfloat16_storage(tiny_gguf, tmp_path):
    path, expected = tiny_gguf
    gconv.convert(path, tmp_path / "bf16", dtype="bfloat16", with_tokenizer=False)
    w = mx.load(str(tmp_path / "bf16" / "model.safetensors"))
    name = "model.layers.0.self_attn.q_norm.weight"
    assert w[name].dtype == mx.bfloat16
    assert np.allclose(np.array(w[name].astype(mx.float32)), expected[name], atol=1e-2)


def test_prepare_gguf_caches_conversion(tiny_gguf, tmp_path, cache, monkeypatch):
    path, _ = tiny_gguf
    s = prep.prepare("gguf", str(path), tmp_path / "a", dtype="float32")
    assert s["model_type"] == "gemma3_text" and s["tokenizer"]
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # no scratch left

    def boom(*a, **k):
        raise AssertionError("converted twice")

    monkeypatch.setattr(gconv, "convert", boom)
    prep.prepare("gguf", str(path), tmp_path / "b", dtype="float32")
    assert os.stat(tmp_path / "b" / "model.safetensors").st_ino == \
        os.stat(tmp_path / "a" / "model.safetensors").st_ino  # both linked to the cache


def test_prepare_random_round_trips_through_mlx_lm(tiny_gguf, tmp_path, cache):
    import mlx_lm

    path, _ = tiny_gguf
    out = tmp_path / "tiny"
    prep.main(prep_args("random", "tiny-e4b", out, tokenizer_gguf=str(path), seed=3))
    model, tok = mlx_lm.load(str(out))
    vocab = len(_vocab()[0])
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == config["vocab_size_per_layer_input"] == vocab
    embed = [p for k, p in tree_flatten(model.parameters()) if k.endswith("embed_tokens.weight")]
    assert embed[0].shape[0] == vocab
    assert tok.encode("hello")[0] == 2
    text = mlx_lm.generate(model, tok, "hello", max_tokens=3)
    assert isinstance(text, str)

    # The same seed gives the same weights; the local source links them.
    local = tmp_path / "local"
    prep.prepare("local", str(out), local)
    assert os.stat(local / "model.safetensors").st_ino == os.stat(out / "model.safetensors").st_ino
    assert (local / "tokenizer.json").read_text() == (out / "tokenizer.json").read_text()


def test_prepare_random_quantized_loads_in_mlx_lm(tiny_gguf, tmp_path, cache):
    """--quant-bits writes what mlx-lm's 4-bit checkpoints hold: packed layers and the config's
    `quantization` entry, so mlx_lm.load rebuilds the quantized layers and the forward runs."""
    import mlx.nn as nn
    import mlx_lm

    path, _ = tiny_gguf
    out = tmp_path / "q4"
    args = prep_args("random", "tiny-e4b", out, tokenizer_gguf=str(path), quant_bits=4,
                     quant_group_size=32)
    assert prep.main(args) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": 4, "mode": "affine"}
    model, tok = mlx_lm.load(str(out))
    quantized = {name for name, m in model.named_modules()
                 if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))}
    assert "model.embed_tokens" in quantized and "model.layers.0.mlp.up_proj" in quantized
    assert model.model.embed_tokens.bits == 4
    logits = model(mx.array([tok.encode("hello world")]))
    assert logits.shape[-1] == len(_vocab()[0]) and bool(mx.isfinite(logits).all())
    seg_model, _ = load(str(out))  # segback's loader: same layers, float32 scales on CPU
    up = seg_model.model.layers[0].mlp.up_proj
    assert up.scales.dtype == mx.float32
    assert type(up).__module__ == "segback.models.dequant_linear"  # long inputs dense
    stock, _ = load(str(out), dequant_matmul=False)
    assert type(stock.model.layers[0].mlp.up_proj) is nn.QuantizedLinear


def test_prepare_quant_bits_is_for_random_only(tmp_path):
    with pytest.raises(ValueError, match="--source random only"):
        prep.prepare("local", str(tmp_path), tmp_path / "out", quant_bits=4)
    with pytest.raises(ValueError, match="--quant-group-size 48"):
        prep.prepare("random", "tiny-llama", tmp_path / "out", quant_bits=4, quant_group_size=48)
    assert not (tmp_path / "out").exists()


def test_prepare_random_without_tokenizer(tmp_path):
    out = tmp_path / "nt"
    s = prep.prepare("random", "tiny-llama", out, tokenizer_gguf="none")
    assert s["tokenizer"] is False and s["parameters"] > 0
    model, tok = load(str(out))  # a checkpoint without tokenizer files loads, tokenizer None
    assert tok is None and model.args.vocab_size == 256


def test_prepare_local_requires_config(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        prep.prepare("local", str(tmp_path / "empty"), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_prepare_hub_offline_fails_fast(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    with pytest.raises(RuntimeError) as e:
        prep.prepare("hub", "segback-test/not-cached-anywhere", tmp_path / "hub")
    assert time.perf_counter() - start < 10
    msg = str(e.value)
    assert "HF_HUB_OFFLINE" in msg and "hf download" in msg and "path:" in msg
    assert not (tmp_path / "hub").exists()
    assert prep.main(prep_args("hub", "segback-test/not-cached", tmp_path / "hub")) == 2


def test_load_errors_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="tiny-e4b") as e:
        load("no-such-model")
    assert "config.json" in str(e.value)
    (tmp_path / "d").mkdir()
    with pytest.raises(FileNotFoundError, match="without config.json"):
        load(str(tmp_path / "d"))


def test_load_geometry_and_cpu_float32(tmp_path):
    model, tok = load("geometry:tiny-llama")
    assert tok is None
    out = tmp_path / "bf16"
    prep.prepare("random", "tiny-llama", out, tokenizer_gguf="none", dtype="bfloat16")
    import mlx_lm.utils

    model, _ = mlx_lm.utils.load_model(out)
    assert all(p.dtype == mx.bfloat16 for _, p in tree_flatten(model.parameters()))
    from segback.models.load import cast_floating, default_dtype

    assert default_dtype() == mx.float32  # tests run on CPU
    cast_floating(model, default_dtype())
    assert all(p.dtype == mx.float32 for _, p in tree_flatten(model.parameters()))


@pytest.mark.skipif(not os.environ.get("SEGBACK_SLOW"), reason="converts the real 270M GGUF "
                    "(~1 min); set SEGBACK_SLOW=1")
def test_embedded_gemma3_generates_english(tmp_path):
    import mlx_lm

    from segback.models.load import load as seg_load

    out = tmp_path / "gemma3"
    prep.prepare("gguf", prep.DEFAULT_TOKENIZER_GGUF, out)
    model, tok = seg_load(str(out))
    text = mlx_lm.generate(model, tok, "The capital of France is", max_tokens=12)
    assert "Paris" in text or "capital" in text


def prep_args(source, ref, out, **kw):
    import argparse

    p = argparse.ArgumentParser()
    prep.add_arguments(p)
    argv = ["--source", source, "--ref", ref, "--out", str(out)]
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return p.parse_args(argv)


def test_gguf_without_a_template_gets_the_familys(tmp_path):
    """A Gemma GGUF that carries no chat template is given Gemma 3's standard one, so the
    prepared checkpoint prompts the same in segback, mlx_lm.lora and mlx_lm.generate."""
    import gguf

    from segback.models.gguf import build_tokenizer, family_template, read_metadata

    write_tiny_gguf(tmp_path / "t.gguf", chat_template=False)
    meta = read_metadata(gguf.GGUFReader(str(tmp_path / "t.gguf")))
    assert "tokenizer.chat_template" not in meta
    tok = build_tokenizer(meta)
    assert tok.chat_template == family_template("gemma3")
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True,
                                  add_generation_prompt=True, return_dict=False)
    assert tok.decode(ids).startswith("<bos><start_of_turn>user\n")
    assert tok.decode(ids).endswith("<end_of_turn>\n<start_of_turn>model\n")


# -- real-size families (issue 43) ---------------------------------------------------------------

REAL_FAMILIES = {  # geometry -> (mlx-lm module, model_type)
    "llama-3.1-8b": ("mlx_lm.models.llama", "llama"),
    "mistral-7b-v0.3": ("mlx_lm.models.llama", "mistral"),  # mlx-lm runs mistral as llama
    "gemma-3-12b": ("mlx_lm.models.gemma3_text", "gemma3_text"),
}


@pytest.mark.parametrize("name", REAL_FAMILIES)
def test_real_geometries_keep_their_config_at_tiny_widths(name):
    """The tiny twin is the real config at tiny widths: same class, depth, RoPE, pattern;
    and the real config is the public config.json's (checked against the numbers here)."""
    from segback.models.random_init import build_model, geometry_config

    real, tiny = geometry_config(name), geometry_config(f"tiny-{name}")
    widths = {"hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
              "head_dim", "vocab_size", "sliding_window", "query_pre_attn_scalar"}
    assert {k: v for k, v in real.items() if k not in widths} == \
        {k: v for k, v in tiny.items() if k not in widths}
    module, model_type = REAL_FAMILIES[name]
    model = build_model(tiny)
    assert type(model).__module__ == module and model.model_type == model_type
    assert len(model.layers) == real["num_hidden_layers"]
    attn = model.layers[0].self_attn
    assert attn.n_heads // attn.n_kv_heads == min(
        real["num_attention_heads"] // real["num_key_value_heads"], 4)
    expected = {
        "llama-3.1-8b": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
                             num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                             rope_theta=500000.0),
        "mistral-7b-v0.3": dict(hidden_size=4096, num_hidden_layers=32, vocab_size=32768,
                                num_attention_heads=32, num_key_value_heads=8,
                                rope_theta=1_000_000.0),
        "gemma-3-12b": dict(hidden_size=3840, num_hidden_layers=48, num_attention_heads=16,
                            num_key_value_heads=8, head_dim=256, sliding_window=1024,
                            sliding_window_pattern=6, query_pre_attn_scalar=256,
                            vocab_size=262208, intermediate_size=15360),
    }[name]
    assert {k: real[k] for k in expected} == expected
    if name == "llama-3.1-8b":  # mlx-lm's Llama3RoPE, not a plain RoPE
        assert real["rope_scaling"]["rope_type"] == "llama3"
        assert type(attn.rope).__name__ == "Llama3RoPE"
    if name == "gemma-3-12b":  # global layers' RoPE scaled linearly by 8, the head tied
        local, full = model.layers[0].self_attn.rope, model.layers[5].self_attn.rope
        assert (local.base, local.scale) == (10_000.0, 1.0)
        assert (full.base, full.scale) == (1_000_000.0, 1 / 8)
        assert model.layers[0].self_attn.is_sliding and not model.layers[5].self_attn.is_sliding
        assert "lm_head" not in model and model.tie_word_embeddings


def _save_random(cfg: dict, out, bits: int = 4) -> None:
    from mlx_lm.utils import save_config, save_model

    from segback.models.random_init import build_model

    model = build_model(cfg, dtype=mx.bfloat16, quantize_bits=bits)
    save_model(out, model, donate_model=True)
    save_config(dict(cfg, quantization={"group_size": 64, "bits": bits, "mode": "affine"}),
                config_path=out / "config.json")


@pytest.mark.parametrize("name,wrapped", [("llama-3.1-8b", False), ("mistral-7b-v0.3", False),
                                          ("gemma-3-12b", False), ("gemma-3-12b", True)])
def test_real_family_checkpoint_loads_by_path_and_segments_as_mlx_lm(name, wrapped, tmp_path):
    """A 4-bit checkpoint of each family (Gemma-3-12B also as it ships: the multimodal `gemma3`
    wrapper) loads by path through mlx-lm's loader, and segmented gradients equal mlx-lm's."""
    import mlx.nn as nn
    from mlx.utils import tree_map
    from mlx_lm.tuner.trainer import default_loss
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load_model

    from segback.engine import value_and_grad
    from segback.models.random_init import geometry_config, wrap_multimodal

    cfg = dict(geometry_config(f"tiny-{name}"), num_hidden_layers=6)  # one Gemma-3 pattern
    cfg = wrap_multimodal(cfg) if wrapped else cfg
    _save_random(cfg, tmp_path)
    model, tokenizer = load(tmp_path)
    reference, _ = load_model(tmp_path)
    assert tokenizer is None and type(model) is type(reference)
    assert model.model_type == cfg["model_type"]
    dtypes = {p.dtype for _, p in tree_flatten(model.parameters())}
    assert dtypes == {mx.float32, mx.uint32}  # 4-bit weights, float32 scales on the CPU
    model.freeze()
    linear_to_lora_layers(model, 6, {"rank": 4, "scale": 2.0, "dropout": 0.0})
    mx.random.seed(1)  # LoRA B starts at zero: make every factor count
    model.update(tree_map(lambda p: mx.random.normal(p.shape) * 0.05,
                          model.trainable_parameters()))
    batch = mx.random.randint(0, 256, (1, 40), key=mx.random.key(3))
    lengths = mx.array([[4, 39]])
    (l0, _), g0 = nn.value_and_grad(model, default_loss)(model, batch, lengths)
    (l1, _), g1 = value_and_grad(model, batch, lengths, [(0, 2), (2, 5), (5, 6)])
    assert abs(float(l1) - float(l0)) <= 1e-5 * abs(float(l0))
    f0, f1 = dict(tree_flatten(g0)), dict(tree_flatten(g1))
    assert f0.keys() == f1.keys() and len(f0) == 6 * 7 * 2
    for k in f0:
        ref = float(mx.linalg.norm(f0[k]))
        assert ref > 0 and float(mx.linalg.norm(f1[k] - f0[k])) <= 1e-4 * ref, k


# -- families segback cannot segment ----------------------------------------------------------

def _config_dir(tmp_path, config: dict):
    (tmp_path / "config.json").write_text(json.dumps(config))
    # weights that would be read if the check came too late: not safetensors at all
    (tmp_path / "model.safetensors").write_bytes(b"not weights")
    return tmp_path


@pytest.mark.parametrize("config,says", [
    ({"model_type": "frobnicator", "hidden_size": 64}, "mlx-lm does not know"),
    ({"model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2},
     "mixture-of-experts"),
    ({"model_type": "qwen3_moe", "num_experts": 128, "moe_intermediate_size": 768},
     "mixture-of-experts"),
    ({"model_type": "gemma4", "text_config": {"model_type": "gemma4_text",
                                              "enable_moe_block": True, "num_experts": 128}},
     "mixture-of-experts"),
    ({"model_type": "jamba"}, "hybrid"),
    ({"model_type": "phi3"}, "no layer-stack adapter"),
])
def test_unsupported_family_fails_before_weights_load(tmp_path, config, says):
    from segback.models.family import UnsupportedModelError
    from segback.planner import plan_segments

    path = _config_dir(tmp_path, config)
    for run in (lambda: load(path), lambda: plan_segments(str(path), 256),
                lambda: plan_segments(dict(config), 256)):
        with pytest.raises(UnsupportedModelError) as e:
            run()
        msg = str(e.value)
        assert "\n" not in msg and says in msg and repr(config["model_type"]) in msg
        assert "llama, mistral" in msg and "gemma3_text" in msg  # what is supported


def test_supported_and_dense_configs_pass_the_family_check():
    from segback.models.family import unsupported_reason
    from segback.models.random_init import GEOMETRIES, wrap_multimodal

    for name, cfg in GEOMETRIES.items():
        assert unsupported_reason(cfg) is None, name
    assert unsupported_reason(wrap_multimodal(GEOMETRIES["gemma-3-12b"])) is None
    dense_gemma4 = {"model_type": "gemma4", "text_config": {
        "model_type": "gemma4_text", "enable_moe_block": False, "num_experts": None}}
    assert unsupported_reason(dense_gemma4) is None
