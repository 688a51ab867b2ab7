"""`segback train`'s option values: each in its declared type, checked, or an error naming it.

`convert` reads one value as a config file (YAML scalars, mlx-lm's spellings) or the command line
(strings) gives it; the mappings mlx-lm's config carries (`lora_parameters`, `optimizer_config`,
`lr_schedule`) are checked key by key.
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import MISSING
from typing import Any

import mlx.optimizers as optim
from mlx_lm.utils import _parse_size

from segback.engine.options import AUTO
from segback.planner.measure import parse_measure

OPTIMIZERS = ("adam", "adamw", "muon", "sgd", "adafactor")  # mlx_lm.lora's (a test checks)
FINE_TUNE_TYPES = ("lora", "dora", "full")
SCHEDULES = ("cosine", "constant")
LORA_KEYS = ("rank", "scale", "dropout", "keys")
SCHEDULE_KEYS = ("name", "warmup", "warmup_init", "arguments")

# Declared types that are not Python types.
SCHEDULE = "schedule"  # lr_schedule: a name (cosine, constant) or mlx-lm's mapping
PLAN = "plan"  # auto | FILE.json | layers per segment | [[start, stop], ...]
MEASURE = "measure"  # auto | a count >= 0
MAPPING = "mapping"
STRINGS = "strings"
SIZE = "size"  # bytes, or "2GB" as mlx-lm's --clear-cache-threshold


class TrainConfigError(ValueError):
    """An option with a value segback train cannot run; the message names the option."""


def refuse_unknown(values: dict, known: Any, where: str) -> None:
    """Refuse a key not in `known`, naming the closest known one."""
    for key in values:
        if key not in known:
            close = difflib.get_close_matches(str(key), list(known), n=1, cutoff=0.6)
            hint = f"; did you mean '{close[0]}'?" if close else \
                f"; known: {', '.join(sorted(known))}"
            raise TrainConfigError(f"{where}: unknown option '{key}'{hint}")


def _name(f: Any) -> str:
    flag = f" (--{f.name.replace('_', '-')})" if f.metadata["cli"] else ""
    return f"{f.name}{flag}"


def _number(v: Any, kind: type, what: str) -> Any:
    """An int or float from a number or a string (PyYAML reads 1e-5 as a string)."""
    if isinstance(v, bool):
        raise TrainConfigError(f"{what} must be a number, not {v!r}")
    if isinstance(v, str):
        try:
            v = float(v.strip()) if kind is float or not re.fullmatch(r"\s*[-+]?\d+\s*", v) \
                else int(v)
        except ValueError:
            raise TrainConfigError(f"{what} must be a number, not {v!r}") from None
    if not isinstance(v, (int, float)) or (isinstance(v, float) and not math.isfinite(v)):
        raise TrainConfigError(f"{what} must be a finite number, not {v!r}")
    if kind is int:
        if v != int(v):
            raise TrainConfigError(f"{what} must be a whole number, not {v!r}")
        return int(v)
    return float(v)


def _boolean(v: Any, what: str) -> bool:
    if isinstance(v, bool):
        return v
    low = str(v).strip().lower()
    if low in ("true", "on", "yes", "1", "false", "off", "no", "0"):
        return low in ("true", "on", "yes", "1")
    raise TrainConfigError(f"{what} must be true or false, not {v!r}")


def _size(v: Any, what: str) -> int:
    if isinstance(v, str) and re.fullmatch(r"\s*[\d.]+\s*[MmGg]?[Bb]?\s*", v):
        return _parse_size(v.strip())  # as mlx-lm reads --clear-cache-threshold
    return _number(v, int, what)


def convert(f: Any, v: Any) -> Any:
    """One option's value in its declared type, checked."""
    kind, what = f.metadata["type"], _name(f)
    if v is None:
        if kind is MAPPING and f.default is MISSING:
            return f.default_factory()  # mlx-lm writes lora_parameters: null for full
        if f.default is not None and f.name != "lr_schedule":  # null lr_schedule: constant
            raise TrainConfigError(f"{what} needs a value")
        return None
    if kind in (int, float):
        v = _number(v, kind, what)
    elif kind is bool:
        v = _boolean(v, what)
    elif kind is SIZE:
        v = _size(v, what)
    elif kind is str:
        if isinstance(v, (dict, list, bool)):
            raise TrainConfigError(f"{what} must be a string, not {v!r}")
        v = str(v)
    elif kind is STRINGS:
        v = [v] if isinstance(v, str) else v
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise TrainConfigError(f"{what} must be a list of strings, not {v!r}")
    elif kind is MAPPING:
        if f.name == "hf_dataset" and isinstance(v, list):
            return v
        if not isinstance(v, dict):
            raise TrainConfigError(f"{what} must be a mapping, not {v!r}")
        v = dict(v)
    elif kind is PLAN:
        v = _plan(v, what)
    elif kind is MEASURE:
        if isinstance(v, str):
            try:
                v = parse_measure(v)
            except ValueError as e:
                raise TrainConfigError(f"{what} {e}") from None
        else:
            v = _number(v, int, what)
        if v != AUTO and v < 0:
            raise TrainConfigError(f"{what} {v!r}: must be auto or >= 0")
    elif kind is SCHEDULE:
        v = _schedule(v, what)
    choices = f.metadata["choices"]
    if choices and isinstance(v, str) and v not in choices:
        raise TrainConfigError(f"{what} must be one of {', '.join(choices)}, not {v!r}")
    check = f.metadata["check"]
    problem = check(v) if check else None
    if problem:
        raise TrainConfigError(f"{what} {v!r}: {problem}")
    return v


