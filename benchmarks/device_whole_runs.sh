#!/usr/bin/env bash
# Whole runs (benchmarks/results/whole_runs/README.md) on one GPU, across several device calls of one lease: `start`
# checks the corpus archive, copies the tree to /tmp/wr (so that later calls, which re-send the working tree, cannot
# change the code the runs use), installs the carried wheelhouse and builds the LoCo kernels there, times the
# simulator's yardstick (one 10.8M model's plain step on the same global batch) compiled and eager, then launches
# the stage's runs in a process session of their own (setsid: they outlive the call while the machine is held) and
# watches them; `watch SECONDS` only watches. Both copy what has finished to $OUT: runs.jsonl, the launcher's log,
# the runs' logs as one archive, the yardsticks.
# Usage (repository root on the GPU machine; carry .whl and the stage's corpus archive):
#   [STAGE=A|B|C] bash benchmarks/device_whole_runs.sh start 560   # the first call: set-up, yardsticks, launch, watch
#   bash benchmarks/device_whole_runs.sh watch 580                   # each later call of the same lease
#   [STAGE=...] bash benchmarks/device_whole_runs.sh again 555       # start on the tree and build start left in
#                                                                    # /tmp/wr (no copy, no set-up): after LAUNCH=0
# STAGE (default A), as the study's plan fixes each:
#   A: the 10.8M model at 1024 sequences, full, plain 4/4 and LoCo 4/4 from step 1 (.corpus_large.tar.xz). TAG,
#      SEEDS (or SEEDS_FIRST and SEEDS_LATER), ARMS_FIRST, ARMS_LATER, STEPS, BATCH: its two matrices (plain and
#      LoCo of every seed, then full; an empty one is left out); EXTRA_MATRIX: one more matrix
#      (TAG:STEPS:SEEDS:ARMS:SETTINGS), after them.
#   B: 4096 sequences, per seed (SEEDS, default 0,1,2) a full and a LoCo 4/4 trunk saved after step 100 and their
#      branches over steps 101-400 (.corpus_xl.tar.xz); a branch starts once its trunk's state is written.
#   C: the 116M model at 64 sequences, full, plain 4/4 and LoCo 4/4 (SEEDS, default 0,1,2) from step 1, eager
#      (.corpus_large.tar.xz), in A's order and with its ARMS_/SEEDS_ variables; no yardsticks.
#   L: the lean error states (benchmarks/results/lean_error_state/README.md): the 10.8M model at 64 sequences on the
#      bundled plays (.corpus/, a folder): the four 2/2 arms seed by seed (SEEDS, default "0 1 2 3 4"), then the
#      8/2 + Hadamard pair seed by seed, then the zeroed-at-500 runs (SEEDS_ZERO); PARTS (default "two eight
#      zero") picks which of the three this lease launches.
# KERNEL_TIMING=1 (stage L's default; 0 for the others): first the kernels' timing on the quiet GPU
# (benchmarks/kernels.py at the largest shape, 4/4 and 8/2: int4/int8 errors, the exact own block; into $OUT).
# PROFILE=1: then Nsight Compute on hop 1, LoCo with int8 and int4 errors and plain as a control
# (benchmarks/device_profile_hop1.sh, into $OUT; about 150 s).
# KERNEL_VARIANTS="-DA=1;-DB=2 -DC=3": the same timing also builds the kernels with each ';'-separated set of nvcc
# flags, checks each build against the default one bit for bit and times its LoCo rows (kernels.py --variant;
# about 3.5 minutes a set).
#   L7: item 7 of that study: the 116M model at 2/2 in stage C's window (.corpus_large.tar.xz), plain and LoCo 2/2
#      (SEEDS, default 0,1,2; L7_BASE=0 leaves them out), and LoCo 2/2 with LEAN's settings (e.g. error_bits=4) where
#      LEAN is set.
# CUDA_TESTS=1: first the CUDA tests on the quiet GPU (the ops, the reducer on CUDA, the host copy; into $OUT).
# ENGINE_MEMORY=1: then benchmarks/engine_error_memory.py (the real engine's error memory and peak for every error
# option against the formula: 8 ranks share the GPU, the 116M model; into $OUT; a few minutes).
# LAUNCH=0: stop after those checks and timings (no runs); a later call's `again` launches them.
# MONITOR=1: first benchmarks/monitor_overhead.py on the quiet GPU (116M, 5 rounds, with profiles; into $OUT), at
# MONITOR_MICRO sequences a step (default 16; 64 makes the device, not the host, bound the step).
# COMPILE=0 forces eager; PAR: the most runs side by side (default 6; stage A: fewer where RUN_SECONDS, the lease's
# seconds left after the launch, would not let them finish).
set -uo pipefail
mode=${1:?start or watch}
seconds=${2:-560}
OUT=${OUT:-device_out}
W=/tmp/wr_out
mkdir -p "$OUT" "$W"
began=$(date +%s)

