#!/usr/bin/env bash
# The H200 table of bench/RESULTS.md: e4b geometry (random weights, 4-bit, LoRA rank 8 on every
# linear of all 42 layers), mlx-lm full / per-layer checkpoint vs segback segmented.
# Usage on the GPU machine (after step 1 of ../shared/device/README.md):
#   source .devwheels/install-mlx-cuda.sh && bash bench/gpu_bench.sh {table|long|tiled|tiled2} OUT_DIR
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
  # Issue 7, in order of the bar: sequence-tiled layers (tiles of 1024, boundaries and per-layer
  # inputs parked in host memory), planner-chosen segments (its prediction is in each row), against
  # mlx-lm's checkpointed run at 8191; attention alone at 32K; then 128K (one step: it is minutes).
  T="--modes segmented --max-ops-per-buffer 4 --tile 1024 --offload"
  $B --seq 8192 --steps 2 $T --timeout 90
  $B --seq 8191 --steps 2 --modes ckpt --timeout 90
  $B --seq 32768 --steps 1 $T --timeout 150
  timeout 120 python3 bench/attention_bench.py --device gpu --dtype bfloat16 --heads 8 \
    --kv-heads 2 --head-dim 256 --windows 512 0 --lengths 32768 --paths fused chunked \
    > $out/attention.jsonl
  $B --seq 131072 --steps 0 $T --timeout 400
elif [ "$part" = tiled2 ]; then
  # The rest of the table and the tile-size trade-off at 8K.
  T="--modes segmented --max-ops-per-buffer 4"
  $B --seq 16384 --steps 1 $T --tile 1024 --offload --timeout 90
  $B --seq 65536 --steps 0 $T --tile 1024 --offload --timeout 200
  $B --seq 8192 --steps 2 $T --tile 2048 --offload --timeout 90
  $B --seq 8192 --steps 2 $T --tile 4096 --offload --timeout 90
  $B --seq 8192 --steps 2 $T --tile 1024 --timeout 90
else
  for L in 8192 16384 32768 65536 131072; do
    $B --seq $L --steps 1 --modes segmented --attention chunked --max-ops-per-buffer 4 --timeout 240
  done
fi
