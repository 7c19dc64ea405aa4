"""A training run's state at one optimizer step, saved so that other arms can start from it (a branched study).

A branched study trains one full-precision run per seed and saves its state after step K; every other arm of that
seed resumes from the saved state and trains steps K+1 to the end. The arms then differ only in what their reduce did
after step K, and not in the timing of early-training events that sends unbranched runs of one seed apart
(``benchmarks/results/batch_axis/README.md``, stage 2). What is saved: the model's and the optimizer's state dicts
after step K (the learning-rate schedule is a function of the step, so it needs no state; the error buffers of a
LoCo arm start at zero, as when error feedback is switched on) and the run settings that must match on resume.

A branch may run on another cluster shape (nodes, ranks per node, micro-batch) at the same global batch: the saved
state does not depend on the layout, and the batches of a step depend on the global batch only
(``loco_lab.data``'s ``train_batch``), so one full-precision trunk serves the branches of several shapes; a
full-precision branch on another shape repeats the trunk's steps up to the order of the mean's fp32 sums.
"""
import os
from dataclasses import dataclass
from typing import Any, Dict

import torch

# what a resuming run must share with the run that saved the state: run flags, and global_batch (nodes x local x
# micro_batch; the arm, the evaluation and the cluster's shape may differ)
MATCHED = ("seed", "steps", "size", "text", "global_batch", "lr", "warmup", "dtype")


@dataclass(frozen=True)
class BranchState:
    """``step``: optimizer steps done; ``model``/``optimizer``: state dicts after them; ``settings``: the saving run's
    values of :data:`MATCHED`."""
    step: int
    model: Dict[str, torch.Tensor]
    optimizer: Dict[str, Any]
    settings: Dict[str, Any]


def state_path(folder: str, tag: str, seed: int, step: int) -> str:
    """Where the run of ``tag`` and ``seed`` keeps its state after ``step``."""
    return os.path.join(folder, f"{tag}_s{seed}_step{step}.pt")


def settings_of(args) -> Dict[str, Any]:
    """The settings of a run (an ``argparse`` namespace) that a branch must share with its trunk (:data:`MATCHED`)."""
    derived = {"global_batch": args.nodes * args.local * args.micro_batch}
    return {key: derived[key] if key in derived else getattr(args, key) for key in MATCHED}


def save(path: str, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         settings: Dict[str, Any]) -> None:
    """Writes the state after ``step`` to ``path`` (written to a temporary name, then renamed, so that a run stopped
    mid-write leaves no partial file; :func:`load` maps it to the CPU)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    state = {"step": step, "settings": dict(settings), "model": model.state_dict(),
             "optimizer": optimizer.state_dict()}
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)


def load(path: str, settings: Dict[str, Any]) -> BranchState:
    """The state saved at ``path``; raises FileNotFoundError naming the trunk run to start first, or ValueError
    naming each setting in which ``settings`` differ from the saving run's."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"--resume-from: no saved state {path}: run the trunk (the full-precision run of "
                                f"this tag and seed with --save-at) first")
    state = torch.load(path, map_location="cpu", weights_only=True)
    differ = [f"{key} = {settings.get(key)!r} (the state's: {state['settings'].get(key)!r})"
              for key in MATCHED if settings.get(key) != state["settings"].get(key)]
    if differ:
        raise ValueError(f"--resume-from {path}: this run differs from the run that saved it in " + ", ".join(differ))
    if not 0 < state["step"] < settings["steps"]:
        raise ValueError(f"--resume-from {path}: saved after step {state['step']}, which leaves no step of "
                         f"steps = {settings['steps']} to run")
    return BranchState(state["step"], state["model"], state["optimizer"], state["settings"])
