#!/usr/bin/env bash
# One device call for benchmarks/convergence_sim.py: install the carried wheelhouse (.whl/), build the LoCo CUDA
# kernels once, probe one short run (abort on any error), then run the matrices side by side on the one GPU,
# PARALLEL processes at a time, every finished run appended to $OUT/runs.jsonl (a timeout keeps what finished).
# PROBE=0 skips the probe; SOLO="FLAGS;FLAGS" first runs each flag set alone (timings, peak memory) into solo.jsonl.
# Usage (repository root):
#   BUDGET_S=450 PARALLEL=14 OUT=$OUT bash benchmarks/device_convergence_sim.sh --matrix "m600:600:0,1,2:full,loco2" ...
set -uo pipefail
OUT=${OUT:-device_out}
BUDGET_S=${BUDGET_S:-450}
PARALLEL=${PARALLEL:-14}
PROBE=${PROBE:-1}
mkdir -p "$OUT"
start=$(date +%s)
# shellcheck source=benchmarks/device_setup.sh
source benchmarks/device_setup.sh "$OUT"
if [ "$PROBE" = 1 ]; then
    if ! timeout 120 python3 benchmarks/convergence_sim.py run --arm loco8-2h --seed 0 --steps 30 --eval-every 15 \
            --tag probe --diagnostics 1 --out "$OUT/probe.jsonl" >"$OUT/probe.log" 2>&1 \
            || ! grep -q "loco_cuda" "$OUT/probe.log"; then
        echo "probe failed:"; tail -40 "$OUT/probe.log"; exit 1
    fi
fi
[ "$PROBE" = 1 ] && echo "probe ok at $(( $(date +%s) - start )) s: $(tail -1 "$OUT/probe.log")"
# SOLO: run-flag sets separated by ';', each run alone (step time and peak memory without neighbours) -> solo.jsonl
IFS=';' read -ra solo_runs <<< "${SOLO:-}"
for flags in "${solo_runs[@]}"; do
    [ -n "${flags// }" ] || continue
    # shellcheck disable=SC2086  # the flags are words
    python3 benchmarks/convergence_sim.py run --tag solo --out "$OUT/solo.jsonl" $flags 2>&1 | tail -1
done
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
python3 benchmarks/convergence_sim.py launch --parallel "$PARALLEL" --budget "$BUDGET_S" --out "$OUT/runs.jsonl" \
    --logs /tmp/convergence_sim_logs "$@"
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
echo "total $(( $(date +%s) - start )) s, $(wc -l < "$OUT/runs.jsonl") runs in runs.jsonl"
