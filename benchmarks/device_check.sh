#!/usr/bin/env bash
# One device call that checks what a change to the kernels, the ops or the engine path can break, and refreshes the
# measurements, each stage under a timeout so that one failing stage leaves the others' results in $OUT:
#   1. wheels + the LoCo kernel build (benchmarks/device_setup.sh); in the background the VARIANTS builds (nvcc flag
#      sets, ';'-separated) and DeepSpeed's quantizer (the benchmark's baseline);
#   2. the CUDA tests (kernels against the reference, the torch.library opchecks, the reduce on CUDA), beside the
#      Megatron-DeepSpeed run when MEGATRON=1 (benchmarks/device_megatron.sh; .megatron/ and .whl-megatron/
#      carried; NUM_GPUS as there);
#   3. on a quiet GPU: the kernel table (benchmarks/kernels.py, JSON and text) and the gpu_e2e.py runs of E2E_RUNS
#      ("SIZE:MICRO_BATCH ...", arms E2E_ARMS, E2E_ROUNDS rounds in rotated arm order): the points
#      `python -m deepspeed_loco.perf calibrate` fits, with how far each arm's rounds moved.
# Usage (repository root; .whl/ from benchmarks/device_wheelhouse.sh):
#   [MEGATRON=1] [VARIANTS="-DLOCO_HOP_GROUPS=2"] OUT=$OUT bash benchmarks/device_check.sh
set -uo pipefail
OUT=${OUT:-device_out}
VARIANTS=${VARIANTS:-}
MEGATRON=${MEGATRON:-0}
E2E_RUNS=${E2E_RUNS:-"125m:4 125m:32"}
E2E_ARMS=${E2E_ARMS:-zero3,loco}
E2E_ROUNDS=${E2E_ROUNDS:-3}
LOGS=$OUT/logs
mkdir -p "$OUT" "$LOGS"
start=$(date +%s)
stamp() { echo "[$(( $(date +%s) - start )) s] $*"; }
# shellcheck source=benchmarks/device_setup.sh
source benchmarks/device_setup.sh "$LOGS"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

timeout 240 python3 -c "from deepspeed.ops.op_builder import QuantizerBuilder; QuantizerBuilder().load()" \
    >"$LOGS/deepspeed_quantizer_build.log" 2>&1 &
builds=($!)
IFS=';' read -r -a variants <<<"$VARIANTS"
for i in "${!variants[@]}"; do
    timeout 240 python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import kernels; kernels.variant_builder('${variants[$i]}', $i).load(verbose=False)" \
        >"$LOGS/variant${i}_build.log" 2>&1 &
    builds+=($!)
done

if [ "$MEGATRON" = 1 ]; then
    (OUT="$OUT/megatron" RUN_TIMEOUT_S=150 bash benchmarks/device_megatron.sh >"$LOGS/megatron_call.log" 2>&1; \
        echo "megatron exit $?" >>"$LOGS/megatron_call.log") &
    megatron=$!
fi
timeout 240 python3 -m pytest -q -p no:cacheprovider -m "" tests/unit/ops tests/unit/runtime/comm/test_loco_reduce_cuda.py \
    --deselect tests/unit/ops/test_loco_kernels.py::test_invalid_arguments_raise_at_the_binding >"$OUT/tests.log" 2>&1
stamp "CUDA tests exit $?: $(tail -1 "$OUT/tests.log")"
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20
if [ "$MEGATRON" = 1 ]; then
    wait "$megatron"
    stamp "Megatron-DeepSpeed: $(tail -1 "$LOGS/megatron_call.log")"
    grep -a -E "deepspeed-loco|iteration +[0-9]+/|Error|error:" "$LOGS/megatron_call.log" | cut -c1-240 | head -16
fi
variant_args=()
for i in "${!builds[@]}"; do
    if wait "${builds[$i]}"; then
        [ "$i" -gt 0 ] && variant_args+=("--variant=${variants[$((i - 1))]}")
    else
        stamp "build $i failed (0: DeepSpeed's quantizer, else variant i - 1)"
    fi
done

timeout 150 python3 benchmarks/kernels.py --json "$OUT/kernels.json" --configs 4/4 4/4+H 8/2+H "${variant_args[@]}" \
    >"$OUT/kernels.txt" 2>&1
stamp "kernel benchmark exit $?"
tail -45 "$OUT/kernels.txt"

for run in $E2E_RUNS; do
    size=${run%%:*}
    micro_batch=${run##*:}
    timeout $(( 60 * E2E_ROUNDS )) python3 benchmarks/gpu_e2e.py --size "$size" --micro-batch "$micro_batch" \
        --arms "$E2E_ARMS" --rounds "$E2E_ROUNDS" --steps 20 --out "$OUT/e2e_${size}_mb${micro_batch}.json" \
        --table "$OUT/e2e_${size}_mb${micro_batch}.txt" \
        >"$LOGS/e2e_${size}_mb${micro_batch}.log" 2>&1
    stamp "gpu_e2e $size micro-batch $micro_batch exit $?"
    grep -E "^(zero3|dsqgz|plain|loco) " "$OUT/e2e_${size}_mb${micro_batch}.txt" 2>/dev/null
done
stamp "done"