collect() {  # what has finished, into $OUT (a call brings back at most 8 files)
    cp -f "$W"/runs.jsonl "$W"/launch.log "$W"/baseline.jsonl "$OUT"/ 2>/dev/null
    [ -d "$W/logs" ] && tar czf "$OUT/logs.tar.gz" -C "$W" logs
    echo "runs finished: $(cat "$W/runs.jsonl" 2>/dev/null | wc -l)"
}

watch() {  # every 60 s: the furthest step each running run reached; stops once the launcher has ended (looked at
    # every 5 s, so that a lease's idle seconds are few) or after $1 seconds of this call (never later: a call that
    # runs past its limit brings nothing back)
    local left done_=0
    while left=$(( $1 - ($(date +%s) - began) )); [ "$left" -gt 0 ] && [ "$done_" = 0 ]; do
        for _ in $(seq 12); do
            grep -q "^launch:" "$W/launch.log" 2>/dev/null && { done_=1; break; }
            left=$(( $1 - ($(date +%s) - began) )); [ "$left" -gt 0 ] || break
            sleep $(( left < 5 ? left : 5 ))
        done
        echo "--- $(( $(date +%s) - began )) s: $(cat "$W/runs.jsonl" 2>/dev/null | wc -l) finished"
        for log in "$W"/logs/*.log; do
            [ -e "$log" ] && echo "$(basename "$log" .log): $(grep -o 'step [0-9]*/[0-9]* val [0-9.]*' "$log" | tail -1)"
        done
    done
    nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv,noheader
    collect
}

