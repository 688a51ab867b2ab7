"""The training loop against mlx-lm's: its grad fn, prompt masking, optimizers, --test, full."""

from __future__ import annotations

import json
import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.tuner.trainer import default_loss
from test_train import chat_rows, model_dir, read_log, small_cfg, tiny_run, tok  # noqa: F401
from test_train import write_jsonl

from segback.data.dataset import batch_at
from segback.data.tokens import ByteTokenizer
from segback.engine import value_and_grad
from segback.models.random_init import build_model
from segback.trainer import TrainConfig, cli, loop
from segback.trainer.config import OPTIMIZERS


def test_mlx_lm_grad_fn_gives_the_same_losses(tmp_path):
    """train(..., grad_fn=nn.value_and_grad(model, default_loss)) is mlx-lm's step; the
    segmented engine's losses equal it (float32), micro-batches accumulated."""
    rows = chat_rows(8)
    losses = {}
    for name in ("mlx_lm", "segback"):
        cfg = small_cfg(tmp_path / name, lora_dropout=0.0, iters=3, plan=1,
                        learning_rate=1e-3)
        model = build_model("tiny-llama")
        grad_fn = nn.value_and_grad(model, default_loss) if name == "mlx_lm" else None
        tiny_run(cfg, rows, grad_fn=grad_fn, model=model)
        losses[name] = [r["loss"] for r in read_log(tmp_path / name / "train_log.jsonl")]
    assert len(losses["mlx_lm"]) == 3
    np.testing.assert_allclose(losses["segback"][0], losses["mlx_lm"][0], rtol=1e-6)
    np.testing.assert_allclose(losses["segback"], losses["mlx_lm"], rtol=1e-5)
    assert losses["mlx_lm"][0] != losses["mlx_lm"][2]  # it trained


def test_mask_prompt_changes_which_tokens_count(tok, tmp_path):  # noqa: F811
    write_jsonl(tmp_path / "data" / "train.jsonl", chat_rows(4))
    runs = {}
    for mask in (True, False):
        cfg = small_cfg(tmp_path / str(mask), data=str(tmp_path / "data"), mask_prompt=mask,
                        iters=1, batch_size=4, grad_accumulation_steps=1, lora_dropout=0.0)
        train_set, valid_set, test_set = loop.load_data(cfg, tok)
        assert valid_set is None and test_set is None
        model = build_model("tiny-llama")
        cli.attach(model, cfg)
        loop.train(model, cli.build_optimizer(cfg), train_set, None, cfg)
        runs[mask] = (train_set.examples, read_log(tmp_path / str(mask) / "train_log.jsonl")[0])
    (masked, on), (whole, off) = runs[True], runs[False]
    assert [ids for ids, _ in masked] == [ids for ids, _ in whole]
    assert all(off_ > 5 for _, off_ in masked) and all(o == 0 for _, o in whole)
    assert on["tokens"] == sum(len(ids) - o for ids, o in masked)  # the completions (+ EOS)
    assert off["tokens"] == sum(len(ids) - 1 for ids, _ in whole)  # every target
    assert on["loss"] != pytest.approx(off["loss"], rel=1e-3)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_each_optimizer_steps_and_resumes(name, tmp_path):
    kw = dict(optimizer=name, iters=1, grad_accumulation_steps=1, lora_dropout=0.0,
              learning_rate=1e-3)
    first = tiny_run(small_cfg(tmp_path, **kw), chat_rows(4))
    weights = mx.load(str(tmp_path / "adapters.safetensors"))
    assert any(k.endswith("lora_b") and mx.any(v != 0).item() for k, v in weights.items())
    again = tiny_run(small_cfg(tmp_path, **kw | {"iters": 2}), chat_rows(4))  # its state
    assert again["resumed_from"] == 1 and math.isfinite(again["final_loss"])
    assert first["optimizer"] == name


def test_test_writes_loss_and_perplexity(model_dir, tmp_path, capsys):  # noqa: F811
    data = tmp_path / "data"
    for split, seed in (("train", 0), ("valid", 1), ("test", 2)):
        write_jsonl(data / f"{split}.jsonl", chat_rows(6, seed=seed))
    out = tmp_path / "ad"

    def cfg(**kw) -> TrainConfig:
        return TrainConfig.from_dict(dict(
            model=str(model_dir), data=str(data), adapter_path=str(out), plan=2,
            max_seq_length=64, iters=2, batch_size=2, learning_rate=1e-2, val_batches=1,
            test=True, test_batches=-1, progress=False, grad_checkpoint=True) | kw)

    trained = cli.run(cfg(train=True))
    assert "segmented backward" in capsys.readouterr().err  # --grad-checkpoint: not needed
    results = json.loads((out / "test_results.json").read_text())
    summary = json.loads((out / "train_summary.json").read_text())
    assert results["test_ppl"] == pytest.approx(math.exp(results["test_loss"]), rel=1e-12)
    assert summary["test_loss"] == results["test_loss"] == trained["test_loss"]
    tested = cli.run(cfg(train=None))  # --test alone: the adapter in --adapter-path
    assert tested["test_loss"] == pytest.approx(results["test_loss"], rel=1e-6)
    assert "steps" not in tested
    base = cli.run(cfg(train=None, adapter_path=str(tmp_path / "none")))  # no adapter
    assert base["test_loss"] != pytest.approx(results["test_loss"], rel=1e-4)


def test_full_fine_tuning(model_dir, tmp_path):  # noqa: F811
    """--fine-tune-type full: the engine's grads of unfrozen layers equal mlx-lm's, and the
    trained weights load back as mlx-lm loads a full fine-tune."""
    from mlx_lm.utils import load_adapters, load_model

    cfg = small_cfg(tmp_path, fine_tune_type="full", num_layers=2, iters=2,
                    grad_accumulation_steps=1, learning_rate=1e-3)
    model = build_model("tiny-llama")
    cli.attach(model, cfg)
    trainable = dict(tree_flatten(model.trainable_parameters()))
    assert trainable and all(k.startswith(("model.layers.2.", "model.layers.3."))
                             for k in trainable)
    batch, lengths = batch_at(loop.as_dataset(chat_rows(4), ByteTokenizer(), cfg, "t"), 0, 2,
                              0, 64)
    (loss, ntoks), grads = value_and_grad(model, batch, lengths, [(0, 1), (1, 3), (3, 4)])
    (want, want_n), want_grads = nn.value_and_grad(model, default_loss)(model, batch, lengths)
    assert ntoks.item() == want_n.item()
    np.testing.assert_allclose(loss.item(), want.item(), rtol=1e-6)
    got, ref = dict(tree_flatten(grads)), dict(tree_flatten(want_grads))
    assert got.keys() == ref.keys() == trainable.keys()
    for k in ref:
        np.testing.assert_allclose(np.array(got[k]), np.array(ref[k]), rtol=1e-4, atol=1e-6,
                                   err_msg=k)

    tiny_run(cfg, chat_rows(4), model=build_model("tiny-llama"))
    saved = mx.load(str(tmp_path / "adapters.safetensors"))
    assert saved.keys() == trainable.keys()
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["fine_tune_type"] == "full" and config["lora_parameters"] is None
    base, _ = load_model(model_dir)
    load_adapters(base, str(tmp_path))  # mlx-lm's loader takes our full fine-tune
    assert all(mx.array_equal(dict(tree_flatten(base.parameters()))[k], v)
               for k, v in saved.items())
