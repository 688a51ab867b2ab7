"""`segback train -c FILE`: a YAML config (mlx-lm's lora_config.yaml) or an adapter_config.json,
read as option names (`normalize`); a syntax error or a key given twice names its line."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from segback.io import duplicate_keys, yaml_problem
from segback.trainer.config import normalize
from segback.trainer.values import TrainConfigError


class _Loader(yaml.SafeLoader):
    """YAML with mlx-lm's float resolver (mlx_lm.lora): 1e-5 is a float, not a string."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+][0-9]+)?
    |[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\.[0-9_]*
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."))


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A YAML config (mlx-lm's lora_config.yaml) or an adapter_config.json, as option names."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise TrainConfigError(f"config file not found: {path}") from None
    try:
        values = json.loads(text) if path.suffix == ".json" else yaml.load(text, _Loader)
    except json.JSONDecodeError as e:
        raise TrainConfigError(f"{path}, line {e.lineno}, column {e.colno}: not valid JSON "
                               f"({e.msg})") from None
    except yaml.YAMLError as e:  # the file, line and column, and the line itself
        raise TrainConfigError(yaml_problem(path, e, text)) from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise TrainConfigError(f"{path}: a config file is a mapping of option names to values")
    if path.suffix != ".json":
        twice = duplicate_keys(path)
        if twice:
            raise TrainConfigError(twice[0])
    return normalize(values, str(path))
