"""bench/step_profile.py: the phases add up to the step, and timing them leaves the step as is."""

import importlib.util
import json
from pathlib import Path

import mlx.core as mx
from mlx_lm.tuner.utils import linear_to_lora_layers

from segback.engine import value_and_grad
from segback.models.random_init import build_model
from segback.planner import plan_segments


def _script():
    path = Path(__file__).resolve().parents[1] / "bench" / "step_profile.py"
    spec = importlib.util.spec_from_file_location("step_profile", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_phases_add_up_and_the_step_is_unchanged():
    profile = _script()
    model = build_model("tiny-e4b")
    model.freeze()
    linear_to_lora_layers(model, len(model.layers), {"rank": 4, "scale": 20.0, "dropout": 0.0})
    plan = plan_segments(model, 128, segments=3)
    batch = mx.random.randint(0, model.args.vocab_size, (1, 129), key=mx.random.key(1))
    (loss, _), _ = value_and_grad(model, batch, [[0, 128]], plan)
    eval_before = mx.eval
    row = profile.profile_step(model, batch, [[0, 128]], plan)
    assert mx.eval is eval_before  # the instrumentation is taken off again
    assert abs(row["loss"] - float(loss)) < 1e-5
    phases = sum(row[f"{p}_s"] for p in profile.PHASES)
    assert abs(phases - row["step_s"]) < 1e-3
    for p in profile.PHASES:
        assert row[f"{p}_evals"] >= 1
        assert 0 <= row[f"{p}_in_eval_s"] <= row[f"{p}_s"] + 1e-6
    assert row["forward_evals"] >= 3 and row["backward_evals"] >= 3  # one a segment at least


def test_the_warm_up_step_alone_with_progress_lines(capsys):
    profile = _script()
    assert profile.main(["--model", "tiny-e4b", "--seq", "128", "--tile", "64",
                         "--offload", "false", "--segments", "4", "--repeats", "0",
                         "--progress", "0"]) == 0
    out, err = capsys.readouterr()
    row = json.loads(out.strip().splitlines()[-1])
    assert row["warm"] is False and len(row["step_s_all"]) == 1 and row["tile"] == 64
    assert row["segments"] == 3  # 12 layers, 4 a segment
    lines = [x for x in err.splitlines() if x.startswith("step_profile: ")]
    evals = sum(row[f"{p}_evals"] for p in profile.PHASES)
    assert len(lines) == evals  # --progress 0: a line after every evaluation
    assert {x.split(", ")[1] for x in lines} == set(profile.PHASES)
