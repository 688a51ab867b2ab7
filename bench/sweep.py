"""The benchmark sweep: every configuration bench/RESULTS.md reports, by name, each a fixed
`segback bench` command whose rows are appended to bench/data/runs.jsonl (one row per mode, each
with its date, git revision, machine, mlx / mlx-lm versions and this configuration's name).

    python bench/sweep.py --list                    # names, machine, what each measures
    python bench/sweep.py h200 --dry-run            # the commands of a group, not run
    python bench/sweep.py tiled-8k ckpt-8k          # run two configurations
    python bench/sweep.py smoke --out /tmp/runs.jsonl

A name is a configuration or a group (`h200`, `h200-untiled`, `cpu`, `smoke`). The e4b
configurations need an NVIDIA GPU with mlx-cuda (about 140 GB for the untiled ones); on a fresh
machine run `warmup-4k` first, it JIT-builds the compiled tile functions' kernels for minutes.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "bench" / "data" / "runs.jsonl"

E4B = ("--model", "e4b", "--quant-bits", "4")
# Segmented runs on CUDA: at most 4 ops per command buffer (mlx-cuda keeps a graph's buffers
# alive until the graph has run, which at 4 ops stays small).
SEG = ("--modes", "segmented", "--max-ops-per-buffer", "4")
# Rows measured before the planner timed its candidates on the device: the cost model's pick.
COST = ("--measure", "0")
# The tiled engine as measured in bench/RESULTS.md: host-parked boundaries, compiled tile
# functions (traces shared by layers of one structure and two tiles in flight are the defaults).
TILED = (*SEG, "--offload", "--compile", "true")


@dataclass(frozen=True)
class Config:
    name: str
    machine: str  # "h200" (e4b geometry on an NVIDIA GPU) or "cpu"
    measures: str
    commands: tuple[tuple[str, ...], ...]  # `segback bench` arguments, one invocation each


def _e4b(seq: int, steps: int, *flags: str, timeout: int = 150) -> tuple[str, ...]:
    return (*E4B, "--seq", str(seq), "--steps", str(steps), *flags, "--timeout", str(timeout))


def _cost(args: tuple[str, ...]) -> tuple[str, ...]:
    """`args` with the planner's pick by its cost model alone (no timed candidates)."""
    return (*args, *COST) if "segmented" in args else args


def _cpu(model: str, seq: int, steps: int, *flags: str) -> tuple[str, ...]:
    return ("--model", model, "--seq", str(seq), "--steps", str(steps), *flags)


