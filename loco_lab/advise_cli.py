"""``python -m loco_lab.cli advise``: :func:`deepspeed_loco.simulation.advise` on the bundled byte-level model and
Shakespeare (or ``--text``), for a cluster shape and a budget of device minutes; prints the table and the
recommendation, writes ``advise.json``, ``advise.png`` and ``table.md`` under ``--out``."""
import argparse
import json
import os
import sys

DEFAULT_OUT = "loco_advise_out"


def add_parser(sub) -> argparse.ArgumentParser:
    from loco_lab.model import SIZES
    p = sub.add_parser("advise", help="recommend a zeropp_loco_param for a cluster shape by short simulations",
                       description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--nodes", type=int, default=8, help="nodes of the cluster")
    p.add_argument("--gpus-per-node", dest="local", type=int, default=8, help="ranks (GPUs) per node")
    p.add_argument("--budget-minutes", type=float, default=30.0, help="device minutes to spend (about)")
    p.add_argument("--model-size", choices=sorted(SIZES), default="medium", help="the bundled model's size")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (after a 10-step linear warm-up)")
    p.add_argument("--seeds", type=int, default=3, help="seeds per arm in a training comparison (>= 2)")
    p.add_argument("--steps", type=int, help="steps per comparison run (default: what the budget allows)")
    p.add_argument("--max-steps", type=int, default=2000, help="cap on the steps the budget may buy")
    p.add_argument("--text", help="your own text (a file, or a folder of .txt files) instead of the bundled plays")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cuda if there is a GPU")
    p.add_argument("--out", default=DEFAULT_OUT, help="output directory")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def run(args) -> int:
    import torch

    from deepspeed_loco.simulation.advise import advise
    from loco_lab.data import load_corpus
    from loco_lab.model import SIZES, ByteLlama, mean_loss

    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    cfg = SIZES[args.model_size]
    corpus = load_corpus(args.text, cfg.seq_len)
    global_batch = args.micro_batch * args.nodes * args.local

    def batches():
        step = 0
        while True:
            yield corpus.train_batch(step, 0, global_batch, cfg.seq_len, 0, 1)
            step += 1

    validation = [(x.to(device), y.to(device)) for x, y in corpus.validation_batches(64, cfg.seq_len, 0, 1, 32)]
    autocast = torch.bfloat16 if device.type == "cuda" else None

    def evaluate(model):
        return mean_loss(model, validation, autocast)

    def optimizer(params):
        return torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)

    def schedule(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 10))

    bar = _Progress(enabled=not args.no_progress)
    advice = advise(lambda: ByteLlama(cfg), batches, args.nodes, args.local, args.budget_minutes, seeds=args.seeds,
                    steps=args.steps, max_steps=args.max_steps, eval_fn=evaluate, on_progress=bar,
                    loss_fn=lambda model, batch: model(*batch), optimizer_fn=optimizer, scheduler_fn=schedule,
                    device=device, autocast_dtype=autocast, grad_clip=1.0)
    bar.close()
    os.makedirs(args.out, exist_ok=True)
    table = advice.table()
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(table + "\n\n" + advice.summary() + "\n")
    with open(os.path.join(args.out, "advise.json"), "w") as f:
        json.dump(advice.to_dict(), f, indent=1)
    advice.plot(os.path.join(args.out, "advise.png"))
    print(table + "\n\n" + advice.summary())
    print(f"\nwrote {args.out}/table.md, advise.json, advise.png", file=sys.stderr)
    return 0


class _Progress:
    """A tqdm bar over advise's stages (probe, then one comparison per candidate)."""

    def __init__(self, enabled: bool):
        self.bar = None
        if enabled:
            from tqdm import tqdm
            self.bar = tqdm(unit="run", dynamic_ncols=True, desc="advise")

    def __call__(self, stage: str, done: int, total: int) -> None:
        if self.bar is not None:
            self.bar.set_description(stage)
            self.bar.total = total
            self.bar.n = done
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
