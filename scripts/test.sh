#!/usr/bin/env bash
# The test command: installs what is missing (scripts/ensure_env.sh test,demo,hf: never deepspeed-loco itself), then
# runs the CPU suite on the checkout's code: the whole of it (pytest.ini's testpaths), or the pytest arguments given.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/scripts/ensure_env.sh" test,demo,hf
cd "$root"
export PYTHONPATH="$root:$root/scripts/pytest_plugins${PYTHONPATH:+:$PYTHONPATH}"
# -m "": every tier (pytest.ini's default is the fast one); -p skip_reasons: a line counting the skips by reason
exec python3 -m pytest -q -m "" -p skip_reasons "$@"
