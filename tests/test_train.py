"""Trainer and data: formats, masking, batch order, loss goes down, exact resume, NaN guard.

The trainer's options, mlx-lm parity and interop live in tests/test_trainer_*.py."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.tuner.trainer import default_loss
from mlx_lm.utils import load_tokenizer
from test_adapters import WORDS, make_model_dir, make_tokenizer

from segback.engine import Plan
from segback.trainer import TrainConfig, TrainingDiverged, cli, loop
from segback.data.dataset import batch_at, batch_groups, collate, DataError, epoch_permutation
from segback.data.formats import encode_rows
from segback.data.sources import load_dataset
from segback.data.tokens import ByteTokenizer
from segback.models.random_init import build_model
from segback.data.tokens import encode_chat


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def chat_rows(n: int, seed: int = 0) -> list[dict]:
    """'repeat: w1 .. w6' -> 'w1 .. w6': learnable by a tiny model in a few steps."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        words = " ".join(rng.choice(WORDS[:12], 6))
        rows.append({"messages": [{"role": "user", "content": f"repeat : {words}"},
                                  {"role": "assistant", "content": words}]})
    return rows


def mask_of(lengths: mx.array, T: int) -> np.ndarray:
    """default_loss's mask over targets."""
    steps = np.arange(1, T)[None]
    ln = np.array(lengths)
    return (steps >= ln[:, :1]) & (steps <= ln[:, 1:])


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    make_tokenizer(path)
    return load_tokenizer(path)


# ---- data -------------------------------------------------------------------------------------


def test_formats_and_prompt_masking(tok, tmp_path):
    msgs = [{"role": "user", "content": "alpha beta"}, {"role": "assistant", "content": "gamma"}]
    rows = [
        {"messages": msgs, "id": 7, "extra": {"ignored": True}},
        {"prompt": "alpha beta", "completion": "gamma"},
        {"text": "delta eps zeta"},
    ]
    write_jsonl(tmp_path / "train.jsonl", rows)
    data = load_dataset(tmp_path, tok, max_len=64)
    assert data["valid"] is None
    ds = data["train"]
    (ids0, off0), (ids1, off1), (ids2, off2) = ds.examples
    assert (ids0, off0) == (ids1, off1)  # prompt/completion is a [user, assistant] chat
    assert off0 == len(encode_chat(tok, msgs[:1], add_generation_prompt=True))
    assert ids0[0] == tok.bos_token_id and ids0[-1] == tok.eos_token_id
    assert off2 == 0 and ids2 == [tok.bos_token_id, *tok.encode("delta eps zeta"),
                                  tok.eos_token_id]

    batch, lengths = collate(ds.examples, max_len=64)
    assert batch.shape == (3, 33) and batch.dtype == mx.int32
    mask = mask_of(lengths, batch.shape[1])
    # exactly the completion tokens (+ EOS) count; nothing of the prompt, no padding
    for j, (ids, off) in enumerate(ds.examples):
        counted = np.flatnonzero(mask[j]) + 1  # target j is token j + 1
        assert counted.tolist() == list(range(max(off, 1), len(ids)))
    model = build_model("tiny-llama")
    _, ntoks = default_loss(model, batch, lengths)
    assert ntoks.item() == ds.loss_tokens == 2 + 2 + 4


def test_truncation_drops_examples_without_completion(tok):
    rows = [{"prompt": "alpha " * 20, "completion": "beta"},
            {"prompt": "alpha", "completion": "beta gamma delta eps"}]
    ds = encode_rows(tok, rows, max_len=8)
    assert len(ds) == 1 and ds.dropped == 1 and ds.truncated == 1
    assert len(ds[0][0]) == 8
    with pytest.raises(DataError, match="none of 1 examples"):
        encode_rows(tok, rows[:1], max_len=8)


def test_data_errors(tok, tmp_path):
    with pytest.raises(DataError, match="not found"):
        load_dataset(tmp_path / "missing", tok, 64)
    with pytest.raises(DataError, match="train.jsonl not found"):
        load_dataset(tmp_path, tok, 64)
    (tmp_path / "train.jsonl").write_text("\n")
    with pytest.raises(DataError, match="is empty"):
        load_dataset(tmp_path, tok, 64)
    write_jsonl(tmp_path / "train.jsonl", [{"text": "alpha"}, {"question": "q", "answer": "a"}])
    with pytest.raises(DataError, match=r"(?s)train.jsonl(:| row )2: unknown format \(keys: "
                                        r"\['answer', 'question'\]\).*messages.*prompt.*"
                                        r"completion.*text"):
        load_dataset(tmp_path, tok, 64)
    (tmp_path / "train.jsonl").write_text('{"text": "alpha"}\n{oops\n')
    with pytest.raises(DataError, match=r"train.jsonl:2: not valid JSON"):
        load_dataset(tmp_path, tok, 64)
    write_jsonl(tmp_path / "train.jsonl", [{"messages": [{"role": "user", "content": "x"}]}])
    with pytest.raises(DataError, match="must end with an assistant message"):
        load_dataset(tmp_path, tok, 64)


