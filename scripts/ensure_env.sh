#!/usr/bin/env bash
# Installs what deepspeed-loco needs into the current python3, once (idempotent, quiet).
# A fresh machine has Python 3.11, pip and a CPU build of torch 2.13.0 on disk: take that torch first, so that
# DeepSpeed's requirement on torch does not pull a multi-GB CUDA build.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=${PYTHON:-python3}
if ! "$py" -c "import torch" 2>/dev/null; then
  "$py" -m pip install -q torch==2.13.0
fi
# hf (transformers, accelerate): the tests run the Hugging Face Trainer and the Accelerate example for real
if ! "$py" -c "import deepspeed_loco, deepspeed, pytest, ninja, tqdm, matplotlib, scipy, importlib.util as u; \
assert u.find_spec('transformers') and u.find_spec('accelerate')" 2>/dev/null \
   || [ "$("$py" -c 'import deepspeed_loco, os; print(os.path.dirname(os.path.dirname(deepspeed_loco.__file__)))' 2>/dev/null)" != "$root" ]; then
  "$py" -m pip install -q -e "$root[test,demo,hf]"
fi
