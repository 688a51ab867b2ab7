#!/usr/bin/env bash
# The H200 table of bench/RESULTS.md: e4b geometry (random weights, 4-bit, LoRA rank 8 on every
# linear of all 42 layers), mlx-lm full / per-layer checkpoint vs segback segmented.
# Usage on the GPU machine (after step 1 of ../shared/device/README.md):
#   source .devwheels/install-mlx-cuda.sh && bash bench/gpu_bench.sh {table|long|tiled|tiled2..tiled13} OUT_DIR
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
  # Where the tiled step's GPU time goes: first step (CUDA JIT of the compiled tile functions)
  # vs steady state, compiled vs eager; the faster one runs the rest of the table.
  T="--modes segmented --max-ops-per-buffer 4 --tile 1024 --offload"
  $B --seq 8192 --steps 2 $T --timeout 150
  $B --seq 8192 --steps 2 $T --eager --timeout 120
  E=$(python3 -c "import json,sys; r=[json.loads(l) for l in open('$out/bench.jsonl')][-2:]; \
t=[x.get('s_per_step', 1e9) for x in r]; print('--eager' if t[1] < t[0] else '')")
  $B --seq 32768 --steps 1 $T $E --timeout 200
  $B --seq 16384 --steps 1 $T $E --timeout 120
  $B --seq 65536 --steps 0 $T $E --timeout 200
  $B --seq 8192 --steps 2 --modes segmented --tile 1024 --offload $E --timeout 100
elif [ "$part" = tiled3 ]; then
  # Two tiles in flight (host builds tile t+1 while the GPU runs tile t), eager on CUDA; tile sizes.
  T="--modes segmented --max-ops-per-buffer 4 --offload"
  $B --seq 8192 --steps 2 $T --tile 1024 --timeout 75
  $B --seq 8192 --steps 2 $T --tile 2048 --timeout 75
  $B --seq 32768 --steps 1 $T --tile 1024 --timeout 110
  $B --seq 8192 --steps 2 $T --tile 4096 --timeout 75
elif [ "$part" = tiled4 ]; then
  # After the offload copies out moved to a worker thread (bench/tiled_profile.py --step found
  # the copies at 1.5 s of a 6.3 s step): step split, then the table at tile 2048, two in flight.
  timeout 150 python3 bench/tiled_profile.py --model e4b --quant-bits 4 --seq 8192 --step \
    --tiles 2048 > $out/step_parts.jsonl
  T="--modes segmented --max-ops-per-buffer 4 --offload --in-flight 2"
  $B --seq 8192 --steps 2 $T --tile 2048 --timeout 75
  $B --seq 8191 --steps 2 --modes ckpt --timeout 75
  $B --seq 16384 --steps 1 $T --tile 2048 --timeout 75
  $B --seq 32768 --steps 1 $T --tile 2048 --timeout 110
elif [ "$part" = tiled5 ]; then
  T="--modes segmented --max-ops-per-buffer 4 --offload --in-flight 2 --tile 1024"
  $B --seq 65536 --steps 0 $T --timeout 150
  $B --seq 131072 --steps 0 $T --timeout 330
elif [ "$part" = tiled6 ]; then
  # Light tiles (pre pass, its VJP and the forward post pass on 8192-token tiles), boundaries
  # fetched back one layer early on a side stream; heavy tile 2048 / 4096, one or two in flight.
  T="--modes segmented --max-ops-per-buffer 4 --offload"
  $B --seq 8192 --steps 2 $T --tile 2048 --light-tile 8192 --in-flight 2 --timeout 150
  $B --seq 8192 --steps 2 $T --tile 4096 --light-tile 8192 --in-flight 1 --timeout 75
  $B --seq 8192 --steps 2 $T --tile 2048 --in-flight 2 --timeout 75
  $B --seq 8192 --steps 2 $T --tile 4096 --light-tile 8192 --in-flight 2 --timeout 75
  $B --seq 8191 --steps 2 --modes ckpt --timeout 75
elif [ "$part" = tiled6b ]; then
  # The side-stream prefetch on and off, light tiles 4096 / 8192 with heavy tiles 2048.
  T="--modes segmented --max-ops-per-buffer 4 --offload --in-flight 2 --tile 2048"
  $B --seq 8192 --steps 2 $T --prefetch off --timeout 240
  $B --seq 8192 --steps 2 $T --prefetch on --timeout 75
  $B --seq 8192 --steps 2 $T --light-tile 4096 --prefetch off --timeout 75
  $B --seq 8192 --steps 2 $T --light-tile 8192 --prefetch off --timeout 75
  $B --seq 8192 --steps 2 $T --light-tile 4096 --prefetch on --timeout 75
elif [ "$part" = tiled7 ]; then
  # The 8K configuration $BEST (from tiled6) with the last N boundaries kept on the device, then
  # 32K and 64K with light tiles.
  T="--modes segmented --max-ops-per-buffer 4 --offload"
  for N in ${KEEP:-8 12}; do
    $B --seq 8192 --steps 2 $T $BEST --offload-keep $N --timeout 75
  done
  $B --seq 32768 --steps 1 $T --tile 2048 --light-tile 8192 --in-flight 2 --timeout 110
  $B --seq 65536 --steps 0 $T --tile 1024 --light-tile 4096 --in-flight 2 --timeout 150
