"""Data-parallel `segback train` on the CPU: N local ranks (mlx.launch, ring backend) against one
process, on the same global batch.

One process trains with --batch-size N*b and every core for BLAS; N ranks train with
--batch-size b and cores/N BLAS threads each, launched by
`mlx.launch -n N --backend ring -p PORT -- python -m segback.cli train ...` on 127.0.0.1. Both
read the same examples step by step, so their losses agree (printed as a check). Reported per
run, on one JSON line each: tokens/s over the steps after the first (the first compiles and
warms caches), seconds per step and the peak memory of each rank; then a comparison line.

    python bench/distributed_cpu.py                      # dense-256, seq 512, 2 ranks x 2
    python bench/distributed_cpu.py --model tiny-llama --steps 3
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi "
         "rho sigma tau upsilon phi chi psi omega").split()


def write_data(path: Path, rows: int, chars: int, seed: int = 0) -> None:
    """Text rows longer than --seq bytes (ByteTokenizer: a token per byte): every example is
    cut to exactly --seq tokens, so every batch has the same length."""
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "train.jsonl", "w") as f:
        for _ in range(rows):
            text = ""
            while len(text) < chars:
                text += " ".join(rng.choice(WORDS, 32)) + ". "
            f.write(json.dumps({"text": text}) + "\n")


def free_port(n: int) -> int:
    """A base port with n consecutive free ports on 127.0.0.1."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        socks = []
        try:
            for p in range(base, base + n):
                socks.append(socket.socket())
                socks[-1].bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")


def environment(threads: int) -> dict:
    from segback.backend.blas import find_openblas

    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    lib = find_openblas()
    if lib and lib not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(p for p in (lib, env.get("LD_PRELOAD")) if p)
    return env


def train(args: argparse.Namespace, data: Path, out: Path, ranks: int) -> dict:
    """One run (ranks == 1: a plain process); its log and summary, measured."""
    batch = args.batch if ranks > 1 else args.batch * args.ranks
    cmd = [sys.executable, "-m", "segback.cli", "train", "--model", args.model,
           "--data", str(data), "--adapter-path", str(out), "--batch-size", str(batch),
           "--max-seq-length", str(args.seq), "--iters", str(args.steps), "--plan", args.plan,
           "--lora-dropout", "0", "--steps-per-eval", "0", "--steps-per-report", "1",
           "--no-progress", "--no-resume", "--learning-rate", "1e-4"]
    if ranks > 1:
        launcher = Path(sys.executable).parent / "mlx.launch"
        cmd = [str(launcher), "-n", str(ranks), "--backend", "ring", "-p",
               str(free_port(ranks)), "--", *cmd]
    threads = max(1, args.cores // ranks)
    tic = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, env=environment(threads), stdin=subprocess.DEVNULL,
                       capture_output=True, text=True)
    wall = time.perf_counter() - tic
    if p.returncode != 0 or "Node with rank" in p.stderr or \
            not (out / "train_summary.json").exists():
        sys.exit(f"{' '.join(cmd)} failed:\n{p.stdout}\n{p.stderr}")
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    steps = [r for r in log if "loss" in r]
    timed = steps[1:] or steps
    seconds = sum(r["seconds"] for r in timed)
    tokens = sum(r["tokens"] for r in timed)
    if ranks > 1:
        peaks = [max(r["rank_peak_gb"][k] for r in steps) for k in range(ranks)]
    else:
        peaks = [max(r["peak_gb"] for r in steps)]
    return {"bench": "distributed_cpu", "model": args.model, "seq": args.seq, "ranks": ranks,
            "batch_per_rank": batch, "global_batch": batch * ranks, "steps": len(steps),
            "timed_steps": len(timed), "blas_threads_per_rank": threads,
            "tokens_per_step": tokens / len(timed), "seconds_per_step": seconds / len(timed),
            "tokens_per_s": tokens / seconds, "peak_gb_per_rank": peaks,
            "wall_seconds": wall, "losses": [r["loss"] for r in steps]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="dense-256", help="geometry or checkpoint directory")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=2, help="examples per rank")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--plan", default="4", help="--plan of segback train (layers per segment)")
    p.add_argument("--cores", type=int, default=os.cpu_count() or 1,
                   help="cores shared by the ranks (BLAS threads: cores / ranks each)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="segback-dist-") as tmp:
        data = Path(tmp) / "data"
        write_data(data, rows=max(16, 2 * args.batch * args.ranks), chars=args.seq + 64)
        one = train(args, data, Path(tmp) / "one", 1)
        print(json.dumps(one), flush=True)
        many = train(args, data, Path(tmp) / "many", args.ranks)
        print(json.dumps(many), flush=True)
    diff = max(abs(a - b) / abs(b) for a, b in zip(many["losses"], one["losses"]))
    print(json.dumps({"bench": "distributed_cpu", "compare": f"{args.ranks} ranks vs 1",
                      "speedup": many["tokens_per_s"] / one["tokens_per_s"],
                      "peak_gb_per_rank_ratio": max(many["peak_gb_per_rank"])
                      / one["peak_gb_per_rank"][0],
                      "max_rel_loss_diff": diff}), flush=True)


if __name__ == "__main__":
    main()
