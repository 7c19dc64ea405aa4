#!/usr/bin/env bash
# One device call for benchmarks/gpu_e2e.py on one GPU (world size 1, NCCL): install the carried wheelhouse (.whl/,
# benchmarks/device_wheelhouse.sh), build the LoCo CUDA kernels once, then run the four arms (zero3, dsqgz, plain,
# loco) for each run of RUNS, saving results_<size>_mb<micro-batch>.json, table_... and log_... under $OUT.
# RUNS: "SIZE:MICRO_BATCH ..." (default "125m:16 1b:8"); further arguments go to every gpu_e2e.py run.
# RUN_TIMEOUT_S bounds each run; one stopped by it keeps the rounds it finished (gpu_e2e.py saves after each round).
# On the H200 each arm of each round costs ~15 s (engine set-up and 20 steps of the 125m model): 4 arms x 3 rounds
# take ~180 s per run, so at most three such runs fit one 10-minute call.
# Usage (repository root):
#   OUT=$OUT bash benchmarks/device_gpu_e2e.sh [--steps 20 ...]
set -uo pipefail
OUT=${OUT:-device_out}
RUNS=${RUNS:-"125m:16 1b:8"}
RUN_TIMEOUT_S=${RUN_TIMEOUT_S:-240}
mkdir -p "$OUT"
start=$(date +%s)
# shellcheck source=benchmarks/device_setup.sh
source benchmarks/device_setup.sh "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
status=0
for run in $RUNS; do
    size=${run%%:*}
    micro_batch=${run##*:}
    name="${size}_mb$micro_batch"
    timeout "$RUN_TIMEOUT_S" python3 benchmarks/gpu_e2e.py --size "$size" --micro-batch "$micro_batch" \
        --out "$OUT/results_$name.json" --table "$OUT/table_$name.txt" "$@" >"$OUT/log_$name.txt" 2>&1
    code=$?
    echo "== $size (micro-batch $micro_batch): exit $code at $(( $(date +%s) - start )) s"
    if [ -f "$OUT/table_$name.txt" ]; then cat "$OUT/table_$name.txt"; else tail -30 "$OUT/log_$name.txt"; fi
    [ "$code" = 0 ] || status=1  # 1: a gradient check failed (the table says which); else a crash or timeout
done
echo "total $(( $(date +%s) - start )) s"
exit $status
