#!/usr/bin/env bash
# One device call for the kernels: install the carried wheelhouse, JIT-build the LoCo kernels (and, with VARIANTS,
# one more build per ';'-separated set of extra nvcc flags, side by side), time them on a quiet GPU (benchmarks/kernels.py), take
# the SASS and an Nsight Compute profile of hop 1 where the tools exist, then run every kernel-vs-reference test and
# the CUDA reduce test, optionally with convergence runs side by side (CONVERGENCE: benchmarks/convergence_sim.py
# launch arguments, stopped after CONVERGENCE_BUDGET_S seconds). Results go to $OUT (default ./device_out): the
# benchmark table and JSON, the SASS summary, the ncu report and per-line counts, the test log, and logs.tar.gz
# (pip, builds, ncu run, binding-error test, the whole SASS).
# Usage (repository root, wheelhouse .whl/ from benchmarks/device_wheelhouse.sh):
#   [VARIANTS="-DLOCO_MIN_BLOCKS=3;-DLOCO_ERROR_CHUNKS=4"] [CONVERGENCE='--matrix ...'] \
#       bash benchmarks/device_kernels.sh [kernels.py args]
set -uo pipefail
OUT=${OUT:-device_out}
VARIANTS=${VARIANTS:-}
LOGS=/tmp/device_kernels_logs
CONVERGENCE=${CONVERGENCE:-}
CONVERGENCE_BUDGET_S=${CONVERGENCE_BUDGET_S:-240}
mkdir -p "$OUT" "$LOGS"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >"$LOGS/pip.log" 2>&1
export PYTHONPATH=/tmp/site:$PWD TORCH_CUDA_ARCH_LIST=9.0  # DeepSpeed 0.19.8 cannot parse "9.0a"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
start=$(date +%s)
python3 -c "from deepspeed_loco.ops import loco_cuda; loco_cuda.load()" >"$LOGS/build.log" 2>&1 &
default_build=$!
IFS=';' read -r -a variants <<<"$VARIANTS"
builds=()
for i in "${!variants[@]}"; do
    python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import kernels; kernels.variant_builder('${variants[$i]}', $i).load(verbose=False)" \
        >"$LOGS/variant${i}_build.log" 2>&1 &
    builds+=($!)
done
wait $default_build || { tail -50 "$LOGS/build.log"; exit 1; }
variant_args=()
for i in "${!variants[@]}"; do
    if wait "${builds[$i]}"; then
        variant_args+=("--variant=${variants[$i]}")
    else
        echo "variant $i (${variants[$i]}) build failed, timing without it:"; tail -20 "$LOGS/variant${i}_build.log"
    fi
done
echo "JIT builds: $(( $(date +%s) - start )) s"

python3 benchmarks/kernels.py --json "$OUT/kernels.json" "${variant_args[@]}" "$@" >"$OUT/kernels.txt" 2>&1
echo "benchmark exit $? at $(( $(date +%s) - start )) s"

so=$(find ~/.cache/torch_extensions -name "loco_ops.so" 2>/dev/null | head -1)
if command -v cuobjdump >/dev/null && [ -n "$so" ]; then
    cuobjdump -sass "$so" >$LOGS/loco_ops.sass 2>&1
    python3 benchmarks/sass_summary.py $LOGS/loco_ops.sass >"$OUT/sass_summary.txt" 2>&1
    echo "SASS: $(wc -l <$LOGS/loco_ops.sass) lines, summary in sass_summary.txt"
fi
if command -v ncu >/dev/null; then
    timeout 150 ncu --kernel-name regex:hop1_kernel --launch-skip 4 --launch-count 3 --section SpeedOfLight \
        --section Occupancy --section WarpStateStats --section SchedulerStats --section InstructionStats \
        --section SourceCounters -o /tmp/ncu_hop1 python3 benchmarks/kernels.py --profile-hop1 >"$LOGS/ncu_run.log" 2>&1
    echo "ncu exit $?"
    ncu -i /tmp/ncu_hop1.ncu-rep >"$OUT/ncu_hop1.txt" 2>&1
    # executed instructions per SASS line of each profiled kernel (the hot spots), summarized by opcode
    ncu -i /tmp/ncu_hop1.ncu-rep --page source --csv --print-source sass >/tmp/ncu_hop1_source.csv 2>&1
    python3 benchmarks/sass_summary.py --ncu-source /tmp/ncu_hop1_source.csv >"$OUT/ncu_hop1_source.txt" 2>&1
    echo "ncu: $(grep -c "hop1_kernel" "$OUT/ncu_hop1.txt") kernel sections, source csv $(wc -l </tmp/ncu_hop1_source.csv) lines"
    gzip -c /tmp/ncu_hop1_source.csv >"$OUT/ncu_hop1_source.csv.gz"
else
    echo "no ncu on this machine"
fi

if [ -n "$CONVERGENCE" ]; then
    eval "python3 benchmarks/convergence_sim.py launch --parallel 15 --budget $CONVERGENCE_BUDGET_S \
        --out $OUT/runs.jsonl --logs /tmp/convergence_sim_logs $CONVERGENCE" >"$OUT/convergence.log" 2>&1 &
    convergence=$!
fi
# the binding's bad-argument test alone, with Python's fault handler and, where gdb exists, a native backtrace
# (it crashes the process when the binding's first argument check throws)
timeout 120 python3 -X faulthandler -m pytest -q -p no:cacheprovider -m "" tests/unit/ops/test_loco_kernels.py \
    -k test_invalid_arguments_raise_at_the_binding >"$LOGS/binding_errors.log" 2>&1
echo "binding-error test exit $?: $(tail -1 "$LOGS/binding_errors.log")"
if command -v gdb >/dev/null; then
    timeout 60 gdb -batch -ex run -ex bt --args python3 -m pytest -q -p no:cacheprovider -m "" \
        tests/unit/ops/test_loco_kernels.py -k test_invalid_arguments_raise_at_the_binding >"$LOGS/binding_errors_gdb.log" 2>&1
    echo "gdb backtrace: $(grep -c '^#' "$LOGS/binding_errors_gdb.log") frames in binding_errors_gdb.log"
fi
python3 -m pytest -q -p no:cacheprovider -m "" tests/unit/ops tests/unit/runtime/comm/test_loco_reduce_cuda.py \
    --deselect tests/unit/ops/test_loco_kernels.py::test_invalid_arguments_raise_at_the_binding >"$OUT/tests.log" 2>&1
echo "tests: $(tail -1 "$OUT/tests.log") at $(( $(date +%s) - start )) s"
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20
if [ -n "$CONVERGENCE" ]; then
    wait $convergence
    tail -25 "$OUT/convergence.log"
fi
tar -C "$LOGS" -czf "$OUT/logs.tar.gz" .
tail -75 "$OUT/kernels.txt"
