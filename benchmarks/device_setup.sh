# Sourced by the benchmarks/device_*.sh scripts on the GPU machine (repository root): installs the carried
# wheelhouse (.whl/, from benchmarks/device_wheelhouse.sh) into /tmp/site, exports the environment the runs need
# and builds the LoCo CUDA kernels once (SETUP_BUILD=background: in the background; the caller then calls
# kernels_ready before a run needs them). Prints the seconds it took. Its logs (pip.log, build.log) stay in a fresh
# /tmp/device_setup.* folder of this call (a device call brings back only a few files from $OUT); on a failure they
# are copied to "$1", their tail is printed and the calling script exits.
setup_logs=$1
setup_start=$(date +%s)
setup_dir=$(mktemp -d /tmp/device_setup.XXXXXX)  # this call's own: no log of an earlier call is taken for its own
setup_failed() {  # $1: the log that failed
    mkdir -p "$setup_logs" && cp "$setup_dir"/*.log "$setup_logs/"
    tail -30 "$setup_dir/$1"
    exit 1
}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    >"$setup_dir/pip.log" 2>&1 || setup_failed pip.log
export PYTHONPATH=/tmp/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1  # DeepSpeed 0.19.8 cannot parse "9.0a"
build_kernels() { python3 -c "from deepspeed_loco.ops import loco_cuda; loco_cuda.load()" >"$setup_dir/build.log" 2>&1; }
if [ "${SETUP_BUILD:-now}" = background ]; then  # the caller overlaps the build and calls kernels_ready before using them
    build_kernels & kernels_pid=$!
    kernels_ready() {
        wait "$kernels_pid" || setup_failed build.log
        echo "kernel build (in the background) done at $(( $(date +%s) - setup_start )) s"
    }
else
    build_kernels || setup_failed build.log
    echo "wheels + kernel build: $(( $(date +%s) - setup_start )) s"
fi
