"""Adapters cross both ways: segback train -> mlx_lm.load, mlx-lm's trainer -> segback."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx_lm.tuner.trainer import TrainingArgs
from mlx_lm.tuner.trainer import train as mlx_lm_train
from mlx_lm.tuner.utils import linear_to_lora_layers
from mlx_lm.utils import load_adapters, load_model, save_config
from test_adapters import INPUT
from test_train import chat_rows, model_dir, write_jsonl  # noqa: F401

from segback.models.adapters import mount
from segback.data.formats import encode_rows
from segback.data.tokens import ByteTokenizer
from segback.models.load import load
from segback.trainer import TrainConfig, cli


def logits(model) -> np.ndarray:
    model.eval()
    return np.array(model(INPUT))


def test_segback_adapter_loads_in_mlx_lm(model_dir, tmp_path):  # noqa: F811
    import mlx_lm

    write_jsonl(tmp_path / "data" / "train.jsonl", chat_rows(4))
    out = tmp_path / "ad"
    cli.run(TrainConfig.from_dict(dict(
        model=str(model_dir), data=str(tmp_path / "data"), adapter_path=str(out), plan=2,
        max_seq_length=64, iters=2, batch_size=2, learning_rate=1e-2, fine_tune_type="dora",
        num_layers=2, lora_rank=4, lora_keys=["self_attn.q_proj", "mlp.down_proj"],
        progress=False)))
    ours = mount(load(model_dir)[0], out)  # segback's own mounted model
    theirs, _ = mlx_lm.load(str(model_dir), adapter_path=str(out))
    base, _ = load_model(model_dir)
    also = load_adapters(base, str(out))
    want = logits(ours)
    np.testing.assert_allclose(logits(theirs), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(logits(also), want, rtol=1e-6, atol=1e-6)
    assert not np.allclose(logits(load(model_dir)[0]), want, atol=1e-4)  # it is trained


def test_mlx_lm_trained_adapter_loads_in_segback(model_dir, tmp_path):  # noqa: F811
    model, _ = load_model(model_dir)
    model.freeze()
    params = {"rank": 4, "scale": 10.0, "dropout": 0.0, "keys": ["self_attn.v_proj"]}
    linear_to_lora_layers(model, 3, params)
    out = tmp_path / "mlx_lm"
    out.mkdir()
    save_config({"fine_tune_type": "lora", "num_layers": 3, "lora_parameters": params},
                out / "adapter_config.json")
    data = encode_rows(ByteTokenizer(), chat_rows(4), 64).examples
    mx.disable_compile()  # its compiled step would JIT C++ for seconds on the CPU
    try:
        mlx_lm_train(model, optim.Adam(learning_rate=1e-2), data, args=TrainingArgs(
            batch_size=2, iters=3, steps_per_report=100, steps_per_eval=100,
            steps_per_save=100, max_seq_length=64,
            adapter_file=str(out / "adapters.safetensors")))
    finally:
        mx.enable_compile()
    assert Path(out / "adapters.safetensors").exists()
    want = logits(model)
    generate_loader, _ = load(model_dir, adapter_path=str(out))  # `segback generate`'s loader
    np.testing.assert_allclose(logits(generate_loader), want, rtol=1e-6, atol=1e-6)
    mounted = mount(load(model_dir)[0], out)
    np.testing.assert_allclose(logits(mounted), want, rtol=1e-6, atol=1e-6)
    trained = mx.load(str(out / "adapters.safetensors"))
    assert any(k.endswith("lora_b") and mx.any(v != 0).item() for k, v in trained.items())
