#!/usr/bin/env bash
# One device call for benchmarks/monitor_overhead.py on one GPU: install the carried wheelhouse (.whl/,
# benchmarks/device_wheelhouse.sh), build the LoCo CUDA kernels once, then time the 116M model's step with DeepSpeed's
# monitor (and LoCo's telemetry) on and off and the live rho on and off, saving table.txt and log.txt under $OUT.
# Further arguments go to monitor_overhead.py (default: --size 125m --micro-batch 16, 5 rounds of 30 steps per arm).
# Usage (repository root):
#   OUT=$OUT bash benchmarks/device_monitor_overhead.sh [--rho-every 1 --steps 20 ...]
set -uo pipefail
OUT=${OUT:-device_out}
RUN_TIMEOUT_S=${RUN_TIMEOUT_S:-240}
mkdir -p "$OUT"
start=$(date +%s)
# shellcheck source=benchmarks/device_setup.sh
source benchmarks/device_setup.sh "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
timeout "$RUN_TIMEOUT_S" python3 benchmarks/monitor_overhead.py --size 125m --micro-batch 16 \
    --table "$OUT/table.txt" "$@" >"$OUT/log.txt" 2>&1
code=$?
if [ "$code" = 0 ]; then cat "$OUT/table.txt"; else tail -30 "$OUT/log.txt"; fi
echo "exit $code, total $(( $(date +%s) - start )) s"
exit $code
