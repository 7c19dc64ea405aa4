"""One rank of a short gloo job shaped like ZeRO-3's communication at its end: all-gathers into views of a flat
buffer and all-reduces on the world group and on a subgroup that stays referenced until exit, as DeepSpeed's and
LoCo's subgroups do. ``python exit_job.py register|none [destroy]`` (``destroy``: the script ends with its own
``destroy_process_group()``, which leaves the subgroup alive); the rank and world come from the usual environment
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``). Run by tests/unit/utils/test_clean_exit.py and
scripts/exit_sweep.sh."""
import sys

import torch
import torch.distributed as dist

from deepspeed_loco.utils import clean_exit

if sys.argv[1] == "register":
    clean_exit.register()
torch.set_num_threads(1)
dist.init_process_group("gloo")
world = dist.get_world_size()
subgroup = dist.new_group(list(range(world)))
x = torch.randn(1 << 14)
for step in range(20):
    out = torch.empty(world * x.numel())
    dist.all_gather_into_tensor(out, x, group=subgroup if step % 2 else None, async_op=True).wait()
    dist.all_reduce(x)
if sys.argv[2:] == ["destroy"]:
    dist.destroy_process_group()
