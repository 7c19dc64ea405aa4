"""Convergence on the simulated cluster (issue 14): full precision vs plain qgZ vs qgZ + LoCo, on one device.

Every (arm, seed) run trains the bundled Llama-style byte-level model on the bundled plays (whole plays held out
for validation) with :func:`deepspeed_loco.simulation.simulate`: ``nodes x local`` virtual ranks, each the
gradient of its own micro-batch, reduced by the library's own reducer, error state and kernels (CUDA on a GPU).
Every arm of a seed starts from the same weights and sees the same batches.

    # one run, appended to a runs.jsonl as one line
    python3 benchmarks/convergence_sim.py run --arm loco8-2h --seed 0 --steps 600 --out runs.jsonl
    # many runs side by side (separate processes on one GPU), matrices in priority order
    python3 benchmarks/convergence_sim.py launch --parallel 14 --budget 480 --out runs.jsonl \\
        --matrix "m600:600:0,1,2:full,plain4,loco4" --matrix "beta95:600:0,1,2:loco2:err_beta=0.95"
    # tables (summary.md, summary.json) and plots (PNG) from runs.jsonl; a tag without full / plain2 runs
    # (here: mid-rise 8/2+H only) borrows them from a reference tag of the same steps and model
    python3 benchmarks/convergence_sim.py summarize --runs runs.jsonl --out benchmarks/results/convergence_sim \\
        --reference corpus600mr=corpus600

A matrix is ``TAG:STEPS:SEEDS:ARMS[:SETTINGS]``; SETTINGS is a comma list of ``key=value`` over the run flags
(``size``, ``micro_batch``, ``lr``, ``warmup``, ``group_size``, ``err_beta``, ``reset_T``, ``ef_hops``,
``diagnostics``, ``dtype``, ``eval_every``, ``text``, ``quant_grid``, ``variant``, ... ``SETTINGS`` below). Runs of
one tag are compared with each other; ``launch`` orders the runs matrix by matrix and seed by seed, so a budget that
runs out leaves whole seeds.

``summarize --reference TAG=REFTAG``: the tag TAG has no ``full`` or ``plain2`` arm of its own (for example it
changes only the quantizer, such as ``quant_grid=midrise``), so those arms are taken from REFTAG, whose runs must
have the same training setup (``REFERENCE_MATCH``: steps, model, text, layout, batch, schedule, dtype); the quantizer
settings may differ. The borrowed rows are marked ``ARM @REFTAG``, the "vs full" and "gap closed" columns name
REFTAG, and paired differences against a borrowed arm use the seeds both tags ran (a seed starts from the same
weights and sees the same batches in every tag).
"""
import argparse
import fcntl
import json
import math
import os
import statistics
import subprocess
import sys
import time
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)  # run from a checkout without installing

from deepspeed_loco.layout.wire import wire_bytes_per_element  # noqa: E402
from deepspeed_loco.config import LocoConfig  # noqa: E402
from deepspeed_loco.layout import plan_hops  # noqa: E402
from deepspeed_loco.simulation import ReducedStep, StepObserver  # noqa: E402
from deepspeed_loco.simulation.arms import parse_arm  # noqa: E402
from deepspeed_loco.simulation.burst import BURST_WINDOW, window_means  # noqa: E402
from deepspeed_loco.utils.stats import ema, format_mean_sd, mean_sd, t_interval  # noqa: E402

ARMS_17 = ("full,plain4,loco4,plain4h,loco4h,plain3,loco3,plain3h,loco3h,plain2,loco2,plain2h,loco2h,"
           "plain8-2,loco8-2,plain8-2h,loco8-2h")
GAP_REFERENCE = "plain2"  # every arm is placed on the way from plain 2/2-bit qgZ to full precision
REFERENCE_ARMS = ("full", GAP_REFERENCE)  # what a tag may borrow from its reference tag (summarize --reference)
REFERENCE_MATCH = ("steps", "size", "params", "model", "text", "nodes", "local", "micro_batch", "lr", "warmup",
                   "dtype", "eval_windows")  # setup keys a reference tag's runs must share with the tag's
SERIES_WINDOW = BURST_WINDOW  # per-step diagnostics are stored as means over windows of this many steps; regime_map
# reads the first BURST_WINDOWS of them as the first 100 steps
TRAIN_EMA_BETA = 0.95  # the plotted training loss: this EMA of the per-step seed mean
SETTINGS = {  # run flag: type; what a matrix's SETTINGS may set
    "size": str, "micro_batch": int, "lr": float, "warmup": int, "group_size": int, "err_beta": float,
    "reset_T": int, "ef_hops": str, "diagnostics": int, "dtype": str, "eval_every": int, "text": str,
    "quant_grid": str, "nodes": int, "local": int, "rank_chunk": int, "warmup_frac": float,
    "ef_from": int, "stream_nodes": int, "variant": str, "grad_mode": str, "save_at": int, "resume_from": int,
    "state_dir": str, "trunk_tag": str, "compile": str, "eval_windows": int, "stop_at": int,
    "error_bits": int, "error_feedback": str, "zero_errors_at": int
}


