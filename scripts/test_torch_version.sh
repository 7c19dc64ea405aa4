#!/usr/bin/env bash
# Runs the CPU test suite against another torch release: a fresh venv with that torch (CPU build), DeepSpeed and
# this project (editable, with the test extras), then pytest. CI keeps torch 2.13 CPU (scripts/test.sh).
#
#   scripts/test_torch_version.sh 2.15.0                              # the whole suite
#   scripts/test_torch_version.sh 2.15.0 tests/unit/runtime tests/unit/ops   # a part of it (pytest arguments)
#
# Environment: VENV [.venv-torch<VERSION> in the repository root; reused if it has that torch already],
# TORCH_INDEX_URL [https://download.pytorch.org/whl/cpu, where the CPU builds are; empty: pip's configured index
# only], PYTHON [python3].
set -euo pipefail
version=${1:?usage: scripts/test_torch_version.sh TORCH_VERSION [pytest args]}
shift
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${VENV:-$root/.venv-torch$version}
index=${TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}
if ! "$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$version')" 2>/dev/null; then
  "${PYTHON:-python3}" -m venv "$venv"
  # PIP_CONSTRAINT=/dev/null: a machine-wide pip constraint (some images cap torch) must not pin the version asked for
  PIP_CONSTRAINT=/dev/null "$venv/bin/pip" install -q "torch==$version" ${index:+--extra-index-url "$index"}
  PIP_CONSTRAINT=/dev/null "$venv/bin/pip" install -q -e "$root[test,demo,hf]" "torch==$version"
fi
"$venv/bin/python" -c "import torch, deepspeed; print(f'torch {torch.__version__}, DeepSpeed {deepspeed.__version__}')"
cd "$root"
if [ $# -eq 0 ]; then set -- tests; fi
# -m "": every tier (pytest.ini's default is the fast one), unless the arguments give their own -m
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} exec "$venv/bin/python" -m pytest -q -m "" "$@"