def test_batch_order_is_a_pure_function_of_seed_and_index(tok):
    ds = encode_rows(tok, chat_rows(10), max_len=64)
    groups = batch_groups(ds, 3)
    assert len(groups) == 3  # 10 // 3, remainder dropped like mlx-lm
    again = encode_rows(tok, chat_rows(10), max_len=64)
    for k in (0, 4, 7, 11):
        for a, b in zip(batch_at(ds, k, 3, seed=5, max_len=64),
                        batch_at(again, k, 3, seed=5, max_len=64)):
            np.testing.assert_array_equal(np.array(a), np.array(b))
    for epoch in range(3):  # each epoch visits every batch once
        assert sorted(epoch_permutation(3, 5, epoch).tolist()) == [0, 1, 2]
    perms = {tuple(epoch_permutation(12, s, e)) for s in (0, 1) for e in (0, 1)}
    assert len(perms) == 4


# ---- training ----------------------------------------------------------------------------------


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return p.parse_args(argv)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data")
    write_jsonl(path / "train.jsonl", chat_rows(24, seed=0))
    write_jsonl(path / "valid.jsonl", chat_rows(6, seed=1))
    return path


def read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_cli_training_lowers_loss_and_writes_mlx_lm_adapter(model_dir, data_dir, tmp_path):
    from mlx_lm import load

    out = tmp_path / "ad"
    rc = cli.main(parse([
        "--model", str(model_dir), "--data", str(data_dir), "--adapter-path", str(out),
        "--plan", "2", "--max-seq-length", "64", "--iters", "12", "--batch-size", "4",
        "--learning-rate", "3e-3", "--warmup", "2", "--steps-per-eval", "6",
        "--val-batches", "2", "--save-every", "4", "--no-progress"]))
    assert rc == 0
    s = json.loads((out / "train_summary.json").read_text())
    assert s["steps"] == 12 and s["segments"] == [[0, 2], [2, 4]] and s["seq"] == 64
    assert s["final_loss"] < s["first_loss"] - 0.5
    assert s["val_loss"] < s["first_val_loss"]
    assert s["peak_gb"] > 0 and s["tokens"] > 0 and s["tokens_per_second"] > 0
    assert s["blas_threads"] >= 1 and s["dtype"] == "float32" and s["resumed_from"] is None
    log = read_log(out / "train_log.jsonl")
    steps = [r for r in log if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 13))
    assert {"step", "loss", "lr", "tokens", "seconds", "peak_gb", "active_gb",
            "cache_gb"} <= set(steps[0])
    assert [r["step"] for r in log if "val_loss" in r] == [0, 6, 12]
    # warmup from lr / 3 to the peak, then cosine decay
    assert [r["lr"] for r in steps[:4]] == pytest.approx([1e-3, 2e-3, 3e-3, 3e-3])
    assert steps[-1]["lr"] < steps[4]["lr"] < steps[3]["lr"]
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ckpts == ["step_000004", "step_000008", "step_000012"]
    assert {p.name for p in (out / "checkpoints/step_000012").iterdir()} == {
        "adapters.safetensors", "adapter_config.json", "optimizer.safetensors", "state.json"}
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["fine_tune_type"] == "lora" and cfg["num_layers"] == -1
    assert cfg["lora_parameters"] == {"rank": 8, "scale": 20.0, "dropout": 0.0}
    model, _ = load(str(model_dir), adapter_path=str(out))  # mlx-lm reads our adapter
    trained = mx.load(str(out / "adapters.safetensors"))
    loaded = dict(model.parameters()["model"]["layers"][3]["self_attn"]["q_proj"])
    np.testing.assert_array_equal(loaded["lora_b"],
                                  trained["model.layers.3.self_attn.q_proj.lora_b"])


