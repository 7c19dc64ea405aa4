"""Minimal training script with LoCo: ``deepspeed_loco.initialize`` in place of ``deepspeed.initialize``.

Trains the demo's small byte-level Llama-style model on the bundled plays (both from ``loco_lab``, the demo app
of this repository: run it from a checkout) with the config in ``ds_config_loco.json`` (ZeRO-3, 2-bit qgZ
gradients with LoCo error feedback, where the measurements say it pays for a model this small). Launch it like
any DeepSpeed script; for example 4 ranks on one CPU-only machine, pretending to be 2 nodes of 2 (``local_world_size: 2``
in the config):

    DS_ACCELERATOR=cpu LOCAL_SIZE=4 OMP_NUM_THREADS=1 \
        torchrun --nproc_per_node 4 examples/train_loco.py --steps 50

or on GPUs: ``deepspeed --num_gpus 8 examples/train_loco.py`` (drop ``local_world_size`` from the config on a
real multi-node job: LoCo then takes the launcher's ranks per node).
"""
import argparse
import os
import sys

import torch

import deepspeed
import deepspeed_loco

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # loco_lab, from the checkout
from loco_lab.data import ByteCorpus  # noqa: E402
from loco_lab.model import SIZES, ByteLlama  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--config", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                         "ds_config_loco.json"))
    parser.add_argument("--local_rank", type=int, default=-1)  # set by the deepspeed launcher
    args = parser.parse_args()

    on_gpu = torch.cuda.is_available()
    deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = ByteLlama(SIZES["small"])

    engine, _, _, _ = deepspeed_loco.initialize(model=model, model_parameters=model.parameters(), config=args.config)
    hook = deepspeed_loco.loco_hook(engine)  # None if the config has no zeropp_loco_param

    corpus = ByteCorpus()
    for step in range(args.steps):
        x, y = corpus.train_batch(step, seed=0, global_batch=engine.train_micro_batch_size_per_gpu() * world,
                                  seq_len=model.cfg.seq_len, rank=rank, world_size=world)
        loss = engine(x.to(engine.device), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            sent = hook.reducer.stats.total_bytes if hook else 0
            print(f"step {step:4d}  loss {loss.item():.4f}  gradient bytes sent by this rank so far {sent:,}",
                  flush=True)
    if rank == 0 and hook is not None:
        print(f"LoCo error buffers on this rank: {hook.state.memory_bytes() / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
