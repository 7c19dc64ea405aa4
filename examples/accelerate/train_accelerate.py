"""A tiny regression trained with Hugging Face Accelerate under DeepSpeed ZeRO-3 + qgZ through deepspeed-loco's reduce
(``zeropp_loco_param``; the config's 4/4 with ``error_feedback: false`` is the measured advice at 4 bits).

The one line LoCo needs is ``deepspeed_loco.install()`` before ``accelerator.prepare`` builds the DeepSpeed engine;
the DeepSpeed config (``ds_config_zero3_qgz_loco.json``, LoCo's section included) comes from Accelerate's config file
or from ``--ds-config``. From the repository root::

    accelerate launch --config_file examples/accelerate/accelerate_config.yaml examples/accelerate/train_accelerate.py
    torchrun --nproc_per_node 2 examples/accelerate/train_accelerate.py \
        --ds-config examples/accelerate/ds_config_zero3_qgz_loco.json

A script that cannot be edited runs the same way through the module runner instead of the line:
``accelerate launch --config_file ... -m deepspeed_loco.run train.py`` (``-m``: Accelerate's ``--module``).
Prints one JSON line on rank 0: the losses and what LoCo did (steps, reduces, bytes sent). On 2 CPU processes over
the 20 default steps (either command above), rank 0's loss is 0.86 at the first step, 1.00 averaged over the first
five (it rises to 1.47 at the second step before it falls) and 0.067 averaged over the last five;
tests/unit/test_frameworks.py runs the accelerate launch command and checks these three figures.
"""
import argparse
import json
import os

import torch

import deepspeed_loco

deepspeed_loco.install()  # stock deepspeed.initialize (hence accelerator.prepare) now accepts zeropp_loco_param

HERE = os.path.dirname(os.path.abspath(__file__))
DS_CONFIG = os.path.join(HERE, "ds_config_zero3_qgz_loco.json")


def _samples(count, seed=0):
    """``count`` pairs ``x`` (13) -> ``y`` (5) of a fixed random linear map plus noise (0.01 of the variance):
    unit-variance inputs and targets, so the loss starts near 1 and a learned map brings it near 0.01."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(13, 5, generator=gen) / 13 ** 0.5
    xs = torch.randn(count, 13, generator=gen)
    ys = xs @ weight + 0.1 * torch.randn(count, 5, generator=gen)
    return [{"x": x, "y": y} for x, y in zip(xs, ys)]


def train(steps=20, ds_config=None, micro_batch=16, lr=1e-2):
    """Trains for ``steps`` optimizer steps on every rank; returns this rank's losses and LoCo's counters.
    ``ds_config``: a DeepSpeed config (path or dict) for an explicit ``DeepSpeedPlugin``; ``None`` takes the one
    ``accelerate launch`` passes on (its config file's ``deepspeed_config_file``)."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    plugin = None if ds_config is None else DeepSpeedPlugin(hf_ds_config=ds_config)
    accelerator = Accelerator(deepspeed_plugin=plugin)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(13, 64), torch.nn.Tanh(), torch.nn.Linear(64, 5))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    samples = _samples(steps * micro_batch * accelerator.num_processes)
    loader = torch.utils.data.DataLoader(samples, batch_size=micro_batch)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for batch in loader:
        loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    hook = deepspeed_loco.loco_hook(model)
    loco = None if hook is None else {"step": hook.state.step, "reduces": hook.reducer.stats.reduces,
                                      "sent_bytes": hook.reducer.stats.total_bytes}
    # the data-parallel world as DeepSpeed sees it (on a CPU-only machine Accelerate's own state may say one process)
    dist = torch.distributed
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    return {"rank": rank, "world": world, "losses": losses, "loco": loco}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--ds-config", default=None,
                        help="DeepSpeed config JSON (default: the one accelerate launch passes on, else "
                             "ds_config_zero3_qgz_loco.json beside this script)")
    parser.add_argument("--out", default=None, help="also write rank 0's result here as JSON")
    args = parser.parse_args(argv)
    ds_config = args.ds_config
    if ds_config is None and os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        ds_config = DS_CONFIG  # not under accelerate launch's DeepSpeed mode: name the config ourselves
    result = train(steps=args.steps, ds_config=ds_config)
    if result["rank"] == 0:
        print(json.dumps(result))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f)
    return result


if __name__ == "__main__":
    main()