if [ "$mode" = start ] || [ "$mode" = again ]; then
    stage=${STAGE:-A}
    # a stage's runs pool over leases only on the same text: the archive its first runs read, unless CORPUS_SHA256
    # names another (the study's README); checked before the set-up starts a build
    case $stage in
        A|C|L7) corpus=.corpus_large want=8574aa051dbae1500cc490d4ef140b5fb7277b78b33d909665e16b711d17cc5b ;;
        B) corpus=.corpus_xl want=863d311bb60313cdc9f320831272a3b7540e4afed02f6f4eb51b4323695d3a16 ;;
        L) corpus=.corpus want= ;;  # the bundled plays as a folder (the regime map's text), no archive
        *) echo "STAGE=$stage: it must be A, B, C, L or L7"; exit 1 ;;
    esac
    if [ -n "$want" ]; then
        want=${CORPUS_SHA256:-$want}
        have=$(sha256sum "$corpus.tar.xz" | cut -d' ' -f1)
        [ "$have" = "$want" ] || { echo "$corpus.tar.xz is $have, not the study's $want: not launched"; exit 1; }
    else
        [ -d "$corpus" ] || { echo "$corpus/ is missing (carry it): not launched"; exit 1; }
    fi
    if [ "$mode" = start ]; then
        rm -rf /tmp/wr && mkdir -p /tmp/wr && cp -a . /tmp/wr/ && cd /tmp/wr || exit 1
        # shellcheck source=benchmarks/device_setup.sh
        SETUP_BUILD=background source benchmarks/device_setup.sh "$OUT/setup_logs"  # overlaps the yardsticks
        [ -z "$want" ] || { mkdir -p "$corpus" && tar xJf "$corpus.tar.xz" -C "$corpus"; } || exit 1
    else  # again: the tree, wheels, build and corpus an earlier `start` of this lease left
        cd /tmp/wr 2>/dev/null && [ -d /tmp/site ] || { echo "again: no /tmp/wr from a start of this lease"; exit 1; }
        export PYTHONPATH=/tmp/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1
        kernels_ready() { :; }
    fi
    export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True TORCHINDUCTOR_COMPILE_THREADS=4
    [ "$stage" = B ] && BATCH=4096
    BATCH=${BATCH:-1024}
    micro=$(( BATCH / 16 ))
    lr=$(python3 -c "print(f'{2e-3 / (1 + 64 / $BATCH):.5g}')")  # the batch axis's rule: McCandlish et al. 2018
    steps=${STEPS:-1000}
    compile=""
    par=${PAR:-6}
    if [ "$stage" = A ] || [ "$stage" = B ]; then
        common="--size medium --text $corpus --nodes 2 --local 8 --micro-batch $micro --lr $lr"
        compile=inductor
        # the compiled yardstick first: it also fills the inductor cache with the graph every run compiles
        if [ "${COMPILE:-1}" = 0 ] || ! timeout 300 python3 benchmarks/convergence_sim.py baseline $common \
                --compile inductor --out "$W/baseline.jsonl"; then
            compile=""
        fi
        timeout 120 python3 benchmarks/convergence_sim.py baseline $common --out "$W/baseline.jsonl"
        if [ -n "$compile" ]; then  # compiled only where it is faster than eager
            compile=$(python3 -c "
import json; b = [json.loads(l) for l in open('$W/baseline.jsonl')]
c = [r['ms_per_step'] for r in b if r['compile']]; e = [r['ms_per_step'] for r in b if not r['compile']]
print('inductor' if c and e and c[-1] < e[-1] else '')")
        fi
        echo "runs compile: '${compile:-eager}'"
    fi
    if [ "$stage" = A ]; then
        # side by side: as many as can finish in RUN_SECONDS (the lease's time left after the launch), from the chosen
        # yardstick at 1.15x (the simulator's measured overhead), an even number (plain and LoCo of a seed), 2 to PAR
        par=$(python3 -c "
import json, math; b = [json.loads(l) for l in open('$W/baseline.jsonl')]
ms = min(r['ms_per_step'] for r in b if bool(r['compile']) == bool('$compile'))
n = int(${RUN_SECONDS:-100000} / ($steps * 1.15 * ms / 1000)); print(max(2, min(${PAR:-6}, n - n % 2)))")
    fi
    kernels_ready
    if [ "${CUDA_TESTS:-0}" = 1 ]; then  # the kernels against the reference, on the quiet GPU
        timeout 300 python3 -m pytest -q -m "" -p no:cacheprovider tests/unit/ops \
            tests/unit/runtime/comm/test_loco_reduce_cuda.py tests/unit/utils/test_host_copy.py \
            >"$OUT/cuda_tests.log" 2>&1
        echo "CUDA tests exit $?"; tail -3 "$OUT/cuda_tests.log"
    fi
    if [ "${KERNEL_TIMING:-$([ "$stage" = L ] && echo 1 || echo 0)}" = 1 ]; then  # the kernels' timing, quiet GPU
        variants=()
        IFS=';' read -ra flag_sets <<< "${KERNEL_VARIANTS:-}"
        for flags in "${flag_sets[@]}"; do variants+=("--variant=$flags"); done
        timeout $(( 150 + 210 * ${#flag_sets[@]} )) python3 benchmarks/kernels.py --configs 4/4 8/2 --no-baseline \
            --largest-only --reps 30 "${variants[@]}" --json "$OUT/kernels.json" >"$OUT/kernels.txt" 2>&1
        echo "kernels.py exit $?"; sed -n '/int4 \/ int8/,$p' "$OUT/kernels.txt"
    fi
    if [ "${PROFILE:-0}" = 1 ]; then  # the profile of hop 1 on the quiet GPU
        SETUP_DONE=1 bash benchmarks/device_profile_hop1.sh
    fi
    if [ "${ENGINE_MEMORY:-0}" = 1 ]; then  # issue 56 item 4: the real engine's error memory per option
        timeout 420 python3 benchmarks/engine_error_memory.py --table "$OUT/engine_memory.txt" \
            >"$OUT/engine_memory_log.txt" 2>&1
        echo "engine_error_memory.py exit $?"; cat "$OUT/engine_memory.txt" 2>/dev/null
    fi
    if [ "${MONITOR:-0}" = 1 ]; then  # issue 58's whole-step overhead on the quiet GPU, before the runs start
        timeout 240 python3 benchmarks/monitor_overhead.py --size 125m --micro-batch "${MONITOR_MICRO:-16}" \
            --rounds 5 --count-ops \
            --table "$OUT/monitor_table.txt" --profile "$OUT/monitor_profile.txt" >"$OUT/monitor_log.txt" 2>&1
        echo "monitor_overhead.py exit $?"; cat "$OUT/monitor_table.txt" 2>/dev/null
    fi
    [ "${LAUNCH:-1}" = 0 ] && { echo "LAUNCH=0: no runs"; exit 0; }
    echo "side by side: $par"
    # what every stage's runs share: the layout, the text, the evaluation, the grid, the streamed nodes
    every="text=$corpus,nodes=2,local=8,warmup=$(( steps / 10 )),eval_every=50,eval_windows=1024,quant_grid=auto"
    every="$every,stream_nodes=1"
    S="size=medium,$every,micro_batch=$micro,lr=$lr,grad_mode=loop${compile:+,compile=$compile}"
    matrices=()
    plain_and_loco_then_full() {  # TAG SEEDS SETTINGS: plain 4/4 and LoCo 4/4 of every seed first, the full runs after
        # them (a lease cut short still has LoCo - plain on every seed); ARMS_FIRST, ARMS_LATER, SEEDS_FIRST and
        # SEEDS_LATER change the two matrices, an empty one is left out
        local first=${ARMS_FIRST-plain4,loco4} later=${ARMS_LATER-full}
        [ -n "$first" ] && matrices+=(--matrix "$1:$steps:${SEEDS_FIRST:-$2}:$first:$3")
        [ -n "$later" ] && matrices+=(--matrix "$1:$steps:${SEEDS_LATER:-$2}:$later:$3")
    }
    case $stage in
        A)
            plain_and_loco_then_full "${TAG:-wr16_b$BATCH}" "${SEEDS:-0,1,2,3,4}" "$S"
            [ -n "${EXTRA_MATRIX:-}" ] && matrices+=(--matrix "$EXTRA_MATRIX") ;;  # another stage's runs, after these
        B)
            seeds=${SEEDS:-0,1,2}
            matrices+=(--matrix "lbF_b4096:$steps:$seeds:full:$S,save_at=100,stop_at=400"
                       --matrix "lbL_b4096:$steps:$seeds:loco4:$S,save_at=100,stop_at=400"
                       --matrix "lbF_b4096:$steps:$seeds:plain4,loco4:$S,resume_from=100,stop_at=400"
                       --matrix "lbL_b4096:$steps:$seeds:plain4:$S,resume_from=100,stop_at=400") ;;
        C)
            plain_and_loco_then_full m125_s1000 "${SEEDS:-0,1,2}" "size=125m,$every,micro_batch=4,lr=0.001" ;;
        L)  # benchmarks/results/lean_error_state/README.md: the map's 1000-step W = 16 regime, seed by seed; PARTS
            # (default "two eight zero"): which of its three parts this lease launches, in that order
            M="size=medium,text=$corpus,quant_grid=auto,nodes=2,local=8,micro_batch=4,warmup=100,eval_every=100"
            parts=" ${PARTS:-two eight zero} "
            for seed in ${SEEDS:-0 1 2 3 4}; do  # two: the 2/2 options, seed by seed
                [[ $parts == *" two "* ]] || break
                matrices+=(--matrix "le_base:$steps:$seed:plain2,loco2:$M"
                           --matrix "le_e4:$steps:$seed:loco2:$M,error_bits=4"
                           --matrix "le_inter:$steps:$seed:loco2:$M,error_feedback=inter_node")
            done
            for seed in ${SEEDS:-0 1 2 3 4}; do  # eight: the 8/2 + Hadamard pair
                [[ $parts == *" eight "* ]] || break
                matrices+=(--matrix "le_base:$steps:$seed:plain8-2h:$M"
                           --matrix "le_inter:$steps:$seed:loco8-2h:$M,error_feedback=inter_node")
            done
            [[ $parts == *" zero "* ]] && matrices+=(--matrix "le_zero500:$steps:${SEEDS_ZERO:-0,1,2,3,4}:loco2:$M,zero_errors_at=500")
            [ ${#matrices[@]} -gt 0 ] || { echo "PARTS=$PARTS: name one or more of two, eight, zero"; exit 1; } ;;
        L7)  # item 7 of the same study: the 116M model at 2/2 in stage C's window; LEAN: the lean arm's settings
            S7="size=125m,$every,micro_batch=4,lr=0.001"
            [ "${L7_BASE:-1}" = 1 ] && matrices+=(--matrix "le116:$steps:${SEEDS:-0,1,2}:plain2,loco2:$S7")
            [ -n "${LEAN:-}" ] && matrices+=(--matrix "le116_lean:$steps:${SEEDS:-0,1,2}:loco2:$S7,$LEAN") ;;
    esac
    setsid nohup python3 benchmarks/convergence_sim.py launch --parallel "$par" --budget 100000 \
        --out "$W/runs.jsonl" --logs "$W/logs" "${matrices[@]}" >"$W/launch.log" 2>&1 </dev/null &
    echo "launched at $(( $(date +%s) - began )) s"
fi
watch "$seconds"
