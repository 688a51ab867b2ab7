"""The workflow's config, checked once when the workflow loads, with answers a user can act on.

jsonschema's own message for a misspelt key is a dump of the schema; here each problem is one
line naming the key path, what is wrong and what to write instead (a "did you mean" for unknown
keys, the `1.0e-3` spelling for numbers YAML read as strings), plus the checks a schema cannot
express (`min_sources <= max_sources`, finite numbers: JSON Schema's bounds let NaN through, as
every comparison with NaN is false) and a key given twice in one config file (YAML keeps the
last silently). All of it runs when the workflow loads, before Snakemake removes any output.

`prepare_config` is what the Snakefile calls: it first turns `--config` strings into the
schema's types and expands the `dataset` shorthand (`coerce_config`), then checks. The names a
config may not give (`RESERVED_MODEL_NAMES`, `RESERVED_DATASET_NAMES`) are listed here only.
`python -m segback.experiment.config_check FILE...` reads config files as YAML and names the
file, line and column of a syntax error (Snakemake reads `--configfile` files before the
Snakefile runs and says only that one is not valid YAML); `make run` runs it first.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from segback.io import duplicate_keys, yaml_problem

NUMBER_LIKE = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+$")


class ConfigError(ValueError):
    """The config has keys or values the workflow cannot run; the message lists each."""


def _path(parts: Any) -> str:
    return ".".join(str(p) for p in parts) or "(top level)"


def _subschema(schema: dict, path: list, root: dict) -> dict:
    """The schema object that describes the object at `path` (following $ref)."""
    node = schema
    for part in path:
        while "$ref" in node:
            node = root["$defs"][node["$ref"].rsplit("/", 1)[-1]]
        props = node.get("properties", {})
        node = props.get(part) if part in props else node.get("additionalProperties", {})
        if not isinstance(node, dict):
            return {}
    while "$ref" in node:
        node = root["$defs"][node["$ref"].rsplit("/", 1)[-1]]
    return node


def explain(error: Any, schema: dict) -> str:
    """One line for one jsonschema error."""
    where = _path(error.absolute_path)
    if error.validator == "additionalProperties":
        known = sorted(_subschema(schema, list(error.absolute_path), schema).get("properties", {}))
        extra = sorted(set(error.instance) - set(known))
        lines = []
        for key in extra:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"did you mean `{close[0]}`?" if close else f"known keys: {', '.join(known)}"
            lines.append(f"unknown key `{_path([*error.absolute_path, key])}`: {hint}")
        return "; ".join(lines)
    if error.validator == "type" and isinstance(error.instance, str) \
            and NUMBER_LIKE.match(error.instance.strip()):
        mant, exp = re.split("[eE]", error.instance.strip())
        fixed = f"{mant if '.' in mant else mant + '.0'}e{exp}"
        return (f"`{where}`: {error.instance!r} was read as a string (YAML needs a dot in the "
                f"mantissa): write {fixed}")
    if error.validator == "required":
        return f"`{where}`: {error.message}"
    return f"`{where}`: {error.message}"


def check_config(config: dict, schema_path: str | Path,
                 files: list[str | Path] = ()) -> None:
    """Raise ConfigError listing every problem of `config` (merged from `files`), else
    return."""
    schema = json.loads(Path(schema_path).read_text())
    validator = jsonschema.Draft202012Validator(schema)
    problems = [p for f in files for p in duplicate_keys(f)]
    problems += [explain(e, schema) for e in sorted(validator.iter_errors(config),
                                                    key=lambda e: list(e.absolute_path))]
    problems += [f"{_where(files, path)}`{_path(path)}`: {value} is not a finite number "
                 "(YAML reads .nan and .inf as NaN and infinity); write a number"
                 for path, value in non_finite(config)]
    data = config.get("data") if isinstance(config.get("data"), dict) else {}
    lo, hi = data.get("min_sources"), data.get("max_sources")
    if isinstance(lo, int) and isinstance(hi, int) and lo > hi:
        problems.append(f"`data.min_sources` ({lo}) is larger than `data.max_sources` ({hi}): "
                        "a case stitches between min and max conversations; swap or fix them")
    train = config.get("train") if isinstance(config.get("train"), dict) else {}
    batch, ranks = train.get("batch_size"), train.get("ranks", 1)
    if isinstance(batch, int) and isinstance(ranks, int) and ranks > 1 and batch % ranks:
        problems.append(f"`train.batch_size` ({batch}) is the global batch, split across "
                        f"`train.ranks` ({ranks}) as in mlx_lm.lora: give a multiple of {ranks}")
    problems += _random_only_problems(config.get("models"))
    problems += _model_problems(config)
    problems += _window_problems(config)
    if config.get("task") == "generic" and isinstance(config.get("dataset"), dict):
        problems += _dataset_problems(config["dataset"])
    if problems:
        raise ConfigError("config: " + "\n  ".join(
            ["the workflow cannot run with this config; fix these keys "
             "(config/README.md documents each):", *problems]))


# Names a config may not give, because they are folders beside the ones it names: a model's
# (results/{model}/) beside results/data, logs and benchmarks; a dataset's
# (results/{model}/{name}/, task: generic) beside a model's own folders and its seq{N}/ branches.
RESERVED_MODEL_NAMES = ("data", "logs", "benchmarks")
RESERVED_DATASET_NAMES = ("model", "data", "baseline", "config", "logs", "benchmarks")
RESERVED_DATASET_PATTERN = r"seq\d"  # a branch folder, results/{model}/seq{seq}/


def reserved_dataset_name(name: str) -> bool:
    """Whether `dataset.name` would collide with a folder of results/{model}/."""
    return name in RESERVED_DATASET_NAMES or re.match(RESERVED_DATASET_PATTERN, name) is not None


def _dataset_problems(dataset: dict) -> list[str]:
    """What the schema cannot say about `dataset` (task: generic), one line each."""
    problems = []
    if ("path" in dataset) == ("hf" in dataset):
        problems.append("`dataset`: give `path` (a local directory or data file) or `hf` (a "
                        "Hugging Face dataset name), " + ("not both" if "path" in dataset
                                                         else "one of them"))
    path = dataset.get("path")
    if isinstance(path, str) and not os.path.exists(os.path.expanduser(path)):
        problems.append(f"`dataset.path`: {path} not found (a relative path is relative to the "
                        f"working directory, {os.getcwd()})")
    name = dataset.get("name", "generic")
    if isinstance(name, str) and reserved_dataset_name(name):
        problems.append(f"`dataset.name`: {name!r} is a folder name of results/{{model}}/; "
                        "choose another")
    return problems


def _model_problems(config: dict) -> list[str]:
    """`model` (or each of a list) must name an entry of `models`, which has no reserved name."""
    models = config.get("models")
    if not isinstance(models, dict):
        return []
    chosen = config.get("model")
    problems = [f"`model`: {m!r} is not an entry of `models` (known: "
                f"{', '.join(sorted(models))}); add it under `models` or pick one of those"
                for m in (chosen if isinstance(chosen, list) else [chosen])
                if isinstance(m, str) and m not in models]
    problems += [f"`models.{m}`: {m!r} is reserved (a folder of results/); rename it"
                 for m in RESERVED_MODEL_NAMES if m in models]
    return problems


def _window_problems(config: dict) -> list[str]:
    """Windows cut chunking cases, and only cases longer than a window need cutting."""
    train = config.get("train") if isinstance(config.get("train"), dict) else {}
    windows = train.get("window")
    windows = [w for w in (windows if isinstance(windows, list) else [windows])
               if isinstance(w, int) and not isinstance(w, bool)]
    if not windows:
        return []
    if config.get("task") == "generic":
        return ["`train.window`: cuts chunking cases into windows (task: chunking); with task: "
                "generic leave it out"]
    seqs = config.get("seq") if isinstance(config.get("seq"), list) else [config.get("seq")]
    return [f"`train.window`: {w} is not shorter than `seq` {s}: a window that holds the whole "
            "case is the whole case; give a shorter window or null"
            for w in windows for s in seqs if isinstance(s, int) and w >= s]


def _random_only_problems(models: Any) -> list[str]:
    """Quantizing is for random weights: other sources are used as they are stored."""
    if not isinstance(models, dict):
        return []
    return [f"`models.{name}.quant_bits`: for source: random only (a {m.get('source')} model "
            "is used as stored; pick a quantized checkpoint instead)"
            for name, m in models.items()
            if isinstance(m, dict) and m.get("quant_bits") is not None
            and m.get("source") != "random"]


def non_finite(value: Any, path: tuple = ()) -> list[tuple[tuple, float]]:
    """(key path, value) of every NaN or infinite number in `value`."""
    if isinstance(value, float) and not math.isfinite(value):
        return [(path, value)]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in non_finite(v, (*path, k))]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in non_finite(v, (*path, i))]
    return []


def _where(files: list[str | Path], path: tuple) -> str:
    """'FILE: ' for the last of `files` that sets `path` (the one that wins), else ''."""
    for f in reversed(list(files)):
        try:
            node = yaml.safe_load(Path(f).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            continue
        for key in path:
            if not isinstance(node, (dict, list)):
                break
            try:
                node = node[key]
            except (KeyError, IndexError, TypeError):
                break
        else:
            return f"{f}: "
    return ""  # from --config


# ---- what the Snakefile calls ------------------------------------------------------------------

def _dataset_value(key: str, value: Any) -> Any:
    """A `dataset` value as --config gives it (a string) in the schema's type."""
    if not isinstance(value, str):
        return value
    if key == "mask_prompt" and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if key == "scorer" and value.lower() in ("null", "none", ""):
        return None
    if key == "seed" and value.lstrip("-").isdigit():
        return int(value)
    if key in ("valid_fraction", "test_fraction"):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def coerce_config(config: dict) -> dict:
    """`config` (in place) with what `--config` writes as strings in the schema's types.

    `--config seq=[1024,2048]` reads list items as strings (Snakemake parses --config values with
    YAML's base loader): integer-looking ones become integers. `dataset: my.jsonl` (or
    `--config dataset=my.jsonl`) is short for {path: ...} when the path exists, else for
    {hf: ...} (a Hugging Face dataset name), as `segback train --data` reads it; a `dataset`
    section given as JSON on the command line gets its booleans, numbers and null back."""
    if isinstance(config.get("seq"), list):
        config["seq"] = [int(v) if isinstance(v, str) and v.isdigit() else v
                         for v in config["seq"]]
    dataset = config.get("dataset")
    if isinstance(dataset, str):
        exists = os.path.exists(os.path.expanduser(dataset))
        config["dataset"] = {"path": dataset} if exists else {"hf": dataset}
    if isinstance(config.get("dataset"), dict):
        config["dataset"] = {k: _dataset_value(k, v) for k, v in config["dataset"].items()}
    return config