CONFIGS = [
    # --- H200, e4b geometry: the current table (sequence-tiled engine vs mlx-lm's checkpoint)
    Config("warmup-4k", "h200",
           "not a result: JIT-builds the CUDA kernels of the compiled tile-2048 functions on a "
           "fresh machine (first step minutes) so the configurations after it time steady steps",
           (_e4b(4096, 0, *TILED, "--tile", "2048", timeout=400),)),
    Config("ckpt-8k", "h200",
           "mlx-lm with grad_checkpoint (one checkpoint per layer) at 8191 tokens, the baseline "
           "of every 8K ratio (at 8192 its [L, vocab] logits crash mlx-cuda: see untiled-8k)",
           (_e4b(8191, 5, "--modes", "ckpt", timeout=120),)),
    Config("tiled-8k", "h200",
           "segback's 8K configuration: tile 2048, offload, compiled, boundaries kept on the "
           "device as far as a 7.6 GB target allows (planner's segments)",
           (_e4b(8192, 5, *TILED, "--tile", "2048", "--target-gb", "7.6", timeout=240),)),
    Config("tiled-8k-eager", "h200",
           "tiled-8k with eager tile functions (the CUDA default; no minutes of JIT on a fresh "
           "machine)",
           (_e4b(8192, 5, *SEG, "--offload", "--compile", "false", "--tile", "2048",
                 "--target-gb", "7.6", timeout=240),)),
    Config("auto-8k", "h200",
           "defaults only: the planner chooses tile, offload, segments and kept boundaries for "
           "a 7.6 GB target; the engine runs with the device's defaults",
           (_e4b(8192, 5, *SEG, "--segments", "auto", "--tile", "auto", "--offload", "auto",
                 "--target-gb", "7.6", timeout=300),)),
    Config("tiled-16k", "h200", "tiled engine at 16K, tile 2048, no target (lowest peak)",
           (_e4b(16384, 1, *TILED, "--tile", "2048"),)),
    Config("tiled-16k-target", "h200",
           "tiled-16k with an 8 GB target: boundaries kept on the device (faster, more memory)",
           (_e4b(16384, 2, *TILED, "--tile", "2048", "--target-gb", "8"),)),
    Config("tiled-32k", "h200", "tiled engine at 32K, tile 2048, no target",
           (_e4b(32768, 1, *TILED, "--tile", "2048", timeout=200),)),
    Config("tiled-32k-target", "h200", "tiled-32k with a 10.5 GB target (boundaries kept)",
           (_e4b(32768, 1, *TILED, "--tile", "2048", "--target-gb", "10.5", timeout=200),)),
    Config("tiled-64k", "h200", "tiled engine at 64K, tile 1024, the warm-up step only",
           (_e4b(65536, 0, *TILED, "--tile", "1024", timeout=300),)),
    Config("tiled-128k", "h200", "tiled engine at 128K, tile 1024, the warm-up step only",
           (_e4b(131072, 0, *TILED, "--tile", "1024", timeout=500),)),
    # --- H200, e4b geometry: the untiled engine against mlx-lm (README's first table)
    Config("untiled-2k", "h200",
           "mlx-lm full backward vs grad_checkpoint vs segback untiled (planner, fused "
           "attention) at 2048",
           (_e4b(2048, 2, "--modes", "full,ckpt,segmented"),)),
    Config("untiled-4k", "h200", "untiled-2k at 4096",
           (_e4b(4096, 2, "--modes", "full,ckpt,segmented"),)),
    Config("untiled-8k", "h200",
           "segback untiled (fused attention) at 8192, and mlx-lm's checkpointed step at 8192 "
           "(its row records the crash)",
           (_e4b(8192, 2, "--modes", "ckpt,segmented"),)),
    Config("chunked-16k", "h200", "segback untiled with chunked attention (O(L) backward) at 16K",
           (_e4b(16384, 1, *SEG, "--attention", "chunked", timeout=240),)),
    Config("chunked-32k", "h200", "chunked-16k at 32K",
           (_e4b(32768, 1, *SEG, "--attention", "chunked", timeout=240),)),
    # --- CPU (float32; OpenBLAS preloaded by the segback command): the tables of RESULTS.md
    Config("cpu-smoke", "cpu", "seconds: all three modes on tiny-llama at 256 tokens",
           (_cpu("tiny-llama", 256, 1),)),
    Config("cpu-smoke-tiled", "cpu",
           "seconds: mlx-lm ckpt vs the tiled engine (tile 256, offload) on tiny-e4b at 1024",
           (_cpu("tiny-e4b", 1024, 1, "--modes", "ckpt,segmented", "--tile", "256",
                 "--offload"),)),
    Config("cpu-table", "cpu",
           "full vs ckpt vs segmented (planner, fused) on tiny-e4b and dense-256 at 1K-4K",
           tuple(_cpu("tiny-e4b", L, 3) for L in (1024, 2048, 4096))
           + tuple(_cpu("dense-256", L, 2) for L in (1024, 2048, 4096))),
    Config("cpu-chunked", "cpu", "mlx-lm ckpt vs segmented with chunked attention, tiny-e4b 4K/8K",
           tuple(_cpu("tiny-e4b", L, 1, "--modes", "ckpt,segmented", "--attention", "chunked")
                 for L in (4096, 8192))),
    Config("cpu-tiled", "cpu",
           "tiny-e4b at 4K-16K: ckpt (4K, 8K), segmented chunked, tiled 1024, tiled 1024 + "
           "offload",
           tuple(c for L in (4096, 8192, 16384) for c in (
               *((_cpu("tiny-e4b", L, 1, "--modes", "ckpt"),) if L < 16384 else ()),
               _cpu("tiny-e4b", L, 1, "--modes", "segmented", "--attention", "chunked"),
               _cpu("tiny-e4b", L, 1, "--modes", "segmented", "--tile", "1024"),
               _cpu("tiny-e4b", L, 1, "--modes", "segmented", "--tile", "1024", "--offload"),
           ))),
    Config("cpu-e4b-slice", "cpu",
           "hours: six e4b-width layers, ckpt vs chunked vs tiled 1024 (+ offload) at 4K, "
           "chunked vs tiled + offload at 8K (about 10 GB of host memory)",
           (_cpu("e4b-slice", 4096, 1, "--modes", "ckpt"),
            _cpu("e4b-slice", 4096, 1, "--modes", "segmented", "--attention", "chunked"),
            _cpu("e4b-slice", 4096, 1, "--modes", "segmented", "--tile", "1024"),
            _cpu("e4b-slice", 4096, 1, "--modes", "segmented", "--tile", "1024", "--offload"),
            _cpu("e4b-slice", 8192, 1, "--modes", "segmented", "--attention", "chunked"),
            _cpu("e4b-slice", 8192, 1, "--modes", "segmented", "--tile", "1024", "--offload"))),
]
# --- Throughput at equal memory (issue 19): e4b at 2K and 8K examples, mlx-lm's best inside
# 16 / 24 / 48 GB against segback's with dequantized matmuls (as `segback train` runs 4-bit
# models); targets sit below the budgets because the planner under-predicts untiled plans on CUDA.
DQ = ("--dequant-matmul",)
CONFIGS += [
    Config("eqmem-2k", "h200",
           "examples of 2048 tokens: mlx-lm ckpt (batch 1, 4), full (batch 1, 2) and ckpt with "
           "the dequantizing swap; segback batch 1 / 4 / 8 under targets 10 / 13 / 16 / 30 GB",
           (_e4b(2048, 2, "--modes", "ckpt", "--max-ops-per-buffer", "4"),
            _e4b(2048, 2, "--modes", "ckpt", "--max-ops-per-buffer", "4", *DQ),
            _e4b(8192, 2, "--modes", "ckpt", "--max-ops-per-buffer", "4", "--pack", "4"),
            _e4b(8192, 2, "--modes", "ckpt", "--max-ops-per-buffer", "4", "--pack", "4", *DQ),
            _e4b(2048, 2, "--modes", "full", "--max-ops-per-buffer", "4"),
            _e4b(4096, 2, "--modes", "full", "--max-ops-per-buffer", "4", "--pack", "2"),
            _e4b(2048, 2, *SEG, "--target-gb", "13"),
            _e4b(2048, 2, *SEG, "--target-gb", "13", *DQ),
            _e4b(2048, 2, *SEG, "--target-gb", "10", *DQ),
            _e4b(2048, 2, *SEG, "--batch", "4", "--target-gb", "16", *DQ),
            _e4b(2048, 2, *SEG, "--batch", "8", "--target-gb", "30", *DQ),
            _e4b(8192, 2, *SEG, "--pack", "4", "--attention", "chunked", "--target-gb", "19",
                 *DQ))),
    Config("eqmem-8k", "h200",
           "examples of 8192 tokens: segback untiled with dequantized matmuls under 13 / 19 / "
           "38 GB targets (mlx-lm's checkpointed step needs 53.7 GB: ckpt-8k)",
           tuple(_e4b(8192, 2, *SEG, "--target-gb", g, *DQ) for g in ("13", "19", "38"))),
    Config("auto-8k-dq", "h200",
           "auto-8k with dequantized matmuls",
           (_e4b(8192, 2, *SEG, "--segments", "auto", "--tile", "auto", "--offload", "auto",
                 "--target-gb", "7.6", *DQ, timeout=300),)),
]
CONFIGS = [Config(c.name, c.machine, c.measures, tuple(_cost(a) for a in c.commands))
           for c in CONFIGS]
