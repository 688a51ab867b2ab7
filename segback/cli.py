"""`segback <command>`: one subcommand per workflow stage, each living in its own module.

Every command module exposes `add_arguments(parser)` and `main(args)`; modules are imported
lazily so `segback --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from segback.backend.blas import ensure_openblas
from segback.backend.kernel_cache import persist_kernel_cache
from segback.backend.ops_per_buffer import limit_ops_per_buffer
from segback.io import WriteError

COMMANDS: dict[str, tuple[str, str]] = {
    "prepare-model": ("segback.models.prepare", "write an MLX checkpoint for a configured model"),
    "build-data": ("segback.chunking.build", "build the chunking dataset from ShareGPT"),
    "filter-data": ("segback.chunking.filter", "token-length filter with the model's tokenizer"),
    "window-data": ("segback.chunking.windows", "cut long cases into short-window examples"),
    "generate": ("segback.chunking.generate", "generate chunkings for a test set"),
    "score": ("segback.chunking.scorer", "score predictions against gold chunks"),
    "compare": ("segback.chunking.compare", "arms' scores side by side, split by length"),
    "plan": ("segback.planner.cli", "plan segments for a model, length and memory target"),
    "train": ("segback.trainer.cli", "train a LoRA adapter with segmented backward"),
    "export": ("segback.models.export", "export an adapter (mlx-lm, PEFT, fused)"),
    "bench": ("segback.benchmark.cli", "benchmark mlx-lm full/checkpoint vs segmented backward"),
    "summarize": ("segback.experiment.summarize", "assemble the experiment's result JSON"),
    "plots": ("segback.experiment.plots", "plot loss and memory curves for the report"),
    "stamp": ("segback.experiment.stamp", "record a stage's effective config (for the workflow)"),
    "evaluate": ("segback.experiment.evaluate",
                 "held-out loss and perplexity; the token filter of own data"),
}

# Commands that run the model and so benefit from the OpenBLAS preload on Linux CPU.
COMPUTE_COMMANDS = {"filter-data", "generate", "plan", "train", "export", "bench", "evaluate"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="segback", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        if name in sys.argv[1:2]:  # only import the module whose arguments are needed
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in COMPUTE_COMMANDS:
        ensure_openblas()
        persist_kernel_cache()
        if argv[0] != "bench":  # bench sets it per mode: mlx-lm's modes run as mlx-lm ships
            limit_ops_per_buffer()
    sys.argv = [sys.argv[0], *argv]
    args = build_parser().parse_args(argv)
    try:
        result = importlib.import_module(args._module).main(args)
    except WriteError as e:  # names the file and what to do; the previous one is kept
        print(f"segback {args.command}: error: {e}", file=sys.stderr)
        return 2
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
