#!/usr/bin/env bash
# Nsight Compute on LoCo hop 1 (16384^2 bf16, 4/4, int8 and int4 errors, two launches each) on the GPU machine:
#   export OUT; bash benchmarks/device_profile_hop1.sh
# (PROFILE=1 of benchmarks/device_whole_runs.sh runs it after its own set-up, with SETUP_DONE=1: no second set-up.)
# Into $OUT: ncu_hop1.txt (speed of light, occupancy, warp states, scheduler and instruction statistics per launch)
# and ncu_hop1_source.txt (executed warp instructions by opcode and the hottest SASS lines, benchmarks/sass_summary.py).
set -uo pipefail
[ "${SETUP_DONE:-0}" = 1 ] || source benchmarks/device_setup.sh "$OUT/setup"
# hop1_kernel<bf16, 4 bits, int4 (1) or int8 (2) errors, no rotation, unmeasured, no own block> as mangled
kernels='regex:.*hop1_kernelILi2ELi4ELNS_12ErrorStorageE[12]ELb0ELb0ELb0E.*'
# the matching launches in order: the int8 and the int4 bucket's set-up launch, then int8 twice and int4 twice
timeout 150 ncu --clock-control none --kernel-name-base mangled --kernel-name "$kernels" \
    --launch-skip 2 --launch-count 4 --section SpeedOfLight --section Occupancy --section WarpStateStats \
    --section SchedulerStats \
    --section InstructionStats --section SourceCounters -o /tmp/ncu_hop1 \
    python3 benchmarks/kernels.py --profile-hop1 >"$OUT/ncu_run.log" 2>&1
echo "ncu exit $?"
ncu -i /tmp/ncu_hop1.ncu-rep >"$OUT/ncu_hop1.txt" 2>&1
ncu -i /tmp/ncu_hop1.ncu-rep --page source --csv --print-source sass >/tmp/ncu_hop1_source.csv 2>&1
python3 benchmarks/sass_summary.py --ncu-source /tmp/ncu_hop1_source.csv >"$OUT/ncu_hop1_source.txt" 2>&1
echo "ncu: $(grep -c "hop1_kernel" "$OUT/ncu_hop1.txt") kernel lines"
grep -E "Duration|Executed Ipc|Issue Slots Busy|Achieved Occupancy|Registers Per|DRAM Throughput" "$OUT/ncu_hop1.txt" \
    | head -40
