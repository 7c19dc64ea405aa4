"""A training run's state at one optimizer step, saved so that other arms can start from it (a branched study).

A branched study trains one full-precision run per seed and saves its state after step K; every other arm of that
seed resumes from the saved state and trains steps K+1 to the end. The arms then differ only in what their reduce did
after step K, and not in the timing of early-training events that sends unbranched runs of one seed apart
(``benchmarks/results/batch_axis/README.md``, stage 2). What is saved: the model's and the optimizer's state dicts
after step K (the learning-rate schedule is a function of the step, so it needs no state; the error buffers of a
LoCo arm start at zero, as when error feedback is switched on) and the run settings that must match on resume.
"""
import os
from dataclasses import dataclass
from typing import Any, Dict

import torch

MATCHED = ("seed", "steps", "size", "text", "nodes", "local", "micro_batch", "lr", "warmup", "dtype")  # run flags a
# resuming run must share with the run that saved the state (the arm and the evaluation may differ)


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
    """The run flags (an ``argparse`` namespace) that a branch must share with its trunk."""
    return {key: getattr(args, key) for key in MATCHED}


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
