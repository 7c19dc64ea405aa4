#!/usr/bin/env bash
# Launches the short 2-rank gloo job of tests/unit/utils/exit_job.py N times (torchrun) and counts the launches that
# did not return 0: with deepspeed_loco's clean-exit hook (default) or without it (--no-hook, to see the abort at
# exit that docs/frameworks.md, "Clean exits", describes).
#
#   scripts/exit_sweep.sh 40            # expect 0 of 40
#   scripts/exit_sweep.sh 40 --no-hook  # torch 2.13 CPU: most of them abort (29 of 40 here)
set -uo pipefail
runs=${1:?usage: scripts/exit_sweep.sh N [--no-hook]}
mode=register
[ "${2:-}" = "--no-hook" ] && mode=none
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
failed=0
for i in $(seq "$runs"); do
  if ! OMP_NUM_THREADS=1 PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" python3 -m torch.distributed.run \
       --nproc_per_node 2 --master_port $((20000 + RANDOM % 20000)) "$root/tests/unit/utils/exit_job.py" "$mode" \
       > /tmp/exit_sweep_last.log 2>&1; then
    failed=$((failed + 1))
    grep -m1 -h "terminate called\|Error" /tmp/exit_sweep_last.log
  fi
done
echo "$failed of $runs launches did not return 0 ($mode)"
