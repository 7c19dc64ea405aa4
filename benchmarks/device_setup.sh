# Sourced by the benchmarks/device_*.sh scripts on the GPU machine (repository root): installs the carried
# wheelhouse (.whl/, from benchmarks/device_wheelhouse.sh) into /tmp/site, exports the environment the runs need
# and builds the LoCo CUDA kernels once; logs go to "$1" (pip.log, build.log). Prints the seconds it took; on a
# failure it prints the log's tail and exits the calling script.
setup_logs=$1
mkdir -p "$setup_logs"
setup_start=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >"$setup_logs/pip.log" 2>&1 \
    || { tail -20 "$setup_logs/pip.log"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1  # DeepSpeed 0.19.8 cannot parse "9.0a"
python3 -c "from deepspeed_loco.ops import loco_cuda; loco_cuda.load()" >"$setup_logs/build.log" 2>&1 \
    || { tail -30 "$setup_logs/build.log"; exit 1; }
echo "wheels + kernel build: $(( $(date +%s) - setup_start )) s"