# The defaults a user gets (issue 19): `segback train --plan auto --target-gb G` on a 4-bit
# model, i.e. dequantized matmuls and the planner timing 3 candidates on the device; mlx-lm's
# checkpointed step as it ships beside each length (8191: at 8192 its logits are 2^31 elements).
PLANNED = ("--segments", "auto", "--tile", "auto", "--offload", "auto", "--dequant-matmul", "auto")
AUTO = (*SEG, *PLANNED)
# The same with no MLX_MAX_OPS_PER_BUFFER flag: segback's CLI sets its own CUDA default.
DEFAULTS = ("--modes", "segmented", *PLANNED)
CONFIGS += [
    Config("defaults-dq", "h200",
           "mlx-lm ckpt at 2K / 4K / 8191 against the planner's measured pick at G = 8 GB and "
           "at G >= half of mlx-lm's peak (9.4 GB at 4K, 27 GB at 8K), dequantized matmuls",
           (_e4b(2048, 2, "--modes", "ckpt", "--max-ops-per-buffer", "4"),
            _e4b(2048, 2, *AUTO, "--target-gb", "8", timeout=300),
            _e4b(4096, 2, "--modes", "ckpt", "--max-ops-per-buffer", "4"),
            _e4b(4096, 2, *AUTO, "--target-gb", "8", timeout=300),
            _e4b(4096, 2, *AUTO, "--target-gb", "9.4", timeout=300),
            _e4b(8191, 2, "--modes", "ckpt", "--max-ops-per-buffer", "4"),
            _e4b(8192, 2, *AUTO, "--target-gb", "8", timeout=300),
            _e4b(8192, 2, *AUTO, "--target-gb", "27", timeout=300))),
    Config("eqmem-2k-16", "h200",
           "the 16 GB cell at 2K: mlx-lm ckpt batch 2 (16.0 GB) against segback batch 2 / 3 / "
           "4 under a 16 GB target, the planner timing its candidates",
           (_e4b(2048, 2, "--modes", "ckpt", "--max-ops-per-buffer", "4", "--batch", "2"),
            *(_e4b(2048, 2, *SEG, "--segments", "auto", "--dequant-matmul", "auto", "--batch",
                   b, "--target-gb", "16", timeout=300) for b in ("2", "3", "4")))),
    Config("defaults-ops", "h200",
           "the defaults bar with no MLX_MAX_OPS_PER_BUFFER flag: mlx-lm ckpt as it ships "
           "(MLX's 20 ops a graph) and at 4, against segback's own CUDA default (4) at G = 8 GB; "
           "then segback's defaults at 8K with MLX's 20",
           (*(cmd for seq, ck in ((4096, 4096), (8192, 8191), (2048, 2048)) for cmd in (
               _e4b(ck, 2, "--modes", "ckpt"),
               _e4b(ck, 2, "--modes", "ckpt", "--max-ops-per-buffer", "4"),
               _e4b(seq, 2, *DEFAULTS, "--target-gb", "8", timeout=300))),
            _e4b(8192, 2, *DEFAULTS, "--target-gb", "8", "--max-ops-per-buffer", "20",
                 timeout=300))),
    Config("planner-long", "h200",
           "the planner's predicted peak against the measured one at 16K-128K with the defaults "
           "(--tile auto --offload auto, the cost model's pick: --measure 0; the warm-up step "
           "alone), and 16K with room to keep every boundary on the device",
           (_e4b(16384, 0, *AUTO, "--measure", "0", "--target-gb", "10", timeout=300),
            _e4b(32768, 0, *AUTO, "--measure", "0", "--target-gb", "12", timeout=300),
            _e4b(65536, 0, *AUTO, "--measure", "0", "--target-gb", "16", timeout=400),
            _e4b(131072, 0, *AUTO, "--measure", "0", "--target-gb", "24", timeout=900),
            _e4b(16384, 0, *AUTO, "--measure", "0", "--target-gb", "24", timeout=300))),
]

