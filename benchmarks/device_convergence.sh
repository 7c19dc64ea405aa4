#!/usr/bin/env bash
# One device call: the convergence benchmark on one GPU shared by the 4 simulated ranks (gloo carries the
# collectives, the fused CUDA kernels do LoCo's arithmetic), one process group per seed running side by side.
# Usage (repository root, wheelhouse .whl/ from benchmarks/device_wheelhouse.sh):
#   SEEDS="0 1 2 3 4" BUDGET_S=420 bash benchmarks/device_convergence.sh [extra convergence.py flags]
#   STREAMS="0:loco8-2,loco2 1:loco8-2,loco2" PROBE=0 bash benchmarks/device_convergence.sh   # chosen arms per seed
# Each stream's runs go to $OUT/sN_K/runs.jsonl as they finish; all of them are concatenated into $OUT/runs.jsonl.
set -uo pipefail
OUT=${OUT:-device_out}
SEEDS=${SEEDS:-"0 1 2"}
BUDGET_S=${BUDGET_S:-420}
PROBE=${PROBE:-1}
STREAMS=${STREAMS:-$(for seed in $SEEDS; do printf '%s: ' "$seed"; done)}  # "seed:arms" (empty arms: default)
mkdir -p "$OUT"
# shellcheck source=benchmarks/device_setup.sh
source benchmarks/device_setup.sh "$OUT"
common=(--device cuda --backend gloo --dtype fp32)
start=$(date +%s)
if [ "$PROBE" = 1 ] && ! timeout 180 python3 benchmarks/convergence.py "${common[@]}" --seeds 0 --arms full,loco8-2h --steps 6 \
        --eval-every 3 --eval-windows 16 --out "$OUT/probe" "$@" >"$OUT/probe.log" 2>&1; then
    tail -30 "$OUT/probe.log"; tail -30 "$OUT/probe/logs/rank0.log"; exit 1
fi
[ "$PROBE" = 1 ] && { echo "probe ok in $(( $(date +%s) - start )) s"; grep "seed 0" "$OUT/probe.log"; }
k=0
for stream in $STREAMS; do
    seed=${stream%%:*}; arms=${stream#*:}; k=$((k + 1))
    timeout "$BUDGET_S" python3 benchmarks/convergence.py "${common[@]}" --seeds "$seed" ${arms:+--arms "$arms"} \
        --out "$OUT/s${seed}_$k" "$@" >"$OUT/s${seed}_$k.log" 2>&1 &
done
wait
cat "$OUT"/s*_*/runs.jsonl > "$OUT/runs.jsonl"
echo "finished runs: $(wc -l < "$OUT/runs.jsonl") in $(( $(date +%s) - start )) s"
grep -h "seed" "$OUT"/s*_*.log | grep -v "^world\|^model\|^data" | tail -40
rm -rf "$OUT"/s*_* "$OUT/probe"
