#!/usr/bin/env bash
# Installs into the current python3 what this checkout's code needs and is missing, and nothing else: the
# requirements of setup.py's core and of the extras named in $1 (a comma list, e.g. demo or test,demo,hf) that are
# not satisfied (scripts/missing_requirements.py); pip is not called when none are missing. torch, where there is
# none, is torch 2.13.0's CPU build (a GPU machine installs its CUDA build first); a torch too old for setup.py is
# an error, never replaced.
# It never installs, replaces or upgrades deepspeed-loco itself: the commands run the checkout's own code (PYTHONPATH),
# whether deepspeed-loco is installed or not, normally or editable, from here or from elsewhere.
#
# Environment: PYTHON [python3]; TORCH_INDEX_URL [https://download.pytorch.org/whl/cpu, where the CPU builds are;
# empty: pip's configured index only, where torch==2.13.0 is the CUDA build unless a local CPU wheel is configured].
set -euo pipefail
extras=${1:?usage: scripts/ensure_env.sh EXTRAS (a comma list of setup.py extras, e.g. demo or test,demo,hf)}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=${PYTHON:-python3}
index=${TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}
missing=$("$py" "$root/scripts/missing_requirements.py" "$extras")
torch_wanted=$(grep -E '^torch([<>=!~ ;]|$)' <<<"$missing" || true)
if [ -n "$torch_wanted" ]; then
  if installed=$("$py" -c "from importlib import metadata; print(metadata.version('torch'))" 2>/dev/null); then
    echo "deepspeed-loco: torch $installed is installed and this checkout needs $torch_wanted: install a newer torch" \
         "yourself (without a GPU: pip install torch==2.13.0 --index-url $index)" >&2
    exit 1
  fi
  echo "deepspeed-loco: no torch in $("$py" -c 'import sys; print(sys.prefix)'): installing torch 2.13.0 (CPU build)" >&2
  # torch alone from the CPU index (pip would otherwise ask that index for each of torch's requirements too), then
  # its requirements from pip's own index
  "$py" -m pip install -q --no-deps "torch==2.13.0" ${index:+--extra-index-url "$index"}
  "$py" -m pip install -q "torch==2.13.0"
fi
rest=$(grep -vE '^torch([<>=!~ ;]|$)' <<<"$missing" || true)
if [ -n "$rest" ]; then
  echo "deepspeed-loco: installing what is missing: $(echo $rest)" >&2
  # shellcheck disable=SC2086  # one requirement a word
  "$py" -m pip install -q $rest
fi
