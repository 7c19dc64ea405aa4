#!/usr/bin/env bash
# One device call of the batch-axis study (benchmarks/results/batch_axis/README.md): the 10.8M model at W = 16
# (2 x 8; NODES and LOCAL set another shape) with full precision, plain 4/4 and LoCo 4/4 at the global batches in
# BATCHES (sequences of 256 bytes), seeds 0-2, STEPS steps, the learning rate of the study's rule, on the large
# corpus; then one model's plain step at the largest batch (the simulator's yardstick). Carry .whl/
# (benchmarks/device_wheelhouse.sh) and .corpus_large.tar.xz (benchmarks/corpus/README.md). ARMS: the arms (default
# full,plain4,loco4); SOLO=0 skips the solo run (3 steps of the last arm alone at the largest batch: step time and
# peak memory without neighbours); BASELINE=0 skips the yardstick. TAG: the tags' prefix (default ba<W>, so
# ba16_b<batch> at 2 x 8); SEEDS (default 0,1,2); EXTRA: more matrix settings, later ones win (a branched study's
# trunk: save_at=K, its branches: resume_from=K; the states stay in .branch_states/ on the machine between calls; a
# branch on another shape names its trunk's tag prefix in TRUNK, e.g. NODES=8 TRUNK=ba16br: the state of
# ba16br_b<batch>). LAUNCH_BUDGET: the launcher's --budget (seconds from the first launch, after which runs still
# going are stopped: set it above the runs' time); PAR: runs side by side.
# Usage (repository root, on the GPU machine):
#   BATCHES="4096 1024" STEPS=80 LAUNCH_BUDGET=400 PAR=3 OUT=$OUT bash benchmarks/device_batch_axis.sh
#   TAG=ba16br ARMS=full EXTRA=save_at=100,eval_every=20 SOLO=0 BASELINE=0 BATCHES=4096 STEPS=160 ... (trunk)
#   TAG=ba16br ARMS=plain4,loco4 EXTRA=resume_from=100,eval_every=20 SOLO=0 BASELINE=0 BATCHES=4096 STEPS=160 ...
set -o pipefail
OUT=${OUT:-device_out}
BATCHES=${BATCHES:-4096 1024}
STEPS=${STEPS:-80}
ARMS=${ARMS:-full,plain4,loco4}
mkdir -p "$OUT" .corpus_large
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
tar xJf .corpus_large.tar.xz -C .corpus_large && echo "corpus files: $(ls .corpus_large | wc -l)"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
lr_for() {  # lr(B) = 2e-3 / (1 + 64 / B): McCandlish et al. 2018, eq. 2.7, with B_noise = 64 and lr(64) = 1e-3
    python3 -c "print(f'{2e-3 / (1 + 64 / $1):.5g}')"
}
NODES=${NODES:-2}
LOCAL=${LOCAL:-8}
W=$(( NODES * LOCAL ))
warmup=$(( STEPS / 10 ))
B="size=medium,text=.corpus_large,nodes=$NODES,local=$LOCAL,warmup=$warmup,eval_every=$(( STEPS / 4 )),quant_grid=auto,stream_nodes=1"
matrices=()
for batch in $BATCHES; do
    mode=loop; [ $(( batch / W )) -lt 16 ] && mode=vmap  # one rank's pass fills the GPU from 16 sequences on
    trunk=${TRUNK:+,trunk_tag=${TRUNK}_b$batch}
    matrices+=(--matrix "${TAG:-ba$W}_b$batch:$STEPS:${SEEDS:-0,1,2}:$ARMS:$B,micro_batch=$(( batch / W )),lr=$(lr_for "$batch"),grad_mode=$mode$trunk${EXTRA:+,$EXTRA}")
done
largest=$(echo "$BATCHES" | tr ' ' '\n' | sort -n | tail -1)
T="--size medium --text .corpus_large --nodes $NODES --local $LOCAL --micro-batch $(( largest / W )) --stream-nodes 1 --arm ${ARMS##*,}"
solo="$T --grad-mode loop --steps 3 --eval-every 3 --eval-windows 16"; [ "${SOLO:-1}" = 0 ] && solo=""
SOLO="$solo" BUDGET_S=${LAUNCH_BUDGET:-400} PARALLEL=${PAR:-3} \
    PROBE=0 OUT=$OUT bash benchmarks/device_convergence_sim.sh "${matrices[@]}" 2>&1 | tee -a "$OUT/log"
[ "${BASELINE:-1}" = 0 ] || PYTHONPATH=/tmp/site:$PWD timeout 60 python3 benchmarks/convergence_sim.py baseline --size medium --text .corpus_large \
    --nodes $NODES --local $LOCAL --micro-batch $(( largest / W )) --out "$OUT/baseline.jsonl" 2>&1 | tail -1
