"""The workflow's config, checked once when the workflow loads, with answers a user can act on.

jsonschema's own message for a misspelt key is a dump of the schema; here each problem is one
line naming the key path, what is wrong and what to write instead (a "did you mean" for unknown
keys, the `1.0e-3` spelling for numbers YAML read as strings), plus the checks a schema cannot
express (`min_sources <= max_sources`, finite numbers: JSON Schema's bounds let NaN through, as
every comparison with NaN is false) and a key given twice in one config file (YAML keeps the
last silently). All of it runs when the workflow loads, before Snakemake removes any output.
"""

from __future__ import annotations

import difflib
import json
import math
import re
from pathlib import Path
from typing import Any

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
    import jsonschema

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
    if problems:
        raise ConfigError("config: " + "\n  ".join(
            ["the workflow cannot run with this config; fix these keys "
             "(config/config.yaml documents each):", *problems]))


RESERVED_MODEL_NAMES = ("data", "logs", "benchmarks")  # folders of results/ themselves


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
    import yaml

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


def duplicate_keys(path: str | Path) -> list[str]:
    """A line for each key given twice in one mapping of the YAML file at `path`."""
    import yaml

    found: list[str] = []

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen: dict = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                if key in seen:
                    found.append(f"{path}, line {key_node.start_mark.line + 1}: key `{key}` is "
                                 f"given twice (also line {seen[key]}); YAML would keep the "
                                 "last silently: keep one")
                else:
                    seen[key] = key_node.start_mark.line + 1
            return super().construct_mapping(node, deep)

    try:
        yaml.load(Path(path).read_text(encoding="utf-8"), Loader=Loader)  # noqa: S506
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return []  # Snakemake has read it already, or says why it cannot
    return found