# --- the fast path (fused attention kernels in every engine path): kernels, exactness, defaults
LLAMA8B = ("--model", "llama-3.1-8b", "--quant-bits", "4")
ATTN = ("bench/attention_bench.py", "--device", "gpu", "--dtype", "bfloat16", "--repeats", "2")
E4B_HEADS = ("--heads", "8", "--kv-heads", "2")
LLAMA_HEADS = ("--heads", "32", "--kv-heads", "8", "--head-dim", "128")


def _llama(seq: int, steps: int, *flags: str, timeout: int = 300) -> tuple[str, ...]:
    return (*LLAMA8B, "--seq", str(seq), "--steps", str(steps), *flags, "--timeout", str(timeout))


CONFIGS += [
    Config("attn-kernels", "h200",
           "attention forward+backward per kernel (fused dispatch, MLX's own, segback's flash, "
           "chunked): time, peak, TFLOP/s, hw_fraction, and errors against a float32 reference "
           "up to 8K; e4b's heads at head dims 256 / 512 (causal, 512-token window), Llama-8B's "
           "at 128 (causal, 4096-token window, 8191 tokens: MLX's padded path), packed rows",
           ((*ATTN, *E4B_HEADS, "--head-dim", "256", "--windows", "0", "512", "--lengths",
             "8192", "32768", "--paths", "fused", "chunked", "--check-max-len", "8192"),
            (*ATTN, *E4B_HEADS, "--head-dim", "512", "--windows", "0", "--lengths", "8192",
             "32768", "--paths", "fused", "chunked", "--check-max-len", "8192"),
            (*ATTN, *LLAMA_HEADS, "--windows", "0", "4096", "--lengths", "8191", "32768",
             "--paths", "fused", "mlx", "flash", "chunked", "--check-max-len", "8191"),
            (*ATTN, *E4B_HEADS, "--head-dim", "256", "--windows", "0", "--lengths", "8192",
             "--packed", "1024", "--paths", "fused", "chunked", "--check-max-len", "8192"))),
    Config("fast-path-8k", "h200",
           "the engine's loss and LoRA gradients with fused attention against chunked, untiled "
           "and tiled (tile 2048), Llama-8B and e4b geometries at 8K, 4 layers a segment",
           (("bench/fast_path_check.py", "--models", "llama-3.1-8b", "e4b", "--seq", "8192"),)),
    Config("fast-defaults", "h200",
           "the defaults (--segments auto --tile auto --offload auto, the planner timing its "
           "candidates) against mlx-lm ckpt on the same card: Llama-8B 8K at G = 16 and 32K at "
           "G = 24, e4b 8K at G = 8",
           (_llama(8191, 2, "--modes", "ckpt"),
            _llama(8192, 2, *DEFAULTS, "--target-gb", "16"),
            _llama(32768, 1, *DEFAULTS, "--target-gb", "24", timeout=400),
            _e4b(8191, 2, "--modes", "ckpt"),
            _e4b(8192, 2, *DEFAULTS, "--target-gb", "8", timeout=300))),
    Config("fast-128k", "h200",
           "e4b at 128K with the defaults at G = 24 (145.8 s a step before the fast path)",
           (_e4b(131072, 0, *DEFAULTS, "--target-gb", "24", timeout=900),)),
    Config("segment-memory", "h200",
           "one untiled segment's backward transient (1-3 layers, fused attention, with and "
           "without dequantized matmuls) against the cost model's, Llama-8B at 8K and 32K: "
           "splits a misprediction into its per-layer slope and its fixed part",
           (("bench/segment_memory.py", "--model", "llama-3.1-8b", "--seq", "8192", "32768",
             "--layers", "1", "2", "3"),)),
    Config("fast-profile", "h200",
           "where the defaults' step goes (inside / outside mx.eval, per phase): Llama-8B 8K "
           "at G = 16, e4b 8K at G = 8",
           (("bench/step_profile.py", *LLAMA8B, "--seq", "8192", "--target-gb", "16"),
            ("bench/step_profile.py", *E4B, "--seq", "8192", "--target-gb", "8"))),
    Config("fused-limit", "h200",
           "MLX's fused causal attention (cuDNN) forward + backward at Llama-8B's heads, one call "
           "over all heads against segback's head groups, 32K-128K: where the one call stops",
           (("bench/fused_limit.py", "--lengths", "32768", "65536", "131072"),)),
    Config("fast-head", "h200",
           "the loss head alone, autodiff against the fused head (logits once, one float32 "
           "pass): e4b (262K vocabulary, softcap) and Llama-8B at 8K, bf16, 4-bit",
           (("bench/head_bench.py", "--model", "e4b", "--seq", "8192", "--dtype", "bfloat16",
             "--bits", "4", "--runs", "3"),
            ("bench/head_bench.py", "--model", "llama-3.1-8b", "--seq", "8192", "--dtype",
             "bfloat16", "--bits", "4", "--runs", "3"))),
]
CONFIGS += [
    Config("flash-variants", "h200",
           "segback's flash kernels v1 against v2: errors on the shapes where tilings differ "
           "(every head dim, against dense float32), then time, peak and hw_fraction at e4b's "
           "heads (head dims 256 / 512, causal and a 512-token window, 8K / 32K)",
           (("bench/flash_variant_check.py", "--variants", "v1", "v2"),
            (*ATTN, *E4B_HEADS, "--head-dim", "256", "--windows", "0", "512", "--lengths",
             "8192", "32768", "--paths", "flash", "--flash-variant", "v1", "v2",
             "--check-max-len", "8192"),
            (*ATTN, *E4B_HEADS, "--head-dim", "512", "--windows", "0", "512", "--lengths",
             "8192", "32768", "--paths", "flash", "--flash-variant", "v1", "v2",
             "--check-max-len", "8192"))),
    Config("flash-exact", "h200",
           "segback's flash kernels v1 and v2 against dense float32 on the shapes where "
           "tilings differ (every head dim, windows, packed rows, short query tiles): errors "
           "only, seconds",
           (("bench/flash_variant_check.py", "--variants", "v1", "v2"),)),
    Config("flash-d128-long", "h200",
           "segback's flash kernels v1 and v2 at Llama-8B's heads (32 q / 8 kv, head dim 128, "
           "causal) past MLX's 32K limit: errors against float32 at 8K, time, peak and "
           "hw_fraction at 8K / 32K / 128K, beside the fused dispatch (MLX's kernel to 32K)",
           ((*ATTN, *LLAMA_HEADS, "--windows", "0", "--lengths", "8192", "32768", "131072",
             "--paths", "flash", "fused", "--flash-variant", "v1", "v2",
             "--check-max-len", "8192"),)),
    Config("e4b-defaults-8k", "h200",
           "e4b at 8K with the defaults at G = 8 (must tile and offload) and G = 16 (room "
           "for an untiled plan)",
           (_e4b(8192, 2, *DEFAULTS, "--target-gb", "8", timeout=300),
            _e4b(8192, 2, *DEFAULTS, "--target-gb", "16", timeout=300))),
    *(Config(f"record-llama8b-{label}", "h200",
             f"the long-context record (issue 43): Llama-3.1-8B 4-bit LoRA r8, one full step "
             f"with the defaults at G = 72 on one 80 GB card, {label} tokens"
             + ("" if untimed == () else "; the cost model's pick untimed (timing it would "
                "add two steps of 10+ minutes each; tiled Llama peaks are predicted within "
                "5.3%)"),
             (_llama(seq, steps, *DEFAULTS, *untimed, "--target-gb", "72", timeout=timeout),))
      for label, seq, steps, timeout, untimed in (
          ("128k", 131072, 1, 900, ()), ("342k", 344064, 0, 1500, COST),
          ("512k", 524288, 0, 2400, COST))),
]
BY_NAME = {c.name: c for c in CONFIGS}
GROUPS = {
    "h200": [c.name for c in CONFIGS if c.machine == "h200" and not c.name.startswith(
        ("untiled", "chunked", "eqmem", "auto-8k-dq", "defaults"))],
    "h200-untiled": [c.name for c in CONFIGS if c.name.startswith(("untiled", "chunked"))],
    "h200-eqmem": ["eqmem-2k", "eqmem-8k", "auto-8k-dq", "eqmem-2k-16"],
    "h200-defaults": ["defaults-dq", "defaults-ops", "planner-long"],
    "fast-path": ["attn-kernels", "fast-path-8k", "fast-defaults", "fast-128k", "segment-memory",
                  "fast-profile", "fast-head", "flash-variants", "e4b-defaults-8k"],
    "record-llama8b": ["record-llama8b-128k", "record-llama8b-342k", "record-llama8b-512k"],
    "cpu": ["cpu-table", "cpu-chunked", "cpu-tiled", "cpu-e4b-slice"],
    "smoke": ["cpu-smoke", "cpu-smoke-tiled"],
}

