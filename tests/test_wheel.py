"""The built wheel works outside the source tree: its schemas are package data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_wheel_plans_and_summarizes_outside_the_tree(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(dist), str(REPO)], check=True, cwd=tmp_path)
    wheel = next(dist.glob("segback-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for data in ("segback/engine/plan.schema.json", "segback/experiment/result.schema.json"):
        assert data in names, names
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                    str(site), str(wheel)], check=True, cwd=tmp_path)
    env = {**os.environ, "PYTHONPATH": str(site)}
    run = tmp_path / "run"
    run.mkdir()

    def segback(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "segback.cli", *args], cwd=run, env=env,
                              capture_output=True, text=True)

    where = subprocess.run([sys.executable, "-c", "import segback; print(segback.__file__)"],
                           cwd=run, env=env, capture_output=True, text=True, check=True)
    assert where.stdout.startswith(str(site)), where.stdout  # the wheel, not the checkout
    plan = segback("plan", "--model", "tiny-llama", "--seq", "256", "--out", "plan.json")
    assert plan.returncode == 0, plan.stderr
    assert json.loads((run / "plan.json").read_text())["segments"][0][0] == 0
    from test_workflow import fake_score

    inputs = {"base": fake_score(10.0), "tuned": fake_score(80.0),
              "summary": {"steps": 2, "seq": 256, "segments": [[0, 4]], "peak_gb": 0.1,
                          "seconds": 1.0}}
    for name, obj in inputs.items():
        (run / f"{name}.json").write_text(json.dumps(obj))
    summary = segback("summarize", "--model-name", "tiny", "--baseline", "base.json",
                      "--finetuned", "tuned.json", "--train-summary", "summary.json",
                      "--plan", "plan.json", "--out", "result.json")
    assert summary.returncode == 0, summary.stderr  # validated against the packaged schema
    assert json.loads((run / "result.json").read_text())["delta"]["mean_score"] == 70.0