def small_cfg(out: Path, **kw) -> TrainConfig:
    return TrainConfig.from_dict(dict(
        model="tiny-llama", data="rows", adapter_path=str(out), plan=2, max_seq_length=64,
        iters=6, batch_size=2, grad_accumulation_steps=2, learning_rate=1e-2, warmup=1,
        lora_rank=4, lora_dropout=0.1, steps_per_eval=0, steps_per_report=1, save_every=2,
        progress=False) | kw)


def tiny_run(cfg: TrainConfig, rows: list[dict], grad_fn=None, callback=None, model=None
             ) -> dict:
    """What `segback train` does, on rows and a random tiny-llama (ByteTokenizer)."""
    model = model or build_model("tiny-llama")
    cli.attach(model, cfg)
    train_set = loop.as_dataset(rows, ByteTokenizer(), cfg, "train")
    return loop.train(model, cli.build_optimizer(cfg), train_set, None, cfg,
                      grad_fn or loop.segmented_grad_fn(cli.resolve_plan(cfg, model)),
                      training_callback=callback)


class Killed(Exception):
    pass


class KillAt:
    """mlx-lm's TrainingCallback that raises at a step's report (after its log record, before
    its checkpoint), as a kill would."""

    def __init__(self, step: int):
        self.step = step

    def on_train_loss_report(self, info: dict) -> None:
        if info["iteration"] == self.step:
            raise Killed

    def on_val_loss_report(self, info: dict) -> None:
        pass


