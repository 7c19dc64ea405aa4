#!/usr/bin/env bash
# One device call: Megatron-DeepSpeed's own, unmodified pretrain_gpt.py (a tiny GPT) under ZeRO-3 + qgZ +
# zeropp_loco_param through deepspeed-loco's module runner (examples/megatron/ds_pretrain_gpt_tiny_loco.sh), on the
# GPUs of one machine, offline. Needs, carried: .whl (benchmarks/device_wheelhouse.sh), .megatron (a Megatron-DeepSpeed
# checkout exported from git, commit in .megatron/MEGATRON_COMMIT; see docs/frameworks.md) and, if any, the extra
# wheels in .whl-megatron. Writes $OUT/megatron.log (the whole run), pip.log (the extra wheels'), helpers.log,
# ds_config.json.
# Usage (repository root):
#   OUT=$OUT bash benchmarks/device_megatron.sh            # NUM_GPUS=2 on a 2-GPU machine: W=2, LoCo communicates
set -uo pipefail
OUT=${OUT:-device_out}
MEGATRON=${MEGATRON:-$PWD/.megatron}
RUN_TIMEOUT_S=${RUN_TIMEOUT_S:-300}
mkdir -p "$OUT"
start=$(date +%s)
[ -f "$MEGATRON/pretrain_gpt.py" ] || { echo "no Megatron-DeepSpeed checkout at $MEGATRON (carry .megatron)"; exit 1; }
# shellcheck source=benchmarks/device_setup.sh
source benchmarks/device_setup.sh "$OUT"
if compgen -G ".whl-megatron/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-megatron/*.whl >>"$OUT/pip.log" 2>&1 \
        || { tail -20 "$OUT/pip.log"; exit 1; }
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
echo "Megatron-DeepSpeed $(cat "$MEGATRON/MEGATRON_COMMIT" 2>/dev/null || echo '(commit unknown)')"
python3 - <<'PY'
import sys, importlib
print("python", sys.version.split()[0])
for name in ("torch", "deepspeed", "transformers", "torchvision", "pybind11", "numpy", "einops", "regex", "six"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"), end="; ")
    except Exception as e:  # noqa: BLE001
        print(name, "MISSING", type(e).__name__, e, end="; ")
import torch
print("\ncuda", torch.version.cuda, "| gpus", torch.cuda.device_count())
PY
nvcc --version | tail -2 | head -1
command -v python3-config >/dev/null || echo "note: no python3-config (Megatron's own make of the helpers names no suffix; prebuilt below)"
# Megatron's dataset helpers (C++/pybind11; rank 0 runs `make` at start-up, which then finds them up to date): built
# first, naming the extension suffix (the venv has no python3-config). The image's g++ (/opt/gcc) links a libstdc++
# other than the one torch loads, and the first integer the helpers print then segfaults (seen on the H200,
# 2026-12-04), so libstdc++ and libgcc are linked in statically with their symbols hidden; a smoke test calls the
# helpers once before the run.
suffix=$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
self_contained="-O3 -Wall -shared -std=c++11 -fPIC -static-libstdc++ -static-libgcc -Wl,--exclude-libs,ALL"
(cd "$MEGATRON/megatron/data" && rm -f helpers*.so && g++ $self_contained $(python3 -m pybind11 --includes) \
    helpers.cpp -o "helpers$suffix") >"$OUT/helpers.log" 2>&1 || { tail -20 "$OUT/helpers.log"; exit 1; }
smoke_test() {
    PYTHONPATH="$MEGATRON/megatron/data:$PYTHONPATH" python3 -c "
import numpy as np
import helpers
idx = helpers.build_sample_idx(np.array([5, 5, 5], np.int32), np.array([0, 1, 2], np.int32), 4, 1, 15)
assert idx.tolist()[:3] == [[0, 0], [0, 4], [1, 3]], idx
print('helpers smoke test ok')" >>"$OUT/helpers.log" 2>&1
}
if ! smoke_test; then  # fall back: the compiler's own libstdc++ preloaded into every process of the run
    LD_PRELOAD=$(g++ -print-file-name=libstdc++.so.6)
    export LD_PRELOAD
    echo "helpers smoke test failed; retrying with LD_PRELOAD=$LD_PRELOAD" | tee -a "$OUT/helpers.log"
    smoke_test || { echo "helpers smoke test failed:"; tail -20 "$OUT/helpers.log"; exit 1; }
fi
tail -1 "$OUT/helpers.log"
if ! command -v make >/dev/null; then  # Megatron's own `make -C` call: a stand-in with nothing left to do
    mkdir -p /tmp/megatron-bin
    printf '#!/bin/sh\necho "make (stand-in): the helpers are prebuilt"\n' >/tmp/megatron-bin/make
    chmod +x /tmp/megatron-bin/make
    export PATH=/tmp/megatron-bin:$PATH
fi
echo "setup done at $(( $(date +%s) - start )) s"
export OUTPUT_DIR=/tmp/megatron_loco
NUM_GPUS=${NUM_GPUS:-1} TRAIN_ITERS=${TRAIN_ITERS:-20} MEGATRON=$MEGATRON timeout "$RUN_TIMEOUT_S" \
    bash examples/megatron/ds_pretrain_gpt_tiny_loco.sh "$@" >"$OUT/megatron.log" 2>&1
code=$?
cp "$OUTPUT_DIR"/ds_config_*.json "$OUT/ds_config.json" 2>/dev/null
echo "== pretrain_gpt.py: exit $code at $(( $(date +%s) - start )) s"
grep -a -E "deepspeed-loco|^ *iteration +[0-9]+/|validation loss|Error|error:|Traceback" "$OUT/megatron.log" | cut -c1-300 | head -60
[ "$code" = 0 ] || tail -40 "$OUT/megatron.log" | cut -c1-300
exit $code