elif [ "$part" = tiled9 ]; then
  # After the whole-sequence copies left the tiled layer VJP (attention.Rows): the table again,
  # 8K with 5 timed steps (2-step medians spread +-0.3 s on the H200), ckpt on the same machine.
  T="--modes segmented --max-ops-per-buffer 4 --offload --in-flight 2"
  $B --seq 8192 --steps 5 $T --tile 2048 --timeout 240
  $B --seq 8191 --steps 5 --modes ckpt --timeout 90
  $B --seq 32768 --steps 1 $T --tile 2048 --timeout 120
  $B --seq 131072 --steps 0 $T --tile 1024 --timeout 330
elif [ "$part" = tiled10a ]; then
  # tiled9's 8K (eager; the first process JIT-builds the kernels), then the same with compiled
  # tile functions shared by the layers of one structure (12 traces, not 168).
  T="--modes segmented --max-ops-per-buffer 4 --offload --in-flight 2 --tile 2048"
  $B --seq 8192 --steps 5 $T --timeout 230
  $B --seq 8192 --steps 5 $T --compile on --share-traces on --timeout 230
elif [ "$part" = tiled10b ]; then
  # ckpt on the same machine, then 32K and 128K with whichever of eager/compiled was faster.
  T="--modes segmented --max-ops-per-buffer 4 --offload --in-flight 2"
  C=$(python3 -c "import json; r=[json.loads(l) for l in open('$out/bench.jsonl')][-2:]; \
t=[x.get('s_per_step', 1e9) for x in r]; print('--compile on --share-traces on' if t[1] < t[0] else '')")
  $B --seq 8191 --steps 5 --modes ckpt --timeout 80
  $B --seq 32768 --steps 1 $T --tile 2048 $C --timeout 120
  $B --seq 131072 --steps 0 $T --tile 1024 $C --timeout 320
elif [ "$part" = tiled11 ]; then
  # Compiled shared tile functions (tiled10's faster path) with the 8K options that cost little
  # device memory: light tiles, a 3072-token tile, early copies back.
  T="--modes segmented --max-ops-per-buffer 4 --offload --in-flight 2 --compile on --share-traces on"
  $B --seq 8192 --steps 5 $T --tile 2048 --timeout 200
  $B --seq 8192 --steps 5 $T --tile 2048 --light-tile 4096 --timeout 110
  $B --seq 8192 --steps 5 $T --tile 3072 --timeout 110
  $B --seq 8192 --steps 5 $T --tile 2048 --prefetch on --timeout 100
elif [ "$part" = tiled12a ]; then
  # With Gemma-4's per-layer embedding table in host memory (offload parks it: 1.59 GB less at
  # rest), the 8K options that did not fit in 8 GB: a 4096-token tile; boundaries kept on the
  # device (no copies) as far as the planner's target allows. The first run only JIT-builds.
  T="--modes segmented --max-ops-per-buffer 4 --offload --in-flight 2 --compile on --share-traces on"
  $B --seq 4096 --steps 0 $T --tile 2048 --timeout 400
  $B --seq 8191 --steps 5 --modes ckpt --timeout 120
  $B --seq 8192 --steps 5 $T --tile 4096 --timeout 120
  $B --seq 8192 --steps 5 $T --tile 2048 --offload-keep auto --target-gb 7.6 --timeout 120
elif [ "$part" = tiled12b ]; then
  T="--modes segmented --max-ops-per-buffer 4 --offload --in-flight 2 --compile on --share-traces on"
  $B --seq 8192 --steps 5 $T --tile 3072 --offload-keep auto --target-gb 7.6 --timeout 120
  $B --seq 8192 --steps 5 $T --tile 4096 --offload-keep auto --target-gb 7.6 --timeout 120
  $B --seq 8192 --steps 5 $T --tile 3072 --timeout 120
  $B --seq 8192 --steps 5 $T --tile 4096 --light-tile 8192 --timeout 120
  $B --seq 32768 --steps 1 $T --tile 2048 --timeout 120
elif [ "$part" = tiled13 ]; then
  # The defaults a user gets (traces shared on the GPU, offload_keep auto) with only a target
  # and --compile on; then kept boundaries at 16K/32K under targets with room for the planner's gap.
  T="--modes segmented --max-ops-per-buffer 4 --offload --in-flight 2 --compile on"
  $B --seq 4096 --steps 0 $T --tile 2048 --timeout 300
  $B --seq 8191 --steps 5 --modes ckpt --timeout 100
  $B --seq 8192 --steps 5 $T --tile 2048 --target-gb 7.6 --timeout 100
  $B --seq 16384 --steps 2 $T --tile 2048 --target-gb 8 --timeout 100
  $B --seq 32768 --steps 1 $T --tile 2048 --target-gb 10.5 --timeout 120
elif [ "$part" = tiled8 ]; then
  T="--modes segmented --max-ops-per-buffer 4 --offload"
  $B --seq 131072 --steps 0 $T --tile 1024 --light-tile 4096 --in-flight 2 --timeout 400
else
  for L in 8192 16384 32768 65536 131072; do
    $B --seq $L --steps 1 --modes segmented --attention chunked --max-ops-per-buffer 4 --timeout 240
  done
fi
