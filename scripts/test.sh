#!/usr/bin/env bash
# The test command: sets up the environment if needed, then runs the whole CPU suite.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/scripts/ensure_env.sh"
cd "$root"
exec python3 -m pytest -q -m "" tests "$@"  # -m "": every tier (pytest.ini's default is the fast one)
