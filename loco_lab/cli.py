"""The demo app's command line: python -m loco_lab.cli demo (what bash scripts/demo.sh runs).

demo: trains a small Llama-style byte-level model on bundled Shakespeare on 4 ranks (2 nodes x 2) three ways,
full-precision reduce, plain 4-bit qgZ and 4-bit qgZ + LoCo, for 3 seeds; prints a table with every column
explained and what it says (claims only where the 95% interval over seeds excludes zero); writes the curves as a
PNG. By default the ranks are simulated in one process (deepspeed_loco.simulation: the library's own reducer,
error buffers and kernels; only the all-to-alls are in-process copies); --engine deepspeed runs real DeepSpeed
ZeRO-3 worker processes instead (gloo on CPU; NCCL with a GPU per rank; with fewer GPUs the ranks share them).
"""
import argparse
import dataclasses
import math
import os
import sys
from typing import List, Optional

from deepspeed_loco.config import QUANT_GRIDS
from deepspeed_loco.simulation.advise_cli import OneLineErrors, PlainHelp
from loco_lab import advise_cli

DEFAULT_STEPS = 60  # x 3 arms x 3 seeds: under 10 minutes on 2 CPU cores
DEFAULT_OUT = "loco_demo_out"
AT_LEAST_ONE = ("steps", "layers", "dim", "heads", "seq_len", "micro_batch", "nodes", "local", "eval_every",
                "eval_windows")  # integer flags (dest names); None: not given


