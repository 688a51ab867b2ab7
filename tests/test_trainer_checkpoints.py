"""Resume: --resume-adapter-file as mlx-lm, and what segback's own checkpoint resume refuses."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from test_adapters import make_adapter, make_model_dir
from test_train import chat_rows, model_dir, read_log, write_jsonl  # noqa: F401

from segback.models.random_init import build_model
from segback.trainer import ResumeError, TrainConfig, cli
from segback.trainer.checkpoints import trainable_weights

KEYS_QV = ["self_attn.q_proj", "self_attn.v_proj"]


def test_resume_adapter_file_loads_the_given_weights(model_dir, tmp_path):  # noqa: F811
    adapter = make_adapter(model_dir, tmp_path / "a", seed=3, keys=KEYS_QV)  # rank 4, scale 2
    given = mx.load(str(adapter / "adapters.safetensors"))
    cfg = TrainConfig.from_dict(dict(
        model="tiny-llama", data="d", lora_rank=4, lora_scale=2.0, lora_keys=KEYS_QV,
        resume_adapter_file=str(adapter / "adapters.safetensors")))
    model = build_model("tiny-llama")
    cli.attach(model, cfg)
    weights = trainable_weights(model)
    assert weights.keys() == given.keys()
    assert all(mx.array_equal(weights[k], v) for k, v in given.items())
    assert any(k.endswith("lora_b") and mx.any(v != 0).item() for k, v in given.items())
    with pytest.raises(ValueError, match="does not fit this adapter"):
        cli.attach(build_model("tiny-llama"), TrainConfig.from_dict(dict(
            model="m", data="d", lora_rank=8, lora_keys=KEYS_QV,
            resume_adapter_file=str(adapter / "adapters.safetensors"))))


@pytest.fixture(scope="module")
def data_dirs(tmp_path_factory) -> tuple[Path, Path]:
    a, b = tmp_path_factory.mktemp("data_a"), tmp_path_factory.mktemp("data_b")
    write_jsonl(a / "train.jsonl", chat_rows(4, seed=0))
    write_jsonl(b / "train.jsonl", chat_rows(4, seed=5))
    return a, b


def test_resume_refuses_what_changed(model_dir, data_dirs, tmp_path, monkeypatch,  # noqa: F811
                                     capsys):
    out = tmp_path / "ad"

    def run(**kw) -> dict:
        return cli.run(TrainConfig.from_dict(dict(
            model=str(model_dir), data=str(data_dirs[0]), adapter_path=str(out), plan=2,
            max_seq_length=64, iters=3, batch_size=2, save_every=1, steps_per_eval=0,
            progress=False) | kw))

    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    run(iters=2)
    other_model = make_model_dir(tmp_path / "other", seed=1)
    for kw, what in [(dict(model=str(other_model)), "model: '.*model.*' -> '.*other'"),
                     (dict(data=str(data_dirs[1])), "data: .*data_sha256"),
                     (dict(dtype="float16"), "dtype: 'float32' -> 'float16'"),
                     (dict(batch_size=1), "batch_size: 2 -> 1"),
                     (dict(lora_rank=4), "lora_parameters: .*rank': 8.* -> .*rank': 4"),
                     (dict(no_such=1), "unknown option 'no_such'")]:
        with pytest.raises((ResumeError, ValueError), match=what):
            run(**kw)
    assert len(read_log(out / "train_log.jsonl")) == 2  # refused before touching the run

    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")
    capsys.readouterr()
    resumed = run()
    err = capsys.readouterr().err
    assert "trained with 1 BLAS threads, this run has 2" in err and "not be bit-identical" in err
    assert resumed["resumed_from"] == 2 and resumed["blas_threads"] == 2
    log = read_log(out / "train_log.jsonl")
    assert [(r["step"], r.get("resumed_from")) for r in log] == [(1, None), (2, None), (2, 2),
                                                                 (3, None)]
    state = json.loads((out / "checkpoints/step_000003/state.json").read_text())
    assert state["blas_threads"] == 2 and state["identity"]["dtype"] == "float32"
    again = run(resume=False)  # --no-resume starts over
    assert again["resumed_from"] is None


def test_engine_options_as_given_or_typed_name_the_same_settings():
    """A checkpoint's settings compare (--restart-on-change) and key (finished runs) by typed
    engine options: "16" and 16, "true" and true, 'auto' compile and none given are one run."""
    from segback.trainer.checkpoints import Run, typed_engine

    as_given = {"iters": 3, "engine": {"tile": "16", "offload": "true", "compile": "auto"}}
    typed = {"iters": 3, "engine": {"tile": 16, "offload": True}}
    assert typed_engine(as_given) == typed and typed_engine({"iters": 3}) == {"iters": 3}
    assert Run._key({}, 1, as_given) == Run._key({}, 1, typed)
