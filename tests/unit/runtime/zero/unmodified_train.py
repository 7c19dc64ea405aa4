"""A training script that knows nothing of deepspeed-loco: plain ``deepspeed.initialize`` with --deepspeed_config."""
import argparse

import deepspeed
import torch


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(13, 33), torch.nn.Tanh(), torch.nn.Linear(33, 5))
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    gen = torch.Generator().manual_seed(torch.distributed.get_rank())
    for _ in range(args.steps):
        x = torch.randn(8, 13, generator=gen)
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
    if torch.distributed.get_rank() == 0:
        print(f"final loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
