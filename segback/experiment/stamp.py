"""`segback stamp`: one stage's effective config as a file, so results follow the config.

A workflow rule writes the stamp from its params; the file changes (and its mtime moves) only
when that stage's config changes, and the final summary takes every stamp as an input. So a
changed option re-runs the summary even when Snakemake has deleted the intermediate outputs of
a failed job, which brings those back too; the result records each stage's config hash, and the
summary refuses a training run whose figures disagree with the training stamp.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from segback.io import atomic_write_json


def config_hash(config: Any) -> str:
    """Hash of a JSON value, independent of key order."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def write_stamp(path: str | Path, stage: str, config: Any) -> dict:
    stamp = {"stage": stage, "hash": config_hash(config), "config": config}
    path = Path(path)
    if path.exists():
        try:
            if json.loads(path.read_text()) == stamp:
                return stamp  # unchanged: keep the mtime, nothing downstream re-runs
        except (OSError, ValueError):
            pass
    atomic_write_json(path, stamp)
    return stamp


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stage", required=True, help="the stage this config belongs to")
    parser.add_argument("--config", required=True, help="the stage's config as JSON")
    parser.add_argument("--out", required=True, help="stamp JSON to write")


def main(args: argparse.Namespace) -> int:
    try:
        config = json.loads(args.config)
    except json.JSONDecodeError as e:
        print(f"segback stamp: --config is not JSON ({e})", file=sys.stderr)
        return 2
    stamp = write_stamp(args.out, args.stage, config)
    print(f"{args.out}: {args.stage} config {stamp['hash']}", file=sys.stderr)
    return 0
