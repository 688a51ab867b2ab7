"""Adapters: mlx-lm layout compatibility, mount/unmount hot-swap, PEFT and fused export."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.tuner.utils import linear_to_lora_layers
from mlx_lm.utils import load_model, save_config, save_model

from segback.models.adapters import adapter_config, adapter_weights, mount, save_adapter, unmount
from segback.models.export import export, hf_module_path, to_peft
from segback.models.random_init import build_model, geometry_config, wrap_multimodal

WORDS = ("alpha beta gamma delta eps zeta eta theta iota kappa lambda mu repeat "
         "User Assistant System : , .").split()


def make_tokenizer(path: Path) -> None:
    """A tiny offline WordLevel tokenizer that `mlx_lm.utils.load_tokenizer` accepts."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>", "<unk>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "pad_token": "<pad>"}))


def make_model_dir(path: Path, geometry: str = "tiny-llama", seed: int = 0) -> Path:
    """A random tiny model saved as an MLX checkpoint dir loadable by `mlx_lm.load`."""
    model = build_model(geometry, seed=seed)
    save_model(path, model)
    save_config(geometry_config(geometry), path / "config.json")
    make_tokenizer(path)
    return path


def make_adapter(model_dir: Path, out: Path, seed: int, fine_tune_type: str = "lora",
                 num_layers: int = -1, keys: list[str] | None = None) -> Path:
    """A random non-trivial adapter (lora_b != 0) saved with `save_adapter`."""
    model, _ = load_model(model_dir)
    model.freeze()
    mx.random.seed(seed)
    params = {"rank": 4, "scale": 2.0, "dropout": 0.0}
    if keys:
        params["keys"] = keys
    linear_to_lora_layers(model, num_layers, params, use_dora=fine_tune_type == "dora")
    weights = adapter_weights(model)
    for k, v in weights.items():
        if k.endswith("lora_b"):  # mlx-lm initialises it to 0: the adapter would be a no-op
            weights[k] = 0.05 * mx.random.normal(v.shape)
        elif k.endswith(".m"):
            weights[k] = v * (1 + 0.1 * mx.random.normal(v.shape))
    model.load_weights(list(weights.items()), strict=False)
    save_adapter(model, out, adapter_config(fine_tune_type, num_layers, 4, 2.0, 0.0, keys,
                                            extra={"model": str(model_dir)}))
    return out


INPUT = mx.array([[1, 5, 9, 13, 7, 2, 4, 6]])


def logits(model) -> np.ndarray:
    return np.array(model(INPUT))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("model"))


@pytest.mark.parametrize("fine_tune_type", ["lora", "dora"])
def test_mount_equals_mlx_lm_load(model_dir, tmp_path, fine_tune_type):
    from mlx_lm import load

    ad = make_adapter(model_dir, tmp_path / "ad", seed=1, fine_tune_type=fine_tune_type)
    ref, _ = load(str(model_dir), adapter_path=str(ad))
    ours = mount(load_model(model_dir)[0], ad)
    base = logits(load_model(model_dir)[0])
    assert not np.allclose(logits(ref), base, atol=1e-3)  # the adapter does something
    np.testing.assert_array_equal(logits(ours), logits(ref))


def test_unmount_and_hot_swap(model_dir, tmp_path):
    a = make_adapter(model_dir, tmp_path / "a", seed=1)
    b = make_adapter(model_dir, tmp_path / "b", seed=2, fine_tune_type="dora", num_layers=2)
    model, _ = load_model(model_dir)
    base = logits(model)
    la = logits(mount(model, a))
    np.testing.assert_array_equal(logits(unmount(model)), base)
    lb = logits(mount(model, b))
    np.testing.assert_array_equal(lb, logits(mount(load_model(model_dir)[0], b)))
    np.testing.assert_array_equal(logits(mount(model, a)), la)  # mount replaces, no unmount
    assert not np.allclose(la, lb, atol=1e-3)
    unmount(model)
    assert not adapter_weights(model)
    np.testing.assert_array_equal(logits(model), base)


