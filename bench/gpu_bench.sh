#!/usr/bin/env bash
# The H200 table of bench/RESULTS.md: e4b geometry (random weights, 4-bit, LoRA rank 8 on every
# linear of all 42 layers), mlx-lm full / per-layer checkpoint vs segback segmented.
# Usage on the GPU machine (after step 1 of ../shared/device/README.md):
#   source .devwheels/install-mlx-cuda.sh && bash bench/gpu_bench.sh {table|long|tiled} OUT_DIR
set -u
part=$1; out=$2
B="python3 -m segback.cli bench --model e4b --quant-bits 4 --out $out/bench.jsonl"
if [ "$part" = table ]; then
  $B --seq 2048 --steps 2 --modes full,ckpt,segmented --timeout 150
  $B --seq 4096 --steps 2 --modes full,ckpt,segmented --timeout 150
  $B --seq 8191 --steps 2 --modes ckpt --timeout 150
  $B --seq 8192 --steps 2 --modes ckpt,segmented --timeout 150
  $B --seq 16384 --steps 1 --modes segmented --timeout 150
elif [ "$part" = tiled ]; then
  # Issue 7: sequence-tiled layers, planner-chosen segments (its prediction is in each row),
  # with and without host-parked boundaries; then mlx-lm's checkpointed run and attention alone.
  T="--modes segmented --max-ops-per-buffer 4"
  $B --seq 8192 --steps 2 $T --tile 4096 --timeout 100
  $B --seq 8192 --steps 2 $T --tile 4096 --offload --timeout 100
  $B --seq 8191 --steps 2 --modes ckpt --timeout 100
  $B --seq 32768 --steps 1 $T --tile 4096 --offload --timeout 150
  $B --seq 131072 --steps 1 $T --tile 4096 --offload --timeout 420
  python3 bench/attention_bench.py --device gpu --dtype bfloat16 --heads 8 --kv-heads 2 \
    --head-dim 256 --windows 512 --lengths 32768 --paths fused chunked > $out/attention.jsonl
  $B --seq 16384 --steps 1 $T --tile 4096 --offload --timeout 120
  $B --seq 65536 --steps 1 $T --tile 4096 --offload --timeout 240
else
  for L in 8192 16384 32768 65536 131072; do
    $B --seq $L --steps 1 --modes segmented --attention chunked --max-ops-per-buffer 4 --timeout 240
  done
fi
