#!/usr/bin/env bash
# Builds .whl/, the wheels a GPU machine without a package index needs to run this project's device scripts:
# DeepSpeed (built here from its sdist, pure Python; it JIT-compiles its CUDA ops on the GPU machine) and the
# pure-Python or manylinux packages DeepSpeed needs beyond a CUDA build of torch (pydantic, hjson).
# Usage (repository root): bash benchmarks/device_wheelhouse.sh [deepspeed version, default 0.19.8] [python, default 3.12]
# Then on the GPU machine: python3 -m pip install --no-index --no-deps --target /tmp/site .whl/*.whl and
# PYTHONPATH=/tmp/site (benchmarks/device_*.sh do this).
set -euo pipefail
version=${1:-0.19.8}
python_version=${2:-3.12}
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mkdir -p .whl
sdist=$(mktemp -d)
trap 'rm -rf "$sdist"' EXIT
python3 -m pip download -q --no-deps --no-binary :all: -d "$sdist" "deepspeed==$version"
python3 -m pip wheel -q --no-deps --no-build-isolation -w .whl "$sdist"/deepspeed-"$version".tar.gz
python3 -m pip download -q --only-binary=:all: --python-version "$python_version" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl hjson pydantic
ls -1 .whl
