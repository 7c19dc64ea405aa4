"""examples/README.md's command for ``examples/train_loco.py``, run for 3 steps: LoCo attaches with the layout the
README says, and the lines whose figures do not depend on the CPU (bytes sent, error-buffer memory) are the
README's own."""
import os
import subprocess
import sys

import pytest
from torch.distributed.elastic.utils.distributed import get_free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(REPO, "examples")


@pytest.mark.slow
def test_train_loco_runs_as_the_examples_readme_says():
    env = dict(os.environ, DS_ACCELERATOR="cpu", LOCAL_SIZE="4", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    for name in ("LOCAL_WORLD_SIZE", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port",
                           str(get_free_port()), os.path.join(EXAMPLES, "train_loco.py"), "--steps", "3"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    with open(os.path.join(EXAMPLES, "README.md")) as f:
        readme = f.read()
    active = next(line for line in output.splitlines() if "deepspeed-loco active" in line)
    assert "W=4 (M=2 nodes x L=2 ranks); bits intra/inter 2/2, group 256, grid midrise" in active
    assert "W=4 (M=2 nodes x L=2 ranks); bits intra/inter 2/2, group 256, grid midrise" in readme
    assert not any("in the measurements (" in line for line in output.splitlines())  # the findings agree: no note
    first = next(line for line in done.stdout.splitlines() if line.startswith("step    0"))
    loss, sent = first.split("loss ")[1].split()[0], first.split("so far ")[1]
    assert round(float(loss), 1) == 5.6 and "step    0  loss 5.6" in readme  # near ln 256, as the README says
    assert f"gradient bytes sent by this rank so far {sent}" in readme  # a step's bytes: sizes, not floats
    buffers = next(line for line in done.stdout.splitlines() if line.startswith("LoCo error buffers"))
    assert buffers in readme