def _plan(v: Any, what: str) -> Any:
    if isinstance(v, str) and re.fullmatch(r"\s*\d+\s*", v):
        v = int(v)
    if isinstance(v, bool) or (isinstance(v, int) and v < 1):
        raise TrainConfigError(f"{what} {v!r}: must be auto, a plan file or layers per "
                               "segment >= 1")
    if isinstance(v, (int, str, list)):
        return v
    raise TrainConfigError(f"{what} must be auto, a plan JSON file, layers per segment or a list "
                           f"of [start, stop] ranges, not {v!r}")


def _schedule(v: Any, what: str) -> Any:
    if isinstance(v, str):
        return v
    if not isinstance(v, dict):
        raise TrainConfigError(f"{what} must be {' or '.join(SCHEDULES)} or a mapping "
                               f"{{{', '.join(SCHEDULE_KEYS)}}}, not {v!r}")
    v = dict(v)
    refuse_unknown(v, SCHEDULE_KEYS, "lr_schedule")
    name = v.get("name")
    if not isinstance(name, str) or not callable(getattr(optim.schedulers, name, None)):
        raise TrainConfigError(f"lr_schedule.name must name a schedule of mlx.optimizers "
                               f"(cosine_decay, linear_schedule, ...), not {name!r}")
    if not isinstance(v.get("arguments"), list) or not v["arguments"]:
        raise TrainConfigError(f"lr_schedule.arguments must be a list (the first is the initial "
                               f"learning rate), not {v.get('arguments')!r}")
    v["arguments"] = [_number(a, float, f"lr_schedule.arguments[{i}]")
                      if isinstance(a, str) else a for i, a in enumerate(v["arguments"])]
    if "warmup" in v:
        v["warmup"] = _number(v["warmup"], int, "lr_schedule.warmup")
        if v["warmup"] < 0:
            raise TrainConfigError(f"lr_schedule.warmup {v['warmup']}: must be >= 0")
    if "warmup_init" in v:
        v["warmup_init"] = _number(v["warmup_init"], float, "lr_schedule.warmup_init")
    return v


def check_lora_parameters(p: dict) -> dict:
    if "alpha" in p and "scale" not in p:
        raise TrainConfigError("lora_parameters has 'alpha': mlx-lm's LoRA uses 'scale' "
                               "(= PEFT alpha / rank)")
    refuse_unknown(p, LORA_KEYS, "lora_parameters")
    out = {"rank": 8, "scale": 20.0, "dropout": 0.0} | p
    out["rank"] = _number(out["rank"], int, "lora_parameters.rank (--lora-rank)")
    if out["rank"] < 1:
        raise TrainConfigError(f"lora_parameters.rank (--lora-rank) {out['rank']}: must be >= 1")
    out["scale"] = _number(out["scale"], float, "lora_parameters.scale (--lora-scale)")
    out["dropout"] = _number(out["dropout"], float, "lora_parameters.dropout (--lora-dropout)")
    if not 0 <= out["dropout"] < 1:
        raise TrainConfigError(f"lora_parameters.dropout (--lora-dropout) {out['dropout']}: must "
                               "be in [0, 1)")
    keys = out.get("keys")
    if keys is None:
        out.pop("keys", None)
    elif not (isinstance(keys, list) and keys and all(isinstance(k, str) for k in keys)):
        raise TrainConfigError(f"lora_parameters.keys (--lora-keys) must be a list of module "
                               f"paths, not {keys!r}")
    return out


def check_optimizer_config(c: dict) -> dict:
    refuse_unknown(c, OPTIMIZERS, "optimizer_config")
    out = {}
    for name, kwargs in c.items():
        if kwargs is None:
            kwargs = {}
        if not isinstance(kwargs, dict):
            raise TrainConfigError(f"optimizer_config.{name} must be a mapping of keyword "
                                   f"arguments, not {kwargs!r}")
        out[name] = dict(kwargs)
    return out
