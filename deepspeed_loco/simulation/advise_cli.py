"""deepspeed-loco-advise: which zeropp_loco_param to use on a cluster shape, answered by short simulations of your
own model on your own data on this machine (the advise function of deepspeed_loco.simulation.advise).

    deepspeed-loco-advise --model mymodels:make_model --text corpus.txt --nodes 8 --gpus-per-node 8 --budget-minutes 30

--model names a function (module:function, the module importable from the current folder) that returns a fresh
torch.nn.Module. With --text the batches are (x, y) pairs of byte windows (x: the bytes, y: the next bytes, int64,
seq-len long) and the model's forward(x, y) must return the scalar loss; the last tenth of the text is held out for
the comparison's loss. With --data the function returns an iterable of global batches (a tensor or a tuple of
tensors whose first dimension splits into nodes x gpus-per-node equal micro-batches), the same sequence on every
call; --loss and --eval name the loss and the held-out loss (without --eval the comparison uses the training
loss). The demo on the bundled model runs from a checkout of the repository: python -m loco_lab.cli advise.

Before anything trains every number is checked and the model's loss is computed on one micro-batch, as training
will compute it; then a two-step run times the device and the smallest budget that can answer is printed. A bad
flag, a loss that cannot be computed (for example a model whose forward returns logits, without --loss) or a smaller
budget stops there with one line and exit code 2. advise.json, table.md and advise.png (advise.png needs
matplotlib, the report extra: without it the output says so and the other two are written) are written under --out
after the probe and after each training comparison, so what finished is kept if the run is stopped.
"""
import argparse
import importlib
import json
import math
import os
import sys
from typing import Callable, List, Optional, Tuple

PROG = "deepspeed-loco-advise"
DEFAULT_OUT = "loco_advise_out"


