"""Bad workflow configs get one line per problem, naming the key and the fix."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from segback.config_check import ConfigError, check_config

REPO = Path(__file__).resolve().parents[1]
SCHEMA = REPO / "workflow" / "schemas" / "config.schema.json"


@pytest.fixture
def config():
    return yaml.safe_load((REPO / "config" / "smoke.yaml").read_text())


def test_shipped_configs_pass():
    for name in ("config.yaml", "smoke.yaml"):
        check_config(yaml.safe_load((REPO / "config" / name).read_text()), SCHEMA)


@pytest.mark.parametrize("edit,expected", [
    (lambda c: c["train"].update(iter=3), "unknown key `train.iter`: did you mean `iters`?"),
    (lambda c: c.update(sek=4), "unknown key `sek`: did you mean `seq`?"),
    (lambda c: c["train"].update(learning_rate="1e-3"), "write 1.0e-3"),
    (lambda c: c.update(seq=0), "`seq`: 0 is less than the minimum"),
    (lambda c: c.update(seq="2048"), "`seq`: '2048' is not of type 'integer'"),
    (lambda c: c["train"].update(measure_plan="all"), "`train.measure_plan`: 'all' is not valid"),
    (lambda c: c["data"].update(min_sources=5, max_sources=2),
     "`data.min_sources` (5) is larger than `data.max_sources` (2)"),
])
def test_each_problem_is_named(config, edit, expected):
    bad = copy.deepcopy(config)
    edit(bad)
    with pytest.raises(ConfigError) as err:
        check_config(bad, SCHEMA)
    assert expected in str(err.value)
    assert "additionalProperties" not in str(err.value)  # no schema dump
    assert len(str(err.value).splitlines()) <= 3
