"""python -m loco_lab.cli advise: the demo of deepspeed-loco-advise on the bundled byte-level model and Shakespeare
(or --text), for a cluster shape and a budget of device minutes; prints the table and the recommendation, writes
advise.json, advise.png and table.md under --out (the console script's own code runs it:
deepspeed_loco.simulation.advise_cli)."""
import argparse
import os
import sys


def add_parser(sub) -> argparse.ArgumentParser:
    from deepspeed_loco.simulation.advise_cli import PlainHelp, add_advise_arguments, positive_int, positive_number
    from loco_lab.model import SIZES
    p = sub.add_parser("advise", help="recommend a zeropp_loco_param for a cluster shape by short simulations",
                       description=__doc__, formatter_class=PlainHelp)
    p.add_argument("--model-size", choices=sorted(SIZES), default="medium", help="the bundled model's size")
    p.add_argument("--micro-batch", type=positive_int, default=1, help="sequences per rank per step")
    p.add_argument("--lr", type=positive_number, default=1e-3,
                   help="AdamW learning rate (after a 10-step linear warm-up)")
    p.add_argument("--text", help="your own text (a file, or a folder of .txt files) instead of the bundled plays")
    p.add_argument("--parallel", type=_parallel_arg, default="auto",
                   help="runs side by side on the device (auto: as many as its memory holds; 1 on the CPU)")
    add_advise_arguments(p)
    return p


def _parallel_arg(text: str):
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: 'auto' or an integer >= 1")
    return int(text)


def run(args, prog: str) -> int:
    """Runs advise on the bundled task; a bad flag or text is one line, ``<prog>: error: ...``, and exit code 2."""
    from deepspeed_loco.simulation.advise_cli import run_advise
    from loco_lab.model import SIZES

    try:
        setup, task = _setup(args)
    except (TypeError, ValueError, FileNotFoundError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    return run_advise(setup, args, prog=prog, tokens_per_step=SIZES[args.model_size].seq_len * task.global_batch)


def _setup(args):
    """The ``TrainingSetup`` of the bundled task for the flags (``args.parallel`` resolved), and the task; raises
    TypeError or ValueError naming a bad flag, FileNotFoundError for a missing ``--text``."""
    from deepspeed_loco.simulation import TrainingSetup
    from deepspeed_loco.simulation.advise_cli import resolve_device
    from loco_lab.model import SIZES

    device = resolve_device(args.device)
    task = BundledTask(args.text, args.model_size, args.micro_batch * args.nodes * args.local, args.lr, device)
    setup = TrainingSetup(task.model, task.batches, nodes=args.nodes, local=args.local, optimizer_fn=task.optimizer,
                          scheduler_fn=task.schedule, loss_fn=task.loss, eval_fn=task.evaluate, device=device,
                          grad_clip=1.0, autocast_dtype=task.autocast)
    task.corpus()  # a bad --text fails here, before any run
    args.parallel = _parallel(args, SIZES[args.model_size], device)
    return setup, task


class BundledTask:
    """The bundled byte-level model on the plays (or ``text``) as picklable pieces for ``advise``: the model,
    the global batches of ``global_batch`` windows, the held-out loss, AdamW at ``lr`` with a 10-step warm-up.
    The corpus and the validation batches load lazily in each process that uses them."""

    def __init__(self, text, size: str, global_batch: int, lr: float, device):
        import torch
        self.text, self.size, self.global_batch, self.lr, self.device = text, size, global_batch, lr, device
        self.autocast = torch.bfloat16 if device.type == "cuda" else None
        self._corpus = self._validation = None

    def __getstate__(self):
        return dict(self.__dict__, _corpus=None, _validation=None)

    def corpus(self):
        from loco_lab.data import load_corpus
        from loco_lab.model import SIZES
        if self._corpus is None:
            self._corpus = load_corpus(self.text, SIZES[self.size].seq_len)
        return self._corpus

    def model(self):
        from loco_lab.model import SIZES, ByteLlama
        return ByteLlama(SIZES[self.size])

    def batches(self):
        from loco_lab.model import SIZES
        corpus, seq_len, step = self.corpus(), SIZES[self.size].seq_len, 0
        while True:
            yield corpus.train_batch(step, 0, self.global_batch, seq_len, 0, 1)
            step += 1

    def evaluate(self, model) -> float:
        from loco_lab.model import SIZES, mean_loss
        if self._validation is None:
            self._validation = [(x.to(self.device), y.to(self.device))
                                for x, y in self.corpus().validation_batches(64, SIZES[self.size].seq_len, 0, 1, 32)]
        return mean_loss(model, self._validation, self.autocast)

    @staticmethod
    def loss(model, batch):
        return model(*batch)

    def optimizer(self, params):
        import torch
        return torch.optim.AdamW(params, lr=self.lr, betas=(0.9, 0.95), weight_decay=0.1)

    def schedule(self, optimizer):
        import torch
        return torch.optim.lr_scheduler.LambdaLR(optimizer, _warm_up)


def _warm_up(step: int) -> float:
    """The learning-rate factor of a 10-step linear warm-up."""
    return min(1.0, (step + 1) / 10)


def _parallel(args, cfg, device) -> int:
    """``--parallel``, or for ``auto``: 1 on the CPU; on a GPU as many runs as fit 85% of its free memory (at
    the measured ~5.2 GB per 10.8M parameters plus 11 bytes per rank per parameter, see docs/simulation.md),
    at most 3 x seeds and one per CPU core."""
    if args.parallel != "auto":
        return int(args.parallel)
    if device.type != "cuda":
        return 1
    import torch

    from loco_lab.model import ByteLlama
    params = sum(p.numel() for p in ByteLlama(cfg).parameters())
    per_run = 5.2e9 * params / 10.8e6 + 11 * params * args.nodes * args.local
    free, _ = torch.cuda.mem_get_info(device)
    return max(1, min(3 * args.seeds, int(0.85 * free / per_run), os.cpu_count() or 1))