def test_resume_gives_the_same_adapter_bit_for_bit(tmp_path):
    rows = chat_rows(9)  # 4 batches of 2 per epoch: 12 micro-batches cross epochs
    full = tiny_run(small_cfg(tmp_path / "full"), rows)
    with pytest.raises(Killed):  # after checkpoint 2: step 3's work is lost
        tiny_run(small_cfg(tmp_path / "resumed"), rows, callback=KillAt(3))
    assert not (tmp_path / "resumed/adapters.safetensors").exists()
    resumed = tiny_run(small_cfg(tmp_path / "resumed"), rows)
    assert resumed["resumed_from"] == 2

    a = mx.load(str(tmp_path / "full/adapters.safetensors"))
    b = mx.load(str(tmp_path / "resumed/adapters.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(np.array(a[k]), np.array(b[k]), err_msg=k)
    log_a = read_log(tmp_path / "full/train_log.jsonl")
    log_b = read_log(tmp_path / "resumed/train_log.jsonl")
    assert [r["step"] for r in log_b if "loss" in r] == list(range(1, 7))  # 3 replayed once
    assert [r for r in log_b if "resumed_from" in r][0]["resumed_from"] == 2
    assert [r["loss"] for r in log_a] == [r["loss"] for r in log_b if "loss" in r]
    assert full["tokens"] == resumed["tokens"] and full["final_loss"] == resumed["final_loss"]


def test_nan_guard_stops_and_keeps_last_good_checkpoint(tmp_path, capsys):
    calls = []

    def poisoned(model, batch, lengths):
        (loss, ntoks), grads = segmented(model, batch, lengths)
        calls.append(1)
        return (loss * (mx.nan if len(calls) == 5 else 1.0), ntoks), grads  # step 5's batch

    segmented = loop.segmented_grad_fn(1)
    cfg = small_cfg(tmp_path, iters=8, grad_accumulation_steps=1)
    with pytest.raises(TrainingDiverged, match="diverged at step 5.*step_000004"):
        tiny_run(cfg, chat_rows(4), grad_fn=poisoned)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_000002", "step_000004"]
    good = mx.load(str(tmp_path / "checkpoints/step_000004/adapters.safetensors"))
    assert all(np.isfinite(np.array(v)).all() for v in good.values())
    assert json.loads((tmp_path / "checkpoints/step_000004/state.json").read_text())["step"] == 4
    assert not (tmp_path / "adapters.safetensors").exists()
    assert not (tmp_path / "train_summary.json").exists()
    last = read_log(tmp_path / "train_log.jsonl")[-1]
    assert last["step"] == 5 and "diverged" in last["error"]


def test_cli_errors_are_one_line(model_dir, data_dir, tmp_path, capsys):
    rc = cli.main(parse(["--model", str(model_dir), "--data", str(data_dir), "--adapter-path",
                         str(tmp_path), "--plan", "2", "--tile", "auto"]))
    err = capsys.readouterr().err
    assert rc == 2 and "needs --plan auto" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_validation_loss_equals_mlx_lm_default_loss(tok):
    ds = encode_rows(tok, chat_rows(5), max_len=64)
    model = build_model("tiny-llama")
    batch, lengths = collate(ds.examples, 64)
    total, count = loop.eval_loss(model, batch, lengths)
    loss, ntoks = default_loss(model, batch, lengths)
    assert count == ntoks.item()
    np.testing.assert_allclose(total / count, loss.item(), rtol=1e-5)


def test_a_plan_is_checked_once_not_at_every_step(tmp_path, monkeypatch):
    """`resolve_plan` checks the plan against the model and the longest batch; the steps run
    its segments and engine options without checking it again."""
    cfg = small_cfg(tmp_path)
    model = build_model("tiny-llama")
    plan = cli.resolve_plan(cfg, model)
    checks = []
    monkeypatch.setattr(Plan, "check", lambda self, *a, **kw: checks.append(a))
    summary = tiny_run(cfg, chat_rows(8), loop.segmented_grad_fn(plan), model=model)
    assert summary["steps"] == cfg.iters and checks == []


def test_plan_engine_options_reach_the_engine(tmp_path):
    """A plan's engine options are what the trainer runs; engine flags given go on top."""
    from segback.planner import plan_segments

    model = build_model("tiny-llama")

    def plan(**kw):
        return cli.resolve_plan(small_cfg(tmp_path, **kw), model)

    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan_segments(model, 64, batch_size=2, segments=2,
                                             attention="chunked").to_dict()))
    p = plan(plan=str(path))
    assert p.segments == [(0, 2), (2, 4)] and p.engine.attention == "chunked"
    assert plan(plan=str(path), attention="fused").engine.attention == "fused"  # flag wins
    p = plan(plan="2", tile="16", offload="true")
    # tiled layers take the fused kernels where the device has them (chunked where not)
    assert (p.engine.tile, p.engine.offload, p.engine.attention) == (16, True, "fused")
    path.write_text(json.dumps(plan_segments(model, 256, 2, tile=64, offload=True,
                                             light_tile=128, boundaries_on_device=1).to_dict()))
    e = plan(plan=str(path), max_seq_length=256).engine
    assert (e.tile, e.offload, e.light_tile, e.boundaries_on_device) == (64, True, 128, 1)
    with pytest.raises(ValueError, match="needs --plan auto"):
        plan(plan="2", tile="auto")
    with pytest.raises(ValueError, match="--target-gb 1.0 needs --plan auto"):
        plan(plan=str(path), target_gb=1.0)
    with pytest.raises(ValueError, match="sequences of 256 tokens"):
        plan(plan=str(path), max_seq_length=512)  # a plan made for shorter sequences
    # --plan auto: the planner's choice runs; a target keeps boundaries on the device
    auto = plan(plan="auto", max_seq_length=256, tile="auto", offload="auto")
    want = plan_segments(model, 256, 2, tile="auto", offload="auto")
    assert auto.engine == want.engine and auto.segments == want.segments
    assert plan(plan="auto", max_seq_length=256, tile="64",
                offload="true").engine.boundaries_on_device == 0
    kept = plan(plan="auto", max_seq_length=256, tile="64", offload="true", target_gb=1.0)
    assert kept.segments == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert kept.engine.boundaries_on_device == 4
    measured = plan(plan="auto", max_seq_length=64, target_gb=1.0, measure_plan=2)
    # two asked, one timed: all of them take at most 3 of the pick's steps (a warm-up + a step)
    assert len(measured.inputs["measured"]) == 1 and measured.meets_target
    with pytest.raises(ValueError, match="--measure-plan 2 needs --plan auto"):
        plan(plan="2", measure_plan=2)


def test_tiled_training_matches_untiled(tmp_path, capsys):
    """`--tile` trains the same run as the untiled engine: the same losses; the adapters agree
    up to what Adam (lr 1e-2, each step moves an entry up to 1e-2) makes of rounding."""
    rows = chat_rows(4)
    runs = {}
    for name, kw in [("plain", {}), ("tiled", dict(tile="16", offload="true")),
                     ("eager", dict(tile="16", offload="true", compile="off"))]:
        cfg = small_cfg(tmp_path / name, lora_dropout=0.0, iters=3, grad_accumulation_steps=1,
                        **kw)
        model = build_model("tiny-llama")
        cli.attach(model, cfg)
        cli.describe(cli.resolve_plan(cfg, model), model, cfg)
        tiny_run(cfg, rows)
        runs[name] = [r["loss"] for r in read_log(tmp_path / name / "train_log.jsonl")]
    err = capsys.readouterr().err
    assert "tiles of 16 tokens, compiled tile functions, boundaries in host memory" in err
    assert "tiles of 16 tokens, eager tile functions" in err
    assert runs["plain"] == pytest.approx(runs["tiled"], rel=1e-4)
    assert runs["plain"] == pytest.approx(runs["eager"], rel=1e-4)  # --compile off
    a = mx.load(str(tmp_path / "plain/adapters.safetensors"))
    b = mx.load(str(tmp_path / "tiled/adapters.safetensors"))
    # An entry whose gradient is within rounding of zero can take one full Adam step (lr 1e-2)
    # the other way; all but a few entries agree far closer.
    for k in a:
        diff = np.abs(np.array(b[k]) - np.array(a[k]))
        assert diff.max() <= 1e-2, k
        assert np.mean(diff > 2e-3) <= 0.01, k