def prepare_config(config: dict, schema_path: str | Path,
                   files: list[str | Path] = ()) -> dict:
    """The workflow's config, coerced (`coerce_config`, in place) and checked (`check_config`):
    raises ConfigError naming every problem, else returns `config`."""
    coerce_config(config)
    check_config(config, schema_path, files)
    return config


def read_yaml(path: str | Path) -> Any:
    """The YAML file at `path`, or ConfigError naming the file (and the line of a syntax
    error)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{path}: cannot be read ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file (UTF-8)") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(yaml_problem(path, e, text)) from None


def check_files(paths: list[str | Path]) -> None:
    """Raise ConfigError for the config files that are not YAML mappings (naming the file, and
    the line of a syntax error) or give a key twice; else return."""
    problems = []
    for path in paths:
        try:
            value = read_yaml(path)
        except ConfigError as e:
            problems.append(str(e))
            continue
        if not isinstance(value, dict):
            what = "empty" if value is None else f"a {type(value).__name__}, not a mapping"
            problems.append(f"{path}: a config file maps keys to values (config/README.md); "
                            f"this one is {what}")
            continue
        problems += duplicate_keys(path)
    if problems:
        raise ConfigError("config: " + "\n  ".join(problems))


def checked_configfile(path: str) -> str:
    """The Snakefile's `configfile:` path, checked first (exits naming the file and line of a
    YAML error); a path that does not exist is Snakemake's to skip or report."""
    if os.path.exists(path):
        try:
            check_files([path])
        except ConfigError as e:
            sys.exit(str(e))
    return path


def main(argv: list[str] | None = None) -> int:
    """`python -m segback.experiment.config_check FILE...`: exit 1 naming each file that is not a
    readable YAML mapping (file, line and column of a syntax error) or gives a key twice."""
    paths = sys.argv[1:] if argv is None else argv
    try:
        check_files(paths)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