def add_run_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", default="medium", help="model size of the bundled model (tiny, small, medium, large)")
    p.add_argument("--micro-batch", dest="micro_batch", type=int, default=16, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=1e-3, help="peak AdamW learning rate")
    p.add_argument("--warmup", type=int, default=100, help="linear warm-up steps, then cosine decay to 0.1 lr")
    p.add_argument("--group-size", dest="group_size", type=int, default=256)
    p.add_argument("--err-beta", dest="err_beta", type=float, default=0.8)
    p.add_argument("--reset-T", dest="reset_T", type=int, default=1024)
    p.add_argument("--ef-hops", dest="ef_hops", default="all",
                   help="'all', or the hops (intra_node, inter_node; '+'-joined) whose error buffers carry over "
                        "steps (the Experiments observer)")
    p.add_argument("--error-bits", dest="error_bits", type=int, default=8,
                   help="LoCo arms: zeropp_loco_param.error_bits, the error buffers' storage (4, 8 or 32)")
    p.add_argument("--error-feedback", dest="error_feedback", choices=("all", "inter_node"), default="all",
                   help="LoCo arms: zeropp_loco_param.error_feedback, 'all' (true: every hop) or 'inter_node' (the "
                        "library's per-hop error feedback)")
    p.add_argument("--zero-errors-at", dest="zero_errors_at", type=int, default=0,
                   help="LoCo arms: zero every error buffer once, after this optimizer step's reduce, as a resume "
                        "from a checkpoint saved without error state would (the Experiments observer; 0: never)")
    p.add_argument("--ef-from", dest="ef_from", type=int, default=1,
                   help="LoCo arms: error feedback from this optimizer step on, plain qgZ before it "
                        "(the Experiments observer)")
    p.add_argument("--variant", default="none",
                   help="LoCo arms: a compensation rule of benchmarks/compensation_variants.py instead of the "
                        "library's (reference kernels only; 'none': the library's)")
    p.add_argument("--diagnostics", type=int, default=0, help="1: record the released share (LoCo arms)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="bf16: forward/backward under autocast")
    p.add_argument("--compile", default="", help="a torch.compile backend (e.g. inductor) for the model's training "
                                               "passes, with --grad-mode loop ('': eager; simulate's compile)")
    p.add_argument("--eval-every", dest="eval_every", type=int, default=50)
    p.add_argument("--eval-windows", dest="eval_windows", type=int, default=256)
    p.add_argument("--quant-grid", dest="quant_grid", choices=("symmetric", "midrise", "auto"), default="symmetric")
    p.add_argument("--text", help="training text instead of the bundled plays: a file or a folder of .txt files "
                                  "(loco_lab.data.ByteCorpus.from_path)")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--local", type=int, default=2)
    p.add_argument("--rank-chunk", dest="rank_chunk", type=int, default=0,
                   help="ranks per batched gradient pass (0: all W at once; smaller bounds activation memory)")
    p.add_argument("--stream-nodes", dest="stream_nodes", type=int, default=0,
                   help="1: compute the gradients node by node, each node's through hop 1 before the next's (at "
                        "most one node's fp32 gradients alive; simulate's stream_nodes)")
    p.add_argument("--grad-mode", dest="grad_mode", choices=("vmap", "loop"), default="vmap",
                   help="vmap: the ranks' gradients in batched passes; loop: one backward per rank (large "
                        "micro-batches, where one rank's pass fills the GPU; simulate's grad_mode)")
    p.add_argument("--warmup-frac", dest="warmup_frac", type=float, default=0.0,
                   help="if > 0, the warm-up is this share of the steps (overrides --warmup)")
    p.add_argument("--save-at", dest="save_at", type=int, default=0,
                   help="a branched study's trunk: save the model and optimizer after this step, for --resume-from "
                        "(benchmarks/branch_state.py; 0: never)")
    p.add_argument("--resume-from", dest="resume_from", type=int, default=0,
                   help="a branched study's branch: start from the state the trunk of this tag and seed saved after "
                        "this step and train the steps after it (0: from scratch)")
    p.add_argument("--state-dir", dest="state_dir", default=".branch_states",
                   help="where --save-at writes and --resume-from reads the saved states")
    p.add_argument("--stop-at", dest="stop_at", type=int, default=0,
                   help="train only up to this step of the --steps schedule (a long branch that ends before the "
                        "schedule does; 0: to its end)")
    p.add_argument("--trunk-tag", dest="trunk_tag", default="",
                   help="--resume-from the state that the trunk of this tag saved (default: this run's --tag; a "
                        "branch on another cluster shape at the same global batch names its trunk)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="one (arm, seed) run, appended to --out")
    run.add_argument("--arm", required=True)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--steps", type=int, default=600)
    run.add_argument("--tag", default="run")
    run.add_argument("--device", default="cuda")
    run.add_argument("--out", required=True, help="runs.jsonl to append to")
    add_run_flags(run)
    base = sub.add_parser("baseline", help="the simulator's yardstick: one model's plain training step on the same "
                                           "global batch (no ranks, no reduce), ms per step, appended to --out")
    base.add_argument("--steps", type=int, default=6, help="timed steps, after 2 untimed ones")
    base.add_argument("--device", default="cuda")
    base.add_argument("--out", required=True)
    add_run_flags(base)
    launch = sub.add_parser("launch", help="matrices of runs, --parallel processes at a time")
    launch.add_argument("--matrix", action="append", required=True, help="TAG:STEPS:SEEDS:ARMS[:SETTINGS]")
    launch.add_argument("--parallel", type=int, default=14)
    launch.add_argument("--budget", type=float, default=480, help="seconds; runs still going then are stopped")
    launch.add_argument("--device", default="cuda")
    launch.add_argument("--out", required=True)
    launch.add_argument("--logs", default=None, help="folder for each run's log (default: beside --out)")
    summ = sub.add_parser("summarize", help="summary.md, summary.json and PNGs from runs.jsonl files")
    summ.add_argument("--runs", nargs="+", required=True)
    summ.add_argument("--out", required=True)
    summ.add_argument("--reference", action="append", default=[], metavar="TAG=REFTAG",
                      help="TAG's missing full / plain2 arms come from REFTAG (same steps and model); repeatable")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------------- one run


class Experiments(StepObserver):
    """The benchmark's experiments on LoCo arms, run by :func:`~deepspeed_loco.simulation.simulate` as an observer
    of every step (the library's behaviour is none of them).

    ``kept_hops``: None (every hop, the library's behaviour), or the hop names (``"intra_node"``, ``"inter_node"``)
    whose error buffers carry over steps; the others' are zeroed after every reduce, which leaves that hop plain
    qgZ. ``from_step``: before this optimizer step every buffer is zeroed after each reduce (plain qgZ); from it on
    error feedback runs as ``kept_hops`` says (1: from the start). ``zero_at``: every buffer is zeroed after the
    reduce of this optimizer step (once; 0: never): a resume from a checkpoint saved without error state.
    ``diagnostics``: every LoCo arm's rank gradients also go through plain qgZ with the same bits (a shadow
    cluster), and each step appends to ``released[arm key]`` the share of coordinates LoCo sent nonzero where plain
    qgZ sent zero (its "released fraction"; an arm without diagnostics has no entry). Raises ValueError for a hop
    that the ``world x local`` layout does not have, or ``from_step < 1``."""

    def __init__(self, world: int, local: int, kept_hops=None, from_step: int = 1, diagnostics: bool = False,
                 zero_at: int = 0):
        known = [hop.name for hop in plan_hops(world, local, LocoConfig()).hops]
        unknown = sorted(set(kept_hops or ()) - set(known))
        if unknown:
            raise ValueError(f"--ef-hops: {unknown} are not hops of this layout {known}")
        if from_step < 1:
            raise ValueError(f"--ef-from {from_step}: it must be an optimizer step >= 1")
        self.kept_hops = None if kept_hops is None else tuple(kept_hops)
        self.from_step, self.diagnostics, self.zero_at = from_step, diagnostics, zero_at
        self.released: Dict[str, List[float]] = {}

    def shadow_blocks(self, arm, block):
        return [dict(block, error_feedback=False)] if self.diagnostics and arm.kind == "loco" else []

    def after_reduce(self, reduced: ReducedStep) -> None:
        if reduced.arm.kind != "loco":
            return
        kept = () if reduced.step < self.from_step or reduced.step == self.zero_at else self.kept_hops
        if kept is not None:
            for state in reduced.cluster.states:
                for _, hop, buffer in state.named_buffers():
                    if hop not in kept:
                        buffer.zero_()
        if self.diagnostics:
            import torch
            sent = torch.cat([g.reshape(-1) for g in reduced.communicated]).double() != 0
            plain_zero = torch.cat([g.reshape(-1) for g in reduced.shadows[0]]) == 0
            self.released.setdefault(reduced.arm.key, []).append((sent & plain_zero).double().mean().item())


def run_one(args) -> dict:
    """Trains one (arm, seed) and appends its record to ``args.out``; returns the record."""
    import torch

    from deepspeed_loco.ops import kernels_for
    from deepspeed_loco.simulation import SimulationSpec, TrainingSetup, gradient_noise_scale, simulate
    from loco_lab.data import load_corpus
    from loco_lab.model import SIZES, ByteLlama, count_parameters, mean_loss

    import branch_state
    from compensation_variants import install

    torch.set_num_threads(1)
    install(args.variant)
    if args.warmup_frac > 0:
        args.warmup = max(1, round(args.warmup_frac * args.steps))
    arm = parse_arm(args.arm)
    cfg = SIZES[args.size]
    device = torch.device(args.device)
    world = args.nodes * args.local
    corpus = load_corpus(args.text, cfg.seq_len)
    global_batch = args.micro_batch * world
    trunk = _Trunk(args, branch_state)
    first = trunk.resumed.step if trunk.resumed else 0  # steps done before this run's first
    last = args.stop_at or args.steps  # the schedule's step this run ends after
    if not first < last <= args.steps:
        raise SystemExit(f"--stop-at {args.stop_at}: it must be a step in ({first}, {args.steps}] (after the resumed "
                         f"step, within --steps)")

    def batches():
        for step in range(first, last):
            yield corpus.train_batch(step, args.seed, global_batch, cfg.seq_len, 0, 1)

    validation = [(x.to(device), y.to(device))
                  for x, y in corpus.validation_batches(args.eval_windows, cfg.seq_len, 0, 1, 64)]
    autocast = torch.bfloat16 if args.dtype == "bf16" else None

    def evaluate(model):
        return mean_loss(model, validation, autocast)

    def optimizer(params):
        return trunk.optimizer(torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1))

    def schedule(opt):
        def factor(step):  # linear warm-up from 0, then cosine from 1 down to 0.1 at the last step
            step += first
            if step < args.warmup:
                return (step + 1) / args.warmup
            progress = (step - args.warmup) / max(1, args.steps - args.warmup)
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return torch.optim.lr_scheduler.LambdaLR(opt, factor)

    loco = {"group_size": args.group_size, "err_beta": args.err_beta, "reset_T": args.reset_T,
            "quant_grid": args.quant_grid, "error_bits": args.error_bits}
    if args.error_feedback != "all":  # the LoCo arms' error feedback narrowed to one hop (zeropp_loco_param)
        loco["error_feedback"] = args.error_feedback
    hops = None if args.ef_hops == "all" else tuple(args.ef_hops.split("+"))
    started = time.monotonic()

    def progress(result, step, loss):  # one log line per evaluation: a run stopped by a budget shows how far it got
        trunk.after_step(first + step)
        if result.validation and result.validation[-1][0] == step:
            print(f"[{args.tag}] {result.key} seed {args.seed}: step {first + step}/{args.steps} val "
                  f"{result.validation[-1][1]:.4f} at {time.monotonic() - started:.0f} s", flush=True)

    setup = TrainingSetup(lambda: trunk.model(ByteLlama(cfg)), batches, nodes=args.nodes, local=args.local, loco=loco,
                          optimizer_fn=optimizer, scheduler_fn=schedule, eval_fn=evaluate,
                          eval_every=args.eval_every, device=device, grad_clip=1.0, autocast_dtype=autocast,
                          rank_chunk=args.rank_chunk or None, stream_nodes=bool(args.stream_nodes),
                          grad_mode=args.grad_mode, compile=args.compile or None)
    experiments = Experiments(world, args.local, hops, args.ef_from, bool(args.diagnostics), args.zero_errors_at)
    (result, ) = simulate(SimulationSpec(setup, [arm], last - first, args.seed), experiments,
                          on_step=progress)
    result.validation = [(first + step, loss) for step, loss in result.validation]  # steps of the whole schedule
    released = experiments.released.get(result.key, [])
    kernels = kernels_for(device).name
    record = {
        "tag": args.tag, "key": result.key, "label": result.label, "seed": args.seed,
        "setup": {"steps": args.steps, "stop_at": last, "size": args.size, "params": count_parameters(ByteLlama(cfg)),
                  "text": args.text or "bundled plays", "train_bytes": corpus.sizes()["train_bytes"],
                  "model": cfg.to_dict(), "nodes": args.nodes, "local": args.local, "micro_batch": args.micro_batch,
                  "lr": args.lr, "warmup": args.warmup, "dtype": args.dtype, "group_size": args.group_size,
                  "err_beta": args.err_beta, "reset_T": args.reset_T, "ef_hops": args.ef_hops, "ef_from": args.ef_from,
                  "error_bits": args.error_bits, "error_feedback": args.error_feedback,
                  "zero_errors_at": args.zero_errors_at,
                  "variant": args.variant,
                  "quant_grid": args.quant_grid, "grad_mode": args.grad_mode, "compile": args.compile or None,
                  "resumed_from": first,
                  "trunk": trunk.resumed_tag,
                  "eval_windows": args.eval_windows, "device": torch.cuda.get_device_name(device)
                  if device.type == "cuda" else "cpu", "kernels": kernels},
        "final_val_loss": result.final_val_loss,
        "validation": result.validation,
        "train_losses": [round(v, 5) for v in result.train_losses],
        "grad_rel_error_mean": statistics.fmean(result.grad_rel_errors),
        "sum_rel_error_final": result.sum_rel_errors[-1],
        "nonzero_fraction_mean": statistics.fmean(result.nonzero_fractions),
        "released_fraction_mean": statistics.fmean(released) if released else None,
        "series": dict({name: _windowed(getattr(result, name)) for name in
                        ("grad_rel_errors", "sum_rel_errors", "nonzero_fractions", "update_rms")},
                       released_fractions=_windowed(released)),
        "update_rms_max": max(result.update_rms),
        "noise_scale": gradient_noise_scale(result, first_step=max(1, args.warmup + 1 - first)),
        "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "bytes_per_step": result.bytes_per_step,
        "full_precision_bytes_per_step": result.full_precision_bytes_per_step,
        "wall_s": result.wall_s,
    }
    line = json.dumps(record) + "\n"
    with open(args.out, "a") as f:  # several runs append to one file side by side: one locked write each
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(line)
        f.flush()
        fcntl.flock(f, fcntl.LOCK_UN)
    print(f"[{args.tag}] {result.key} seed {args.seed}: val {result.final_val_loss:.4f} "
          f"grad err {record['grad_rel_error_mean']:.4f} sum err {record['sum_rel_error_final']:.4f} "
          f"{1000 * result.wall_s / (last - first):.0f} ms/step ({kernels})", flush=True)
    return record


class _Trunk:
    """A run's part in a branched study (``--save-at``, ``--resume-from``; :mod:`branch_state`): restores the model
    and optimizer it builds from the saved state (a branch), and saves them after step ``--save-at`` (a trunk)."""

    def __init__(self, args, branch_state):
        self.args, self.store = args, branch_state
        if args.save_at and not 0 < args.save_at < args.steps:
            raise SystemExit(f"--save-at {args.save_at}: it must be a step in [1, {args.steps}) (--steps)")
        path = lambda tag, step: branch_state.state_path(args.state_dir, tag, args.seed, step)  # noqa: E731
        self.save_path = path(args.tag, args.save_at) if args.save_at else None
        self.resumed_tag = (args.trunk_tag or args.tag) if args.resume_from else None  # whose state it resumes
        self.resumed = (branch_state.load(path(self.resumed_tag, args.resume_from), branch_state.settings_of(args))
                        if args.resume_from else None)
        self.built = {}

    def model(self, model):
        """``model`` (just built), with the saved weights when resuming; kept to be saved."""
        if self.resumed:
            model.load_state_dict(self.resumed.model)
        self.built["model"] = model
        return model

    def optimizer(self, optimizer):
        """``optimizer`` (just built), with the saved state when resuming; kept to be saved."""
        if self.resumed:
            optimizer.load_state_dict(self.resumed.optimizer)
        self.built["optimizer"] = optimizer
        return optimizer

    def after_step(self, step: int) -> None:
        """Saves the state after step ``step`` of the schedule if it is ``--save-at``'s."""
        if self.save_path and step == self.args.save_at:
            self.store.save(self.save_path, step, self.built["model"], self.built["optimizer"],
                            self.store.settings_of(self.args))


def baseline(args) -> dict:
    """Times one model's plain training step on the global batch ``micro_batch x nodes x local`` (the gradient
    accumulated over micro-batches of ``micro_batch`` sequences, one AdamW step); appends ``{"ms_per_step",
    "tokens_per_s", ...}`` to ``args.out`` and returns it. ``run``'s ``wall_s / steps`` at the same flags over this
    is the simulator's overhead."""
    import torch

    from loco_lab.data import load_corpus
    from loco_lab.model import SIZES, ByteLlama

    cfg, device = SIZES[args.size], torch.device(args.device)
    world = args.nodes * args.local
    corpus = load_corpus(args.text, cfg.seq_len)
    torch.manual_seed(0)
    model = ByteLlama(cfg).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    forward = torch.compile(model, backend=args.compile) if args.compile else model
    autocast = dict(device_type=device.type, dtype=torch.bfloat16, enabled=args.dtype == "bf16")
    times = []
    for step in range(args.steps + 2):
        x, y = (t.to(device) for t in corpus.train_batch(step, 0, args.micro_batch * world, cfg.seq_len, 0, 1))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.monotonic()
        for chunk_x, chunk_y in zip(x.split(args.micro_batch), y.split(args.micro_batch)):
            with torch.autocast(**autocast):
                loss = forward(chunk_x, chunk_y) / world
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.monotonic() - started)
    ms = 1000 * statistics.median(times[2:])
    record = {"tag": "baseline", "size": args.size, "nodes": args.nodes, "local": args.local,
              "micro_batch": args.micro_batch, "global_batch": args.micro_batch * world, "ms_per_step": ms,
              "compile": args.compile or None,
              "tokens_per_s": args.micro_batch * world * cfg.seq_len / (ms / 1000),
              "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    with open(args.out, "a") as f:
        f.write(json.dumps(record) + "\n")
    print(f"[baseline] global batch {record['global_batch']}: {ms:.0f} ms/step, {record['tokens_per_s']:.3g} tokens/s",
          flush=True)
    return record


def _windowed(values):
    """Means over consecutive windows of ``SERIES_WINDOW`` steps (4 significant digits); [] for no values."""
    return [float(f"{mean:.4g}") for mean in window_means(values, SERIES_WINDOW)]


# ------------------------------------------------------------------------------------------------ many runs


def parse_matrix(text: str):
    """``TAG:STEPS:SEEDS:ARMS[:SETTINGS]`` to ``(tag, steps, [seed], [arm key], {flag: value})``."""
    parts = text.split(":")
    if len(parts) not in (4, 5):
        raise SystemExit(f"--matrix {text!r}: expected TAG:STEPS:SEEDS:ARMS[:SETTINGS]")
    tag, steps, seeds, arms = parts[:4]
    settings = {}
    for item in filter(None, (parts[4] if len(parts) == 5 else "").split(",")):
        key, _, value = item.partition("=")
        if key not in SETTINGS:
            raise SystemExit(f"--matrix {text!r}: unknown setting {key!r}; known: {', '.join(SETTINGS)}")
        settings[key] = SETTINGS[key](value)
    keys = [parse_arm(a.strip()).key for a in arms.split(",") if a.strip()]
    return tag, int(steps), [int(s) for s in seeds.split(",")], keys, settings


def launch(args) -> None:
    """Runs every matrix's (arm, seed) as its own process, ``--parallel`` at a time, in matrix then seed order; a run
    that resumes a state another run of the launch saves (a branch and its trunk) waits until the state is written;
    stops the runs still going after ``--budget`` seconds (what finished is in ``--out``)."""
    logs = args.logs or os.path.join(os.path.dirname(os.path.abspath(args.out)), "logs")
    os.makedirs(logs, exist_ok=True)
    jobs = []
    for text in args.matrix:
        tag, steps, seeds, keys, settings = parse_matrix(text)
        for seed in seeds:
            for key in keys:
                flags = [f"--{k.replace('_', '-')}={v}" for k, v in settings.items()]
                jobs.append((f"{tag}_{key}_s{seed}", [sys.executable, os.path.abspath(__file__), "run", "--arm", key,
                                                      "--seed", str(seed), "--steps", str(steps), "--tag", tag,
                                                      "--device", args.device, "--out", args.out, *flags],
                             _branch_states(tag, seed, settings)))
    started, running, failed, done = time.monotonic(), {}, [], 0
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    while jobs or running:
        while len(running) < args.parallel and (job := _next_ready(jobs, running)):
            name, cmd, states = job
            if states[1] and not os.path.exists(states[1]):  # nothing running or waiting saves its trunk's state
                failed.append(name)
                done += 1
                print(f"FAILED {name}: the state it resumes, {states[1]}, does not exist and no run of this launch "
                      "saves it (run the trunk first, with --save-at)", flush=True)
                continue
            log = open(os.path.join(logs, name + ".log"), "w")
            running[name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log, states[0])
        for name, (proc, log, _) in list(running.items()):
            if proc.poll() is not None:
                log.close()
                del running[name]
                done += 1
                if proc.returncode:
                    failed.append(name)
                    print(f"FAILED {name} (rc {proc.returncode}):\n" + _tail(os.path.join(logs, name + ".log")),
                          flush=True)
                else:
                    print(f"{time.monotonic() - started:6.0f} s  " + _tail(os.path.join(logs, name + ".log"), 1),
                          flush=True)
        if time.monotonic() - started > args.budget:
            for name, (proc, log, _) in running.items():
                proc.terminate()
                proc.wait()
                log.close()
                print(f"stopped {name}: {_tail(os.path.join(logs, name + '.log'), 1)}", flush=True)
            print(f"budget of {args.budget:.0f} s spent: stopped {len(running)} running, {len(jobs)} not started: "
                  f"{', '.join(list(running) + [n for n, _ in jobs])}", flush=True)
            break
        time.sleep(1)
    print(f"launch: {done - len(failed)} runs finished, {len(failed)} failed, in {time.monotonic() - started:.0f} s",
          flush=True)


def _branch_states(tag: str, seed: int, settings: dict):
    """``(saves, resumes)``: the state file a run of ``tag``/``seed`` with matrix ``settings`` writes (``save_at``)
    and the one it starts from (``resume_from``, of ``trunk_tag`` or ``tag``); None where it has no such part."""
    from branch_state import state_path

    folder = settings.get("state_dir", ".branch_states")
    saves = state_path(folder, tag, seed, settings["save_at"]) if settings.get("save_at") else None
    resumes = (state_path(folder, settings.get("trunk_tag") or tag, seed, settings["resume_from"])
               if settings.get("resume_from") else None)
    return saves, resumes


def _next_ready(jobs: list, running: dict):
    """Takes from ``jobs`` the first that can start now: one that resumes no state, or whose state exists, or whose
    state no running or waiting run will save (it then fails at once, naming the state). None: all wait."""
    pending = {job[2][0] for job in jobs} | {entry[2] for entry in running.values()}
    for i, (_, _, (_, resumes)) in enumerate(jobs):
        if not resumes or os.path.exists(resumes) or resumes not in pending:
            return jobs.pop(i)
    return None


def _tail(path: str, lines: int = 20) -> str:
    with open(path) as f:
        return "".join(f.readlines()[-lines:]).rstrip()


# ---------------------------------------------------------------------------------------------------- summary


def summarize(args) -> str:
    """Writes ``summary.md``, ``summary.json`` and one ``curves_<tag>.png`` per tag from the runs; returns the text.

    Per tag (runs of one tag share their settings): one row per arm over its seeds (mean +- sd, n), its place on
    the way from plain 2/2 to full, gradient fidelity and the update diagnostics; then paired differences over
    the seeds both arms ran: LoCo - plain at the same bits and Hadamard, and every arm - full, each with a 95%
    t-interval (none for n = 1). ``args.reference`` (``TAG=REFTAG`` strings) fills a tag's missing ``full`` and
    ``plain2`` from REFTAG (see the module's doc).
    """
    runs = [json.loads(line) for path in args.runs for line in open(path) if line.strip()]
    if not runs:
        raise SystemExit(f"no runs in {args.runs}")
    os.makedirs(args.out, exist_ok=True)
    by_tag = {}
    for r in runs:
        by_tag.setdefault(r["tag"], {}).setdefault(r["key"], {})[r["seed"]] = r
    references = _parse_references(getattr(args, "reference", []), by_tag)
    order = ARMS_17.split(",")
    lines, tables = [], {}
    for tag, own in by_tag.items():
        setup = next(iter(next(iter(own.values())).values()))["setup"]
        arms, ref_tag = dict(own), references.get(tag)
        borrowed = _borrow(arms, tag, setup, ref_tag, by_tag.get(ref_tag, {}))
        keys = [k for k in order if k in arms] + sorted(k for k in arms if k not in order)
        names = {k: f"{k} @{ref_tag}" if k in borrowed else k for k in keys}
        lines += [f"### {tag}", "", _setup_line(setup), ""]
        if borrowed:
            lines += [f"Rows marked @{ref_tag} are tag {ref_tag}'s runs (same training setup; this tag has no "
                      f"{' or '.join(borrowed)} run of its own); paired differences with them use the seeds both "
                      "tags ran.", ""]
        rows, table = _arm_rows(arms, keys, names, ref_tag if borrowed else None), []
        lines += _md(rows)
        table.append(rows)
        pairs = [(f"loco{k[5:]}", k) for k in keys if k.startswith("plain") and f"loco{k[5:]}" in arms]
        pairs += [(k, "full") for k in keys if k != "full" and "full" in arms]
        diff_rows = _paired_rows(arms, [p for p in pairs if not set(p) <= set(borrowed)], names)
        lines += ["", "Paired differences of the final validation loss over the seeds both arms ran (negative: the "
                      "first arm is better); 95% t-interval over seeds:", ""] + _md(diff_rows) + [""]
        table.append(diff_rows)
        tables[tag] = table
        _plot(arms, keys, names, tag, os.path.join(args.out, f"curves_{tag}.png"))
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(tables, f, indent=1)
    print(text)
    return text


def _parse_references(specs, by_tag) -> dict:
    """``["TAG=REFTAG", ...]`` -> ``{TAG: REFTAG}``; both tags must have runs."""
    references = {}
    for spec in specs:
        tag, sep, ref = spec.partition("=")
        if not sep or not tag or not ref or tag == ref:
            raise SystemExit(f"--reference {spec!r}: expected TAG=REFTAG with two different tags")
        missing = [t for t in (tag, ref) if t not in by_tag]
        if missing:
            raise SystemExit(f"--reference {spec!r}: no runs of tag {', '.join(missing)}")
        references[tag] = ref
    return references


def _borrow(arms, tag, setup, ref_tag, ref_arms) -> list:
    """Adds to ``arms`` the ``REFERENCE_ARMS`` it lacks from ``ref_arms`` (tag ``ref_tag``); returns their keys."""
    borrowed = [k for k in REFERENCE_ARMS if k not in arms and k in ref_arms]
    for k in borrowed:
        ref_setup = next(iter(ref_arms[k].values()))["setup"]
        differ = [key for key in REFERENCE_MATCH if setup.get(key) != ref_setup.get(key)]
        if differ:
            raise SystemExit(f"--reference {tag}={ref_tag}: the tags' runs differ in {', '.join(differ)}")
        arms[k] = ref_arms[k]
    return borrowed


def _setup_line(setup: dict) -> str:
    m = setup["model"]
    return (f"{setup['size']} model ({m['layers']} x {m['dim']}, ctx {m['seq_len']}, {setup['params'] / 1e6:.2f}M "
            f"parameters), {setup['steps']} steps, {setup['nodes']} nodes x {setup['local']} ranks, micro-batch "
            f"{setup['micro_batch']} per rank, AdamW lr {setup['lr']:g} ({setup['warmup']} warm-up steps, cosine to "
            f"0.1 lr), {setup['dtype']}, group {setup['group_size']}, err_beta {setup['err_beta']}, reset_T "
            f"{setup['reset_T']}, error feedback on hops: {setup['ef_hops']}, grid "
            f"{setup.get('quant_grid', 'symmetric')}; text {setup.get('text') or 'bundled plays'}; {setup['device']} "
            f"({setup['kernels']})")


def _pm(values, digits=4):
    """``"mean +- sd"`` over the runs that recorded the value (None: not measured in that run)."""
    return format_mean_sd([v for v in values if v is not None], digits)


def _arm_rows(arms, keys, names, ref_tag=None):
    """One row per arm; ``names``: the arm's shown name; ``ref_tag``: the tag full / plain2 were borrowed from."""
    stat = {k: statistics.fmean(r["final_val_loss"] for r in arms[k].values()) for k in keys}
    full, ref = stat.get("full"), stat.get(GAP_REFERENCE)
    of = f" (@{ref_tag})" if ref_tag else ""
    rows = [["arm", "n", "final val loss", "best val loss", "train loss (last 50)", f"vs full{of}",
             f"gap closed{of}", "grad rel err", "sum rel err", "nonzero share", "released share", "update RMS / lr",
             "wire bits"]]
    for k in keys:
        runs = list(arms[k].values())
        arm = parse_arm(k)
        group = runs[0]["setup"]["group_size"]
        bits = "32" if arm.kind == "full" else "/".join(
            f"{8 * wire_bytes_per_element(b, group):.3f}" for b in dict.fromkeys((arm.intra_bits, arm.inter_bits)))
        gap = (f"{(ref - stat[k]) / (ref - full):.0%}" if None not in (full, ref) and ref != full else "-")
        rows.append([names[k], str(len(runs)), _pm([r["final_val_loss"] for r in runs]),
                     _pm([min(v for _, v in r["validation"]) for r in runs]),
                     _pm([statistics.fmean(r["train_losses"][-50:]) for r in runs]),
                     f"{(stat[k] - full) / full:+.2%}" if full else "-", gap,
                     _pm([r["grad_rel_error_mean"] for r in runs], 3), _pm([r["sum_rel_error_final"] for r in runs], 3),
                     _pm([r["nonzero_fraction_mean"] for r in runs], 3),
                     _pm([r["released_fraction_mean"] for r in runs], 3),
                     _pm([statistics.fmean(r["series"]["update_rms"]) for r in runs], 3), bits])
    return rows


def _paired_rows(arms, pairs, names):
    rows = [["first - second", "n", "mean difference", "sd", "95% CI", "CI excludes 0"]]
    for first, second in pairs:
        seeds = sorted(set(arms[first]) & set(arms[second]))
        diffs = [arms[first][s]["final_val_loss"] - arms[second][s]["final_val_loss"] for s in seeds]
        mean, sd, n = mean_sd(diffs)
        interval = t_interval(diffs)
        if interval:
            _, low, high = interval
            ci, excludes = f"[{low:+.4f}, {high:+.4f}]", "yes" if low > 0 or high < 0 else "no"
        else:
            ci, excludes = "- (n = 1)", "-"
        rows.append([f"{names[first]} - {names[second]}", str(n), f"{mean:+.4f}", f"{sd:.4f}" if n > 1 else "-", ci,
                     excludes])
    return rows


def _md(rows):
    return ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])] + ["| " + " | ".join(r) + " |"
                                                                              for r in rows[1:]]