def _demo_parser(sub) -> argparse.ArgumentParser:
    from loco_lab.model import SIZES
    p = sub.add_parser("demo", help="train a small LM three ways and compare (full / plain qgZ / qgZ + LoCo)",
                       description=__doc__, formatter_class=PlainHelp)
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="optimizer steps per arm")
    p.add_argument("--model-size", choices=sorted(SIZES), default="small",
                   help="named size; " + "; ".join(f"{k}: {v.layers}x{v.dim}, ctx {v.seq_len}"
                                                   for k, v in SIZES.items()))
    p.add_argument("--layers", type=int, help="override the size's number of layers")
    p.add_argument("--dim", type=int, help="override the size's width")
    p.add_argument("--heads", type=int, help="override the size's attention heads")
    p.add_argument("--seq-len", type=int, help="override the size's context length (bytes)")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate (warm-up, cosine decay)")
    p.add_argument("--bits", type=int, default=4, choices=(2, 3, 4, 8),
                   help="gradient bits of both qgZ hops for the arms plain and loco")
    p.add_argument("--group-size", type=int, default=256, help="quantization group size")
    p.add_argument("--err-beta", type=float, default=0.8, help="LoCo's error moving-average weight")
    p.add_argument("--arms", default="full,plain,loco",
                   help="comma list of arms: full; plain, loco (both hops --bits); plainN, locoN (both hops N bits); "
                        "locoI-O (intra-node I, inter-node O bits); a trailing h adds the Hadamard rotation "
                        "(loco4h, plain8-2h); N, I, O in 2, 3, 4, 8")
    p.add_argument("--quant-grid", choices=QUANT_GRIDS, default="auto",
                   help="gradient quantization grid (zeropp_loco_param.quant_grid; auto: mid-rise when a hop "
                        "sends 2 bits, symmetric otherwise)")
    p.add_argument("--text", help="train on your own text instead of the bundled plays: a file (its last 10%% held "
                                  "out for validation) or a folder of .txt files (whole files held out)")
    p.add_argument("--nodes", type=int, default=2, help="simulated nodes")
    p.add_argument("--local", type=int, default=2, help="ranks per simulated node")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: CUDA if there is one GPU per rank, else CPU; cuda with fewer GPUs than ranks: the "
                        "ranks share the GPUs round-robin")
    p.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto",
                   help="collectives; auto: NCCL on CUDA with one GPU per rank, else gloo (NCCL refuses two ranks "
                        "on one GPU)")
    p.add_argument("--dtype", choices=("auto", "fp32", "bf16", "fp16"), default="auto",
                   help="training dtype; auto: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                   help="seeds (model initialisation and data order, the same in every arm); claims need 2 or more")
    p.add_argument("--engine", choices=("simulated", "deepspeed"), default="simulated",
                   help="simulated: every rank in this process; deepspeed: real ZeRO-3 worker processes")
    p.add_argument("--eval-every", type=int, default=10, help="steps between validation passes")
    p.add_argument("--eval-windows", type=int, default=128, help="held-out windows per validation pass")
    p.add_argument("--no-fidelity", action="store_true",
                   help="do not measure the communicated gradient against the exact mean (an extra all-reduce)")
    p.add_argument("--out", default=DEFAULT_OUT, help="output directory (PNG, table, results.json, logs)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def resolve_device(requested: str, world_size: int) -> str:
    """``--device``: auto is cuda when this host has a GPU per rank, else cpu; cuda needs at least one GPU.

    With fewer GPUs than ranks, ``--device cuda`` puts several ranks on one GPU (see ``resolve_backend``).
    """
    from loco_lab.launcher import gpu_count
    gpus = gpu_count()
    if requested == "cuda" and gpus == 0:
        raise ValueError("--device cuda: no CUDA GPU on this host (use --device cpu)")
    if requested == "auto":
        return "cuda" if gpus >= world_size else "cpu"
    return requested


def resolve_backend(requested: str, device: str, world_size: int) -> str:
    """``--backend``: auto is nccl on cuda with a GPU per rank, else gloo; nccl needs cuda and a GPU per rank."""
    from loco_lab.launcher import gpu_count
    if device == "cpu":
        if requested == "nccl":
            raise ValueError("--backend nccl needs CUDA tensors: use --device cuda, or --backend gloo/auto")
        return "gloo"
    gpus = gpu_count()
    if requested == "auto":
        return "nccl" if gpus >= world_size else "gloo"
    if requested == "nccl" and gpus < world_size:
        raise ValueError(f"--backend nccl: NCCL refuses two ranks on one GPU, and {world_size} ranks share {gpus} "
                         f"GPU(s) here; use --backend gloo (or auto), or lower --nodes/--local")
    return requested


def spec_from_args(args) -> "RunSpec":  # noqa: F821
    """The demo's ``RunSpec`` from its flags, every flag checked first (:func:`check_flags`).

    Raises ValueError (FileNotFoundError for a missing ``--text``) naming the flag and what is valid.
    """
    from loco_lab.arms import RunSpec, parse_arms
    from loco_lab.model import SIZES
    check_flags(args)
    model = SIZES[args.model_size]
    overrides = {k: getattr(args, a) for k, a in (("layers", "layers"), ("dim", "dim"), ("heads", "heads"),
                                                  ("seq_len", "seq_len")) if getattr(args, a) is not None}
    model = dataclasses.replace(model, **overrides)
    if model.dim % model.heads or (model.dim // model.heads) % 2:
        raise ValueError(f"--dim {model.dim} must be a multiple of --heads {model.heads} with an even head size")
    try:
        arms = parse_arms(args.arms, args.bits)
    except ValueError as err:
        raise ValueError(f"--arms: {err}") from None
    from loco_lab.data import load_corpus
    load_corpus(args.text, model.seq_len)  # too little text for the context says how much it needs, up front
    device = resolve_device(args.device, 1 if args.engine == "simulated" else args.nodes * args.local)
    backend = resolve_backend(args.backend, device, args.nodes * args.local)
    dtype = args.dtype if args.dtype != "auto" else ("bf16" if device == "cuda" else "fp32")
    return RunSpec(model=model, arms=arms, steps=args.steps, micro_batch=args.micro_batch, lr=args.lr,
                   warmup=max(1, args.steps // 10), group_size=args.group_size, err_beta=args.err_beta,
                   nodes=args.nodes, local=args.local, device=device, backend=backend, dtype=dtype,
                   eval_every=min(args.eval_every, args.steps), eval_windows=args.eval_windows,
                   out_dir=args.out, fidelity=not args.no_fidelity, text=args.text, quant_grid=args.quant_grid)


def check_flags(args) -> None:
    """The demo flags argparse cannot check by type or choices; raises ValueError naming the first bad one."""
    from deepspeed_loco.config import LocoConfig, LocoConfigError
    for name in AT_LEAST_ONE:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} {value} is invalid: it must be an integer >= 1")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise ValueError(f"--lr {args.lr} is invalid: it must be a number > 0 (the peak learning rate)")
    for flag, key in (("--group-size", "group_size"), ("--err-beta", "err_beta")):
        try:
            LocoConfig(**{key: getattr(args, key)})
        except LocoConfigError as err:
            raise ValueError(f"{flag}: {err}") from None
    negative = [seed for seed in args.seeds if seed < 0]
    twice = sorted({seed for seed in args.seeds if args.seeds.count(seed) > 1})
    if negative or twice:
        raise ValueError(f"--seeds {' '.join(map(str, args.seeds))} is invalid: seeds must be integers >= 0, each "
                         f"given once (each seed is one paired run of every arm)")
    if args.dtype == "fp16" and args.engine == "simulated":
        raise ValueError("--dtype fp16 is invalid with --engine simulated: it trains in fp32 or bf16 (autocast, "
                         "no loss scaling); use --dtype fp32/bf16/auto, or --engine deepspeed for fp16")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ValueError(f"--out {args.out} is a file: it must be a directory (made when missing)")


def main(argv: Optional[List[str]] = None) -> int:
    """Runs a command; a bad flag prints one line, ``<prog> demo: error: <what is wrong>``, and returns 2."""
    parser = OneLineErrors(prog="python3 -m loco_lab.cli", description="the deepspeed-loco demo app")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _demo_parser(sub)
    advise_cli.add_parser(sub)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "advise":
        return advise_cli.run(args, prog=f"{parser.prog} advise")
    if args.command == "demo":
        from loco_lab.launcher import LaunchError
        from loco_lab.run import run_demo
        try:
            spec = spec_from_args(args)
        except (ValueError, FileNotFoundError) as err:
            print(f"{parser.prog} demo: error: {err}", file=sys.stderr)
            return 2
        try:
            run_demo(spec, seeds=args.seeds, engine=args.engine, progress=not args.no_progress)
        except LaunchError as err:
            print(f"\ndemo failed: {err}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("\ninterrupted", file=sys.stderr)
            return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
