"""The engine options a `segback train` run is given, read once into typed values.

A config file or the command line gives them as strings or YAML scalars, under present or old
names; `parse` returns the options given, by present name, each in its type: what the run
records (`TrainConfig.engine`) and everything after reads. AUTO stays where the planner is to
choose (`segback.planner.space.AUTO_FIELDS`, with --plan auto); 'auto' for an option whose
default is the device's (compile, share_traces, host_table) is that default. From them the run
builds what --plan auto searches (`space`, `runtime`) or what a given plan runs (`on_top`).
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

from segback.engine.options import AUTO, OLD_NAMES, EngineOptions, OptionsError, \
    canonical_name, parse_options
from segback.planner.space import SEARCHED, SearchSpace
from segback.trainer.values import TrainConfigError, refuse_unknown

ENGINE_KEYS = tuple(f.name for f in fields(EngineOptions))
ENGINE_NAMES = (*ENGINE_KEYS, *OLD_NAMES)  # what a config may call them


def parse(values: dict[str, Any]) -> dict[str, Any]:
    """The engine options given (None: not given), typed and checked: a value the engine
    cannot run fails here, before any model is loaded. What the planner will choose cannot be
    checked yet; with a plan file, its options are checked once the given ones are on top."""
    values = {k: v for k, v in values.items() if v is not None}
    refuse_unknown({canonical_name(k): v for k, v in values.items()}, ENGINE_KEYS,
                   "engine options")
    try:
        given = parse_options(values, "engine options", auto=ENGINE_KEYS)
    except OptionsError as e:
        raise TrainConfigError(str(e)) from None
    for k, v in list(given.items()):
        if v == AUTO and k not in SEARCHED:
            if EngineOptions.__dataclass_fields__[k].default is not None:
                raise TrainConfigError(f"{k} has no 'auto' (it takes a value; see --help)")
            del given[k]  # the device's default
    try:
        if any(v == AUTO for v in given.values()):
            space(given)
            runtime(given)
        else:
            EngineOptions(**given)
    except OptionsError as e:
        raise TrainConfigError(f"engine options: {e}") from None
    return given


def asks_planner(given: dict[str, Any]) -> list[str]:
    """The options given as AUTO: the planner's to choose."""
    return sorted(k for k, v in given.items() if v == AUTO)


def space(given: dict[str, Any]) -> SearchSpace:
    """What --plan auto searches: the searched options given, on the planner's defaults."""
    return SearchSpace(**{k: v for k, v in given.items() if k in SEARCHED})


def runtime(given: dict[str, Any], attention: str = "fused") -> EngineOptions:
    """How the planner's plan runs: the run-time options given, on the defaults."""
    return EngineOptions(**{k: v for k, v in given.items() if k not in SEARCHED},
                         attention=attention)


def on_top(base: EngineOptions, given: dict[str, Any], where: str) -> EngineOptions:
    """`base` (a plan's options, or the defaults) with the options given on top."""
    try:
        return replace(base, **given)
    except OptionsError as e:
        raise OptionsError(f"{where}: {e}") from None