# issue 43: real-size families
# Llama-3.1-8B, Mistral-7B-v0.3 and Gemma-3-12B geometries (random weights, 4-bit, LoRA r8 on
# all layers) on one H100 80 GB: segback's defaults (`segback train --plan auto --target-gb G`)
# at 8K / 32K / 128K, and mlx-lm's checkpointed step as it ships beside them at 2K / 4K / 8K.
# Each G sits between the cost model's floor and its fastest plan's predicted peak (CUDA
# coefficients), so the plan must trade. Gemma-3's [8192, 262208] logits exceed 2^31 elements
# (MLX-CUDA's launch limit): its mlx-lm 8K row runs 8190 tokens.
FAMILIES = {  # geometry: (config prefix, G at 2K / 4K, at 8K, 32K, 128K)
    "llama-3.1-8b": ("llama8b", 8, 10, 16, 32),
    "mistral-7b-v0.3": ("mistral7b", 8, 10, 16, 32),
    "gemma-3-12b": ("gemma3-12b", 10, 12, 20, 36),
}


def _family(model: str, seq: int, steps: int, *flags: str, timeout: int = 300
            ) -> tuple[str, ...]:
    return ("--model", model, "--quant-bits", "4", "--seq", str(seq), "--steps", str(steps),
            *flags, "--timeout", str(timeout))