def test_peft_export_conventions(model_dir, tmp_path):
    from safetensors import safe_open

    keys = ["self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"]
    ad = make_adapter(model_dir, tmp_path / "ad", seed=3, num_layers=2, keys=keys)
    done = export(str(model_dir), ad, tmp_path / "exp", base_model_name="org/tiny")
    cfg = json.loads((tmp_path / "exp/peft/adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["task_type"] == "CAUSAL_LM"
    assert cfg["r"] == 4 and cfg["lora_alpha"] / cfg["r"] == 2.0  # PEFT's alpha/r = mlx scale
    assert cfg["target_modules"] == ["down_proj", "q_proj", "v_proj"]
    assert cfg["layers_to_transform"] == [2, 3] and cfg["layers_pattern"] == "layers"
    assert cfg["base_model_name_or_path"] == "org/tiny" and cfg["bias"] == "none"
    assert cfg["use_dora"] is False and done["peft_config"] == cfg

    mlx_w = mx.load(str(ad / "adapters.safetensors"))
    with safe_open(str(tmp_path / "exp/peft/adapter_model.safetensors"), framework="numpy") as f:
        assert f.metadata() == {"format": "pt"}
        peft_w = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    assert len(peft_w) == len(mlx_w) == 2 * 3 * 2
    for i in (2, 3):
        for mod, (d_in, d_out) in {"self_attn.q_proj": (64, 64), "self_attn.v_proj": (64, 32),
                                   "mlp.down_proj": (128, 64)}.items():
            stem = f"base_model.model.model.layers.{i}.{mod}"
            A, B = peft_w[f"{stem}.lora_A.weight"], peft_w[f"{stem}.lora_B.weight"]
            assert A.shape == (4, d_in) and B.shape == (d_out, 4)
            a = np.array(mlx_w[f"model.layers.{i}.{mod}.lora_a"])
            b = np.array(mlx_w[f"model.layers.{i}.{mod}.lora_b"])
            # PEFT: W + (alpha / r) B A  ==  mlx-lm: W + scale (a b)^T
            np.testing.assert_allclose(cfg["lora_alpha"] / cfg["r"] * B @ A, 2.0 * (a @ b).T,
                                       rtol=1e-6, atol=1e-7)
    assert (tmp_path / "exp/mlx/adapters.safetensors").read_bytes() == \
        (ad / "adapters.safetensors").read_bytes()


def test_peft_dora_embedding_and_wrapped_prefix():
    assert hf_module_path("language_model.model.layers.3.self_attn.q_proj") == \
        "model.language_model.layers.3.self_attn.q_proj"
    assert hf_module_path("model.layers.3.mlp.up_proj") == "model.layers.3.mlp.up_proj"
    # A real gemma4 wrapper (as e4b ships): mlx-lm nests the text model as language_model.model.
    model = build_model(wrap_multimodal(geometry_config("tiny-e4b")))
    model.freeze()
    linear_to_lora_layers(model, 2, {"rank": 2, "scale": 4.0, "dropout": 0.0,
                                     "keys": ["self_attn.q_proj"]}, use_dora=True)
    w = adapter_weights(model)
    cfg = adapter_config("dora", 2, 2, 4.0)
    tensors, peft_cfg = to_peft(w, cfg, num_model_layers=len(model.layers))
    assert peft_cfg["use_dora"] and peft_cfg["lora_alpha"] == 8
    assert peft_cfg["layers_to_transform"] == [10, 11]
    stem = "base_model.model.model.language_model.layers.11.self_attn.q_proj"
    m = w["language_model.model.layers.11.self_attn.q_proj.m"]
    assert tensors[f"{stem}.lora_magnitude_vector"].shape == m.shape
    assert tensors[f"{stem}.lora_A.weight"].shape == (2, 64)
    # LoRA on an embedding uses PEFT's lora_embedding_A [r, vocab] / lora_embedding_B [dim, r].
    emb = {"model.embed_tokens.lora_a": mx.zeros((256, 2)),
           "model.embed_tokens.lora_b": mx.zeros((2, 64))}
    t, c = to_peft(emb, adapter_config("lora", -1, 2, 1.0),
                   kinds={"model.embed_tokens": "embedding"})
    assert t["base_model.model.model.embed_tokens.lora_embedding_A"].shape == (2, 256)
    assert t["base_model.model.model.embed_tokens.lora_embedding_B"].shape == (64, 2)
    assert c["target_modules"] == ["embed_tokens"] and c["layers_to_transform"] is None


def test_export_fused_matches_mounted(model_dir, tmp_path):
    from mlx_lm import load

    ad = make_adapter(model_dir, tmp_path / "ad", seed=4)
    export(str(model_dir), ad, tmp_path / "exp", fuse=True, peft=False)
    assert not (tmp_path / "exp/peft").exists()
    fused, tok = load(str(tmp_path / "exp/fused"))
    assert not any("lora" in k for k, _ in tree_flatten(fused.parameters()))
    mounted = mount(load_model(model_dir)[0], ad)
    np.testing.assert_allclose(logits(fused), logits(mounted), rtol=1e-4, atol=1e-4)
    assert tok.eos_token_id == 2


def test_export_errors(model_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="not an mlx-lm adapter"):
        export(str(model_dir), tmp_path / "nothing", tmp_path / "exp")