def test_checkpoint_dir_survives_the_adapter_dir_and_restarts_on_change(tmp_path, capsys):
    """Checkpoints outside --adapter-path: deleting the adapter directory (what Snakemake does
    to an interrupted job's outputs) loses nothing; changed settings start afresh with
    --restart-on-change; --clean-checkpoints removes all but the last once the adapter is
    written, so a rerun of the finished run (its workflow stopped before recording it) is
    instant and writes the same adapter."""
    import shutil

    rows = chat_rows(9)
    full = tiny_run(small_cfg(tmp_path / "full"), rows)
    ckpt = tmp_path / "ckpt"
    cfg = small_cfg(tmp_path / "out", checkpoint_dir=str(ckpt), restart_on_change=True)
    with pytest.raises(Killed):
        tiny_run(cfg, rows, callback=KillAt(5))
    shutil.rmtree(tmp_path / "out")
    assert [p.name for p in sorted(ckpt.iterdir()) if p.name.startswith("step")] == [
        "step_000002", "step_000004"]
    resumed = tiny_run(cfg, rows)
    assert resumed["resumed_from"] == 4
    a = mx.load(str(tmp_path / "full/adapters.safetensors"))
    b = mx.load(str(tmp_path / "out/adapters.safetensors"))
    for k in a:
        np.testing.assert_array_equal(np.array(a[k]), np.array(b[k]), err_msg=k)
    assert full["final_loss"] == resumed["final_loss"]

    changed = small_cfg(tmp_path / "out", checkpoint_dir=str(ckpt), restart_on_change=True,
                        learning_rate=5e-3, clean_checkpoints=True)
    again = tiny_run(changed, rows)
    assert again["resumed_from"] is None
    assert "another setting (learning_rate" in capsys.readouterr().err
    assert [p.name for p in ckpt.glob("step_*")] == ["step_000006"]
    done = (tmp_path / "out/adapters.safetensors").read_bytes()
    shutil.rmtree(tmp_path / "out")
    assert tiny_run(changed, rows)["resumed_from"] == 6  # no step trained again
    assert (tmp_path / "out/adapters.safetensors").read_bytes() == done


def test_full_disk_during_a_checkpoint_keeps_the_previous_one(tmp_path, monkeypatch):
    """A checkpoint that cannot be written (ENOSPC) stops the run with the path it could not
    write; the checkpoint before it is whole and the next run resumes from it."""
    import errno

    from segback.io import WriteError
    from segback.trainer import checkpoints

    real, calls = checkpoints.save_safetensors_atomic, []

    def full_on_second_checkpoint(path, arrays, *a, **k):
        calls.append(path)
        if "step_000004" in str(path):
            raise WriteError(errno.ENOSPC, f"could not write {path}: No space left on device")
        return real(path, arrays, *a, **k)

    monkeypatch.setattr(checkpoints, "save_safetensors_atomic", full_on_second_checkpoint)
    cfg = small_cfg(tmp_path, iters=6)
    with pytest.raises(WriteError, match="step_000004.*No space left"):
        tiny_run(cfg, chat_rows(4))
    assert [p.name for p in sorted((tmp_path / "checkpoints").glob("step_*"))] == [
        "step_000002"]
    monkeypatch.setattr(checkpoints, "save_safetensors_atomic", real)
    assert tiny_run(cfg, chat_rows(4))["resumed_from"] == 2


def test_unwritable_adapter_path_is_one_line(tmp_path, capsys):
    """An output directory that cannot be made (here under a file: permissions do not stop
    root) is named in one line, without a traceback."""
    from segback.cli import main

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    rc = main(["train", "--model", "tiny-llama", "--data", str(tmp_path),
               "--adapter-path", str(blocker / "out"), "--iters", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and str(blocker / "out") in err and "Traceback" not in err, err