CONFIGS += [c for model, (short, g_short, g8, g32, g128) in FAMILIES.items() for c in (
    Config(f"{short}-defaults", "h100",
           f"{model}: segback's defaults at 8K / 32K / 128K under G = {g8} / {g32} / {g128} GB "
           "(the planner times its candidates; 128K: the warm-up step only)",
           (_family(model, 8192, 2, *DEFAULTS, "--target-gb", str(g8)),
            _family(model, 32768, 1, *DEFAULTS, "--target-gb", str(g32), timeout=900),
            _family(model, 131072, 0, *DEFAULTS, "--target-gb", str(g128), timeout=3600))),
    Config(f"{short}-vs-ckpt", "h100",
           f"{model}: mlx-lm ckpt as it ships at 2K / 4K / 8K against segback's defaults at "
           f"G = {g_short} GB (2K, 4K; segback's 8K row is {short}-defaults')",
           (*(cmd for seq in (2048, 4096) for cmd in (
               _family(model, seq, 2, "--modes", "ckpt"),
               _family(model, seq, 2, *DEFAULTS, "--target-gb", str(g_short)))),
            _family(model, 8190 if "gemma" in model else 8192, 2, "--modes", "ckpt"))),
)]
CONFIGS.append(Config(
    "families-cpu-smoke", "cpu",
    "seconds: each family's tiny- twin (real depth, pattern and RoPE at tiny widths, 4-bit), "
    "mlx-lm ckpt and segback's defaults at 256 tokens",
    tuple(_family(f"tiny-{model}", 256, 1, "--modes", "ckpt,segmented", *PLANNED,
                  "--target-gb", "1") for model in FAMILIES)))
