# Sourced by the benchmarks/device_*.sh scripts on the GPU machine (repository root): installs the carried
# wheelhouse (.whl/, from benchmarks/device_wheelhouse.sh) into /tmp/site, exports the environment the runs need
# and builds the LoCo CUDA kernels once. Prints the seconds it took. Its logs (pip.log, build.log) stay in
# /tmp/device_setup (a device call brings back only a few files from $OUT); on a failure they are copied to "$1",
# their tail is printed and the calling script exits.
setup_logs=$1
setup_start=$(date +%s)
setup_failed() {  # $1: the log that failed
    mkdir -p "$setup_logs" && cp /tmp/device_setup/*.log "$setup_logs/"
    tail -30 "/tmp/device_setup/$1"
    exit 1
}
mkdir -p /tmp/device_setup
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    >/tmp/device_setup/pip.log 2>&1 || setup_failed pip.log
export PYTHONPATH=/tmp/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1  # DeepSpeed 0.19.8 cannot parse "9.0a"
python3 -c "from deepspeed_loco.ops import loco_cuda; loco_cuda.load()" >/tmp/device_setup/build.log 2>&1 \
    || setup_failed build.log
echo "wheels + kernel build: $(( $(date +%s) - setup_start )) s"
