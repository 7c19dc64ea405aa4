#!/usr/bin/env bash
# One device call: install the carried wheelhouse, JIT-build the LoCo kernels, run every kernel-vs-reference test
# and the CUDA reduce test, then time the kernels. Logs and JSON go to $OUT (default ./device_out).
# Usage (repository root, wheelhouse .whl/ from benchmarks/device_wheelhouse.sh): bash benchmarks/device_kernels.sh
set -uo pipefail
OUT=${OUT:-device_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >"$OUT/pip.log" 2>&1
export PYTHONPATH=/tmp/site:$PWD TORCH_CUDA_ARCH_LIST=9.0  # DeepSpeed 0.19.8 cannot parse "9.0a"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
start=$(date +%s)
python3 -c "from deepspeed_loco.ops import loco_cuda; loco_cuda.load()" >"$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
echo "JIT build: $(( $(date +%s) - start )) s"
python3 -m pytest -q -p no:cacheprovider tests/unit/ops tests/unit/runtime/comm/test_loco_reduce_cuda.py \
    >"$OUT/tests.log" 2>&1
echo "tests: $(tail -1 "$OUT/tests.log")"
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20
python3 benchmarks/kernels.py --json "$OUT/kernels.json" "$@" >"$OUT/kernels.txt" 2>&1
echo "benchmark exit $?"
tail -60 "$OUT/kernels.txt"