BY_NAME.update({c.name: c for c in CONFIGS})
GROUPS["h100-families"] = [c.name for c in CONFIGS if c.machine == "h100"]


def command(args: tuple[str, ...], name: str, out: str, run: str | None) -> list[str]:
    """One invocation's arguments, tagged and appending to `out`: `segback bench`'s, or a bench
    script's (`args` starting with its path)."""
    tags = ["--config-name", name, "--out", out] + (["--run", run] if run else [])
    if args[0].endswith(".py"):
        return [*args, *tags]
    return ["bench", *args, *tags]


def resolve(names: list[str]) -> list[Config]:
    picked: list[str] = []
    for n in names:
        for m in GROUPS.get(n, [n]):
            if m not in BY_NAME:
                known = ", ".join([*GROUPS, *BY_NAME])
                raise SystemExit(f"sweep: unknown configuration {m!r}; known: {known}")
            if m not in picked:
                picked.append(m)
    return [BY_NAME[m] for m in picked]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="groups: " + "; ".join(
                                    f"{g} = {' '.join(ms)}" for g, ms in GROUPS.items()))
    p.add_argument("names", nargs="*", help="configurations or groups to run (see --list)")
    p.add_argument("--list", action="store_true", help="list the configurations and groups")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--out", default=str(RUNS.relative_to(ROOT)) if Path.cwd() == ROOT
                   else str(RUNS), help="JSON lines file the rows are appended to "
                   "(default: bench/data/runs.jsonl)")
    p.add_argument("--run", default=None,
                   help="label of this sweep in every row (default: sweep-<UTC time>)")
    args = p.parse_args(argv)
    if args.list:
        width = max(len(c.name) for c in CONFIGS)
        for c in CONFIGS:
            print(f"{c.name:<{width}}  {c.machine:<4}  {c.measures}")
        print()
        for g, ms in GROUPS.items():
            print(f"{g}: {' '.join(ms)}")
        return 0
    if not args.names:
        p.error("name configurations or groups to run (--list shows them)")
    configs = resolve(args.names)
    run = args.run or "sweep-" + datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    failed = []
    for c in configs:
        for bench_args in c.commands:
            cmd = command(bench_args, c.name, args.out, None if args.dry_run else run)
            script = cmd[0].endswith(".py")
            print(shlex.join(["python" if script else "segback", *cmd]), flush=True)
            if args.dry_run:
                continue
            tic = time.perf_counter()
            argv = [sys.executable, str(ROOT / cmd[0]), *cmd[1:]] if script else \
                [sys.executable, "-m", "segback.cli", *cmd]
            rc = subprocess.run(argv, cwd=Path.cwd()).returncode
            print(f"# {c.name}: exit {rc}, {time.perf_counter() - tic:.0f} s", flush=True)
            if rc:
                failed.append(c.name)
    if failed:
        print(f"sweep: failed: {' '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