def _plot(arms, keys, names, tag, path) -> None:
    """Seed-mean validation loss, training loss (EMA) and update RMS / lr (10-step means) per arm, one PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(18, 5.5))
    FigureCanvasAgg(fig)
    val, train, moves = fig.add_subplot(1, 3, 1), fig.add_subplot(1, 3, 2), fig.add_subplot(1, 3, 3)
    for k in keys:
        runs = list(arms[k].values())
        arm = parse_arm(k)
        style = dict(color=_color(arm), linestyle="-" if arm.kind != "plain" else "--", linewidth=1.3, label=names[k])
        steps = [s for s, _ in runs[0]["validation"]]
        val.plot(steps, [statistics.fmean(r["validation"][i][1] for r in runs) for i in range(len(steps))], **style)
        losses = [statistics.fmean(v) for v in zip(*(r["train_losses"] for r in runs))]
        train.plot(range(1, len(losses) + 1), ema(losses, TRAIN_EMA_BETA), **style)
        series = [statistics.fmean(v) for v in zip(*(r["series"]["update_rms"] for r in runs))]
        moves.plot([SERIES_WINDOW * (i + 1) for i in range(len(series))], series, **style)
    n = min(len(a) for a in arms.values())
    for ax, title in ((val, f"validation loss (held-out plays), mean of {n}+ seeds"),
                      (train, f"training loss (EMA {TRAIN_EMA_BETA})"), (moves, "update RMS / learning rate")):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    val.legend(fontsize=7, ncol=2)
    fig.suptitle(f"{tag}: full precision (black), plain qgZ (dashed), qgZ + LoCo (solid); colour = bits", fontsize=11)
    fig.savefig(path, dpi=90)


def _color(arm) -> str:
    if arm.kind == "full":
        return "black"
    palette = {(4, 4): "tab:blue", (3, 3): "tab:green", (2, 2): "tab:red", (8, 2): "tab:purple"}
    base = palette.get((arm.intra_bits, arm.inter_bits), "tab:gray")
    return base if not arm.hadamard else {"tab:blue": "tab:cyan", "tab:green": "tab:olive", "tab:red": "tab:orange",
                                          "tab:purple": "tab:pink"}.get(base, "tab:brown")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.command == "run":
        run_one(args)
    elif args.command == "baseline":
        baseline(args)
    elif args.command == "launch":
        launch(args)
    else:
        summarize(args)


if __name__ == "__main__":
    main()
