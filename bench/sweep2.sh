# Issue 7, last H200 session: compiled tile functions; 8K tile/offload variants, then 32K, 16K.
B="python3 -m segback.cli bench --model e4b --quant-bits 4 --out $OUT/bench.jsonl"
T="--modes segmented --segments 1 --attention chunked --max-ops-per-buffer 4"
$B --seq 8192 --steps 2 $T --offload --tile 2048 --timeout 200
$B --seq 8192 --steps 2 $T --offload --tile 4096 --timeout 60
$B --seq 8192 --steps 2 $T --tile 2048 --timeout 60
$B --seq 32768 --steps 1 $T --offload --tile 4096 --timeout 80
$B --seq 16384 --steps 1 $T --offload --tile 4096 --timeout 50
