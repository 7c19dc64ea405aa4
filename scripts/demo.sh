#!/usr/bin/env bash
# The demo command: installs what is missing (scripts/ensure_env.sh demo: never deepspeed-loco itself), then trains a
# small byte-level LM on bundled Shakespeare with 4 simulated ranks (2 nodes x 2) three ways: full precision, plain
# 4-bit qgZ, 4-bit qgZ + LoCo. Flags are passed through (python3 -m loco_lab.cli demo --help); output goes to
# ./loco_demo_out.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/scripts/ensure_env.sh" demo
# the checkout's code (the library and loco_lab, the demo app, which is not installed) whatever is installed; the
# output goes under the caller's directory
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec python3 -m loco_lab.cli demo "$@"