class OneLineErrors(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr, ``<prog>: error: <what is wrong>``, and exit code 2
    (argparse's own prints its usage first); ``--help`` says the rest. Sub-command parsers are of the same kind."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


class PlainHelp(argparse.RawDescriptionHelpFormatter):
    """The description as written; an option's default appended only where it has one and its help does not
    already say it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and "default" not in text and action.option_strings:
            text += " (default: %(default)s)"
        return text


def add_advise_arguments(parser: argparse.ArgumentParser) -> None:
    """The options advise takes whatever the model: cluster shape, budget, seeds, steps, device, output (each
    caller adds its own --parallel)."""
    parser.add_argument("--nodes", type=int, default=8, help="nodes of the cluster")
    parser.add_argument("--gpus-per-node", dest="local", type=int, default=8, help="ranks (GPUs) per node")
    parser.add_argument("--budget-minutes", type=float, default=30.0,
                        help="device minutes to spend, the probe included (about)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per arm in a training comparison, at least 2")
    parser.add_argument("--max-seeds", type=int, default=10,
                        help="seeds a comparison may grow to, with budget left, while a question stays open")
    parser.add_argument("--steps", type=int, help="steps per comparison run (default: what the budget allows)")
    parser.add_argument("--max-steps", type=int, default=2000, help="cap on the steps the budget may buy")
    parser.add_argument("--probe-steps", type=int, default=20, help="steps of each probe run")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: cuda if there is a GPU")
    parser.add_argument("--out", default=DEFAULT_OUT, help="output folder")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def parse_args(argv=None) -> argparse.Namespace:
    parser = OneLineErrors(prog=PROG, description=__doc__, formatter_class=PlainHelp)
    parser.add_argument("--model", required=True, help="module:function returning a fresh torch.nn.Module")
    data = parser.add_mutually_exclusive_group(required=True)
    data.add_argument("--data", help="module:function returning an iterable of global batches")
    data.add_argument("--text", help="a text file: byte windows of it are the batches")
    parser.add_argument("--loss", help="module:function(model, micro_batch) returning the scalar loss (default: "
                                       "model(*batch) for a tuple batch, else model(batch))")
    parser.add_argument("--eval", help="module:function(model) returning a held-out loss (with --data)")
    parser.add_argument("--seq-len", type=positive_int, default=128, help="bytes per window (with --text)")
    parser.add_argument("--micro-batch", type=positive_int, default=1, help="windows per rank per step (with --text)")
    parser.add_argument("--lr", type=positive_number, default=1e-3, help="AdamW learning rate")
    parser.add_argument("--parallel", type=positive_int, default=1,
                        help="runs side by side on the device, in spawned processes")
    add_advise_arguments(parser)
    args = parser.parse_args(argv)
    if args.eval and args.text:
        parser.error("--eval goes with --data: with --text the held-out loss is the loss on the text's last tenth")
    return args


def load_callable(flag: str, reference: str) -> Callable:
    """``module:function`` imported (the current folder importable first); raises ValueError naming ``flag``."""
    module_name, _, name = reference.partition(":")
    if not module_name or not name:
        raise ValueError(f"{flag} {reference!r} is invalid: it must be module:function, e.g. mymodels:make_model")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"{flag} {reference!r}: module {module_name!r} does not import ({err})") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise ValueError(f"{flag} {reference!r}: {module_name} has no function {name!r}")
    return function


def build_setup(args: argparse.Namespace):
    """The :class:`~deepspeed_loco.simulation.spec.TrainingSetup` of the parsed arguments."""
    import functools

    import torch

    from deepspeed_loco.simulation.spec import TrainingSetup, default_loss
    from deepspeed_loco.simulation.text_windows import TextWindows

    loss = load_callable("--loss", args.loss) if args.loss else default_loss
    device = resolve_device(args.device)
    if args.text:
        windows = TextWindows(args.text, args.seq_len, args.micro_batch * args.nodes * args.local)
        data_fn, eval_fn = windows.batches, functools.partial(windows.held_out_loss, loss_fn=loss)
    else:
        data_fn = load_callable("--data", args.data)
        eval_fn = load_callable("--eval", args.eval) if args.eval else None
    return TrainingSetup(load_callable("--model", args.model), data_fn, nodes=args.nodes, local=args.local,
                         optimizer_fn=functools.partial(torch.optim.AdamW, lr=args.lr), loss_fn=loss,
                         eval_fn=eval_fn, device=device)


def resolve_device(choice: str):
    import torch
    return torch.device("cuda" if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()) else "cpu")


def run_advise(setup, args: argparse.Namespace, prog: str = PROG, tokens_per_step: Optional[int] = None) -> int:
    """Runs advise on ``setup`` with the parsed options (``tokens_per_step``: the global batch in tokens, where the
    data are token windows), writing what finished under ``args.out`` as it comes; returns the exit code (2: an input
    advise refused before the probe, the budget included, said in one line on stderr)."""
    from deepspeed_loco.simulation.advise import AdviseInputError, advise

    bar = _Progress(enabled=not args.no_progress)
    try:
        advice = advise(setup, args.budget_minutes, seeds=args.seeds, max_seeds=max(args.seeds, args.max_seeds),
                        steps=args.steps, max_steps=args.max_steps, probe_steps=args.probe_steps, on_progress=bar,
                        parallel=args.parallel, on_update=lambda partial: write_advice(partial, args.out),
                        tokens_per_step=tokens_per_step)
    except AdviseInputError as err:
        bar.close()  # a bar on the screen ends its line first
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    finally:
        bar.close()
    written, skipped = write_advice(advice, args.out)
    print(advice.table() + "\n\n" + advice.summary())
    print(f"\nwrote {', '.join(written)}" + "".join(f"; {why}" for why in skipped), file=sys.stderr)
    return 0


def write_advice(advice, out: str) -> Tuple[List[str], List[str]]:
    """Writes ``table.md``, ``advise.json`` and ``advise.png`` of ``advice`` under ``out``; returns the paths written
    and, for a file not written, why (advise.png without matplotlib, the report extra, naming it)."""
    os.makedirs(out, exist_ok=True)
    paths = [os.path.join(out, name) for name in ("table.md", "advise.json", "advise.png")]
    with open(paths[0], "w") as f:
        f.write(advice.table() + "\n\n" + advice.summary() + "\n")
    with open(paths[1], "w") as f:
        json.dump(advice.to_dict(), f, indent=1)
    try:
        advice.plot(paths[2])
    except ImportError as err:  # the table and the JSON say everything the PNG shows
        return paths[:2], [f"no advise.png: {(err.name or 'matplotlib').partition('.')[0]} is not installed "
                           f'(pip install "deepspeed-loco[report]")']
    return paths, []


def main(argv: Optional[list] = None) -> int:
    """The console script deepspeed-loco-advise."""
    args = parse_args(argv)
    try:
        setup = build_setup(args)
    except (TypeError, ValueError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    tokens = args.seq_len * args.micro_batch * args.nodes * args.local if args.text else None  # a step's windows
    return run_advise(setup, args, tokens_per_step=tokens)


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: an integer >= 1")
    return int(text)


def positive_number(text: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: a number > 0")
    return value


class _Progress:
    """A tqdm bar over advise's stages (probe, then one comparison per candidate); none without tqdm. The bar appears
    at the first stage, so an input refused before any stage prints no bar; :meth:`close` ends its line."""

    def __init__(self, enabled: bool):
        self.enabled, self.bar = enabled, None

    def __call__(self, stage: str, done: int, total: int) -> None:
        if self.bar is None and self.enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                self.enabled = False
                return
            self.bar = tqdm(unit="run", dynamic_ncols=True, desc="advise")
        if self.bar is not None:
            self.bar.set_description(stage)
            self.bar.total = total
            self.bar.n = done
            self.bar.refresh()

    def close(self) -> None:
        """Ends the bar's line (a second call does nothing)."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None


if __name__ == "__main__":
    sys.exit(main())
