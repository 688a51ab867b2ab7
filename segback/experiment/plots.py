"""`segback plots`: loss and memory curves of a training run, for the Snakemake report.

Reads `segback train`'s JSONL log: step rows {step, loss, lr, tokens, seconds, peak_gb, active_gb,
cache_gb} and validation rows {step, val_loss}; writes loss.png and memory.png.
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

from segback.io import atomic_write_bytes, read_jsonl


def split_log(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """(training rows, validation rows), each sorted by step."""
    train = [r for r in rows if "loss" in r and "step" in r]
    val = [r for r in rows if "val_loss" in r and "step" in r]
    return sorted(train, key=lambda r: r["step"]), sorted(val, key=lambda r: r["step"])


def _series(rows: list[dict], key: str) -> tuple[list, list]:
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    return buf.getvalue()


def _pyplot():
    """pyplot on the file-only Agg backend (compute nodes have no display); matplotlib is the
    `experiment` extra's, so it loads on first use."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_loss(train: list[dict], val: list[dict], title: str = ""):
    fig, ax = _pyplot().subplots(figsize=(7, 4), layout="constrained")
    x, y = _series(train, "loss")
    if x:
        ax.plot(x, y, marker="." if len(x) < 50 else None, label="train loss")
    x, y = _series(val, "val_loss")
    if x:
        ax.plot(x, y, marker="o", label="validation loss")
    _finish(ax, "no loss rows in the log", "loss (nats/token)", title or "Training loss")
    return fig


def _finish(ax, empty: str, ylabel: str, title: str) -> None:
    """Legend (or a note when nothing was plotted), step axis, labels and grid."""
    if not ax.lines:
        ax.text(0.5, 0.5, empty, ha="center", va="center", transform=ax.transAxes)
    else:
        ax.legend()
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)


def plot_memory(train: list[dict], title: str = ""):
    fig, ax = _pyplot().subplots(figsize=(7, 4), layout="constrained")
    for key, label in (("peak_gb", "peak"), ("active_gb", "active"), ("cache_gb", "cache")):
        x, y = _series(train, key)
        if x:
            ax.plot(x, y, marker="." if len(x) < 50 else None, label=label)
    if ax.lines:
        ax.set_ylim(bottom=0)
    _finish(ax, "no memory rows in the log", "memory (GB)", title or "Memory per training step")
    return fig


def write_plots(log: str | Path, out_dir: str | Path, title: str = "") -> list[Path]:
    plt = _pyplot()
    train, val = split_log(read_jsonl(log))
    out_dir = Path(out_dir)
    written = []
    prefix = f"{title}: " if title else ""
    for name, fig in (("loss.png", plot_loss(train, val, prefix + "training loss")),
                      ("memory.png", plot_memory(train, prefix + "memory per step"))):
        path = out_dir / name
        atomic_write_bytes(path, _png(fig))
        plt.close(fig)
        written.append(path)
    return written


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log", required=True, help="training log JSONL (segback train --log)")
    parser.add_argument("--out-dir", required=True, help="directory for loss.png and memory.png")
    parser.add_argument("--title", default="", help="prefix for the plot titles")


def main(args: argparse.Namespace) -> int:
    try:
        paths = write_plots(args.log, args.out_dir, args.title)
    except (OSError, ValueError) as e:
        print(f"segback plots: {e}", file=sys.stderr)
        return 1
    for p in paths:
        print(p, file=sys.stderr)
    return 0
