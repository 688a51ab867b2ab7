"""Bad workflow configs get one line per problem, naming the key and the fix."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from segback.experiment.config_check import ConfigError, check_config

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
    (lambda c: c["train"].update(batch_size=3, ranks=2),
     "`train.batch_size` (3) is the global batch, split across `train.ranks` (2)"),
])
def test_each_problem_is_named(config, edit, expected):
    bad = copy.deepcopy(config)
    edit(bad)
    with pytest.raises(ConfigError) as err:
        check_config(bad, SCHEMA)
    assert expected in str(err.value)
    assert "additionalProperties" not in str(err.value)  # no schema dump
    assert len(str(err.value).splitlines()) <= 3


@pytest.mark.parametrize("key", ["learning_rate", "lora_scale", "lora_dropout", "target_gb"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_numbers_are_refused(config, key, value):
    """JSON Schema's bounds compare false with NaN, so .nan passed them; the job then failed
    after Snakemake had removed the finished outputs."""
    config["train"][key] = value
    with pytest.raises(ConfigError, match=rf"`train\.{key}`: {value} is not a finite number"):
        check_config(config, SCHEMA)


def test_non_finite_names_the_file_that_sets_it(config, tmp_path):
    over = tmp_path / "mine.yaml"
    over.write_text("train:\n  learning_rate: .nan\n")
    with pytest.raises(ConfigError, match=rf"{over}: `train.learning_rate`: nan"):
        check_config({**config, "train": {**config["train"], "learning_rate": float("nan")}},
                     SCHEMA, [REPO / "config" / "smoke.yaml", over])


def test_duplicate_keys_name_file_and_lines(config, tmp_path):
    over = tmp_path / "dup.yaml"
    over.write_text("seq: 512\ntrain:\n  iters: 3\n  iters: 5\nseq: 256\n")
    with pytest.raises(ConfigError) as err:
        check_config(config, SCHEMA, [over])
    msg = str(err.value)
    assert f"{over}, line 5: key `seq` is given twice (also line 1)" in msg
    assert f"{over}, line 4: key `iters` is given twice (also line 3)" in msg


def test_unknown_and_reserved_model_names(config):
    with pytest.raises(ConfigError, match=r"`model`: 'nosuch' is not an entry of `models` "
                                          r"\(known: tiny\)"):
        check_config({**config, "model": "nosuch"}, SCHEMA)
    models = {**config["models"], "logs": config["models"]["tiny"]}
    with pytest.raises(ConfigError, match=r"`models.logs`: 'logs' is reserved"):
        check_config({**config, "models": models}, SCHEMA)
