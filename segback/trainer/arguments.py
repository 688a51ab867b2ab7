"""`segback train`'s command line: one flag per declared option (`TrainConfig`) and its
aliases, plus the engine's own flags; `from_args` layers them over a -c config file."""

from __future__ import annotations

import argparse
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

from segback.engine import options as engine_options
from segback.trainer.config import FIELDS, TrainConfig
from segback.trainer.config_file import read_config_file
from segback.trainer.engine_request import ENGINE_KEYS
from segback.trainer.values import STRINGS, TrainConfigError

GROUPS = {"mlx-lm": "mlx-lm's options (mlx_lm.lora)", "segback": "segback's options"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per declared option (and its aliases), plus the engine's own flags. Defaults
    are left out of the namespace, so `from_args` can tell what was given."""
    S = argparse.SUPPRESS
    parser.add_argument("-c", "--config", default=None,
                        help="YAML config file (mlx-lm's lora_config.yaml) or an "
                        "adapter_config.json; the command line wins")
    groups = {name: parser.add_argument_group(title) for name, title in GROUPS.items()}
    for f in fields(TrainConfig):
        m = f.metadata
        if not m["cli"]:
            continue
        flags = ["--" + n.replace("_", "-") for n in (f.name, *m["aliases"])]
        shown = f.default if f.default is not MISSING else "{...}"
        kw: dict[str, Any] = dict(dest=f.name, default=S, help=f"{m['help']} (default: {shown})")
        if m["type"] is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif m["type"] is STRINGS:
            kw["nargs"] = "+"
        else:
            kw["metavar"] = m["metavar"] or f.name.upper()
        if m["choices"]:
            kw["metavar"] = "{" + ",".join(m["choices"]) + "}"
        groups[m["group"]].add_argument(*flags, **kw)
    engine_options.add_arguments(parser.add_argument_group(
        "engine (how the segmented backward runs; a plan file's values unless given; with "
        "--plan auto, --tile, --offload and --boundaries-on-device also take 'auto')"))


def from_args(args: argparse.Namespace) -> TrainConfig:
    """Declared defaults < --config file < the flags given."""
    given = vars(args)
    values = read_config_file(given["config"]) if given.get("config") else {}
    values.update({k: v for k, v in given.items() if k in FIELDS})
    engine = {k: given[k] for k in ENGINE_KEYS if given.get(k) is not None}
    if engine:
        values["engine"] = {**values.get("engine", {}), **engine}
    cfg = TrainConfig(**values)
    missing = ["model"] * (not cfg.model) + ["data"] * (not (cfg.data or cfg.hf_dataset))
    if missing:
        raise TrainConfigError("missing option(s): " + ", ".join("--" + m for m in missing))
    for flag, where in (("--adapter-path", cfg.adapter_path),
                        ("--checkpoint-dir", cfg.checkpoint_dir)):
        if where is not None and Path(where).exists() and not Path(where).is_dir():
            raise TrainConfigError(f"{flag} {where} is a file, not a directory: give a directory "
                                   "(the adapter's files and checkpoints go inside it)")
    return cfg
