"""A Megatron-style training script that knows nothing of deepspeed-loco: it parses ``--local_rank`` with argparse,
takes its config through ``deepspeed.add_config_arguments`` and passes ``args`` and a client optimizer to plain
``deepspeed.initialize``. Each rank writes what it saw to ``<--out>/rank<R>.json``."""
import argparse
import json
import os

import deepspeed
import torch


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=None)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", required=True)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(13, 33), torch.nn.Tanh(), torch.nn.Linear(33, 5))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, optimizer=optimizer)
    rank = torch.distributed.get_rank()
    gen = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(args.steps):
        loss = engine(torch.randn(8, 13, generator=gen)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"local_rank_arg": args.local_rank, "env_local_rank": int(os.environ["LOCAL_RANK"]),
                   "global_steps": engine.global_steps, "losses": losses}, f)


if __name__ == "__main__":
    main()
