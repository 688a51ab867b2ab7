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


# ---- YAML syntax errors name the file and the line (issue 40) ----------------------------------

BROKEN = "seq: 512\ntrain:\n  iters: [3\n  learning_rate: 5.0e-5\n"


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    from segback.experiment.config_check import check_files

    bad = tmp_path / "mine.yaml"
    bad.write_text(BROKEN)
    with pytest.raises(ConfigError) as err:
        check_files([REPO / "config" / "smoke.yaml", bad])
    msg = str(err.value)
    assert f"{bad}, line 4, column 16: not valid YAML" in msg, msg
    assert "flow sequence from line 3" in msg and "4 |   learning_rate: 5.0e-5" in msg
    tab = tmp_path / "tab.yaml"
    tab.write_text("seq: 512\ntrain:\n\titers: 3\n")
    with pytest.raises(ConfigError, match=rf"{tab}, line 3, column 1: .*spaces, not tabs"):
        check_files([tab])
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing\n")
    with pytest.raises(ConfigError, match=rf"{empty}: a config file maps keys to values"):
        check_files([empty])


def test_config_check_command_names_file_and_line(tmp_path):
    """`python -m segback.experiment.config_check FILE` (what `make run` runs before Snakemake,
    which reads --configfile files itself and names none)."""
    import subprocess
    import sys

    bad = tmp_path / "mine.yaml"
    bad.write_text(BROKEN)
    ok = subprocess.run([sys.executable, "-m", "segback.experiment.config_check",
                         str(REPO / "config" / "config.yaml")], capture_output=True, text=True)
    assert ok.returncode == 0 and not ok.stderr, ok.stderr
    out = subprocess.run([sys.executable, "-m", "segback.experiment.config_check", str(bad)],
                         capture_output=True, text=True)
    assert out.returncode == 1 and f"{bad}, line 4, column 16" in out.stderr, out.stderr


def test_workflow_default_configfile_syntax_error_names_file_and_line(tmp_path):
    """The Snakefile's own `configfile:` (config/config.yaml of the working directory) is checked
    before Snakemake reads it."""
    from test_workflow import snakemake

    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.yaml").write_text(BROKEN)
    out = snakemake(tmp_path, "-n", check=False)
    assert out.returncode != 0
    assert "config/config.yaml, line 4, column 16: not valid YAML" in out.stdout, out.stdout
    assert "Traceback" not in out.stdout


def test_trainer_config_file_syntax_error_names_file_and_line(tmp_path):
    from segback.trainer.config_file import TrainConfigError, read_config_file

    bad = tmp_path / "lora_config.yaml"
    bad.write_text("model: m\nlora_parameters:\n  rank: [8\n  scale: 20.0\n")
    with pytest.raises(TrainConfigError, match=rf"{bad}, line 4, column 8: not valid YAML"):
        read_config_file(bad)


# ---- coercion of --config strings (what the Snakefile did inline) ------------------------------

def test_coerce_config_types_command_line_strings(tmp_path):
    from segback.experiment.config_check import coerce_config

    cfg = coerce_config({"seq": ["1024", 2048, "x"],
                         "dataset": {"mask_prompt": "False", "scorer": "null", "seed": "-3",
                                     "test_fraction": "0.2", "valid_fraction": "a lot",
                                     "path": "d"}})
    assert cfg["seq"] == [1024, 2048, "x"]
    assert cfg["dataset"] == {"mask_prompt": False, "scorer": None, "seed": -3,
                              "test_fraction": 0.2, "valid_fraction": "a lot", "path": "d"}
    assert coerce_config({"dataset": str(tmp_path)})["dataset"] == {"path": str(tmp_path)}
    assert coerce_config({"dataset": "org/name"})["dataset"] == {"hf": "org/name"}


def test_reserved_dataset_names(config, tmp_path):
    from segback.experiment.config_check import RESERVED_DATASET_NAMES, prepare_config

    generic = {**{k: v for k, v in config.items() if k != "data"}, "task": "generic"}
    for name in (*RESERVED_DATASET_NAMES, "seq512"):
        with pytest.raises(ConfigError, match=rf"`dataset.name`: '{name}' is a folder name"):
            prepare_config({**generic, "dataset": {"path": str(tmp_path), "name": name}}, SCHEMA)
    prepare_config({**generic, "dataset": {"path": str(tmp_path), "name": "sequel"}}, SCHEMA)
