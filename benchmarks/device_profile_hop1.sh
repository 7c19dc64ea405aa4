#!/usr/bin/env bash
# Nsight Compute on hop 1 (16384^2 bf16, 4/4: LoCo with int8 and int4 errors, two launches each, and plain hop 1 once,
# the kernel at copy bandwidth, as a control) on the GPU machine:
#   export OUT; bash benchmarks/device_profile_hop1.sh
# (PROFILE=1 of benchmarks/device_whole_runs.sh runs it after its own set-up, with SETUP_DONE=1: no second set-up.)
# Into $OUT: ncu_hop1.txt (speed of light, occupancy, warp states, scheduler, memory workload (L1, L2 and DRAM traffic
# by kind) and instruction statistics per launch)
# and ncu_hop1_source.txt (executed warp instructions by opcode and the hottest SASS lines, benchmarks/sass_summary.py).
set -uo pipefail
[ "${SETUP_DONE:-0}" = 1 ] || source benchmarks/device_setup.sh "$OUT/setup"
# hop1_kernel<bf16, 4 bits, no (0), int4 (1) or int8 (2) errors, no rotation, unmeasured, no own block> as mangled
kernels='regex:.*hop1_kernelILi2ELi4ELNS_12ErrorStorageE[012]ELb0ELb0ELb0E.*'
# the matching launches in order (kernels.py --profile-hop1): the int8, plain and int4 buckets' set-up launches, then
# int8 twice, plain once and int4 twice (the rotated bucket's launches do not match)
timeout 150 ncu --clock-control none --kernel-name-base mangled --kernel-name "$kernels" \
    --launch-skip 3 --launch-count 5 --section SpeedOfLight --section Occupancy --section WarpStateStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
    --section InstructionStats --section SourceCounters -o /tmp/ncu_hop1 \
    python3 benchmarks/kernels.py --profile-hop1 >"$OUT/ncu_run.log" 2>&1
echo "ncu exit $?"
ncu -i /tmp/ncu_hop1.ncu-rep >"$OUT/ncu_hop1.txt" 2>&1
ncu -i /tmp/ncu_hop1.ncu-rep --page source --csv --print-source sass >/tmp/ncu_hop1_source.csv 2>&1
python3 benchmarks/sass_summary.py --ncu-source /tmp/ncu_hop1_source.csv >"$OUT/ncu_hop1_source.txt" 2>&1
echo "ncu: $(grep -c "hop1_kernel" "$OUT/ncu_hop1.txt") kernel lines"
grep -E "Duration|Executed Ipc|Issue Slots Busy|Achieved Occupancy|Registers Per|DRAM Throughput|L2 Cache Throughput" \
    "$OUT/ncu_hop1.txt" | head -40
