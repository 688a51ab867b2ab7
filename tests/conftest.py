import sys

import mlx.core as mx
import pytest


@pytest.fixture(autouse=True)
def _cpu_float32():
    """Tests run on CPU in float32 so exactness checks are tight."""
    mx.set_default_device(mx.cpu)
    yield


@pytest.fixture
def fake_env(tmp_path):
    """(env, calls file) running the workflow's rules with the stand-in `segback` of
    test_workflow.py (contract-shaped outputs in seconds)."""
    from test_workflow import FAKE_SEGBACK

    script = tmp_path / "fake_segback.py"
    script.write_text(FAKE_SEGBACK)
    calls = tmp_path / "calls.txt"
    return {"SEGBACK": f"{sys.executable} {script}", "FAKE_SEGBACK_CALLS": str(calls)}, calls
