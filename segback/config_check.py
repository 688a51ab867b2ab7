"""The workflow's config, checked once when the workflow loads, with answers a user can act on.

jsonschema's own message for a misspelt key is a dump of the schema; here each problem is one
line naming the key path, what is wrong and what to write instead (a "did you mean" for unknown
keys, the `1.0e-3` spelling for numbers YAML read as strings), plus the checks a schema cannot
express (`min_sources <= max_sources`).
"""

from __future__ import annotations

import difflib
import json
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


def check_config(config: dict, schema_path: str | Path) -> None:
    """Raise ConfigError listing every problem of `config`, else return."""
    import jsonschema

    schema = json.loads(Path(schema_path).read_text())
    validator = jsonschema.Draft202012Validator(schema)
    problems = [explain(e, schema) for e in sorted(validator.iter_errors(config),
                                                   key=lambda e: list(e.absolute_path))]
    data = config.get("data") if isinstance(config.get("data"), dict) else {}
    lo, hi = data.get("min_sources"), data.get("max_sources")
    if isinstance(lo, int) and isinstance(hi, int) and lo > hi:
        problems.append(f"`data.min_sources` ({lo}) is larger than `data.max_sources` ({hi}): "
                        "a case stitches between min and max conversations; swap or fix them")
    problems += _random_only_problems(config.get("models"))
    if problems:
        raise ConfigError("config: " + "\n  ".join(
            ["the workflow cannot run with this config; fix these keys "
             "(config/config.yaml documents each):", *problems]))


def _random_only_problems(models: Any) -> list[str]:
    """Quantizing is for random weights: other sources are used as they are stored."""
    if not isinstance(models, dict):
        return []
    return [f"`models.{name}.quant_bits`: for source: random only (a {m.get('source')} model "
            "is used as stored; pick a quantized checkpoint instead)"
            for name, m in models.items()
            if isinstance(m, dict) and m.get("quant_bits") is not None
            and m.get("source") != "random"]
