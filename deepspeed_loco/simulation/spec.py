"""What a simulation runs, fixed and checked once: :class:`TrainingSetup` (the model, data, optimizer, layout, LoCo
block, device and precision of a study) and :class:`SimulationSpec` (a setup, its arms, steps and seed).

Both are frozen dataclasses validated in ``__post_init__`` (:mod:`~deepspeed_loco.simulation.checks`): a bad field
raises TypeError or ValueError naming it and what would be valid, before anything trains; a ``loco`` block that no
arm could run with raises :class:`~deepspeed_loco.config.LocoConfigError`. ``dataclasses.replace`` gives a changed
copy, checked again.
"""
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Tuple, Union

import torch

from deepspeed_loco.config import LocoConfig
from deepspeed_loco.simulation.arms import Arm
from deepspeed_loco.simulation.checks import check_run, check_setup

Batch = Union[torch.Tensor, Tuple[torch.Tensor, ...]]


def default_loss(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """``model(*batch)`` (or ``model(batch)``), which must return the scalar loss."""
    return model(*batch) if isinstance(batch, tuple) else model(batch)


def default_optimizer(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW at lr 1e-3, torch's other defaults."""
    return torch.optim.AdamW(params, lr=1e-3)


@dataclass(frozen=True)
class TrainingSetup:
    """The training every arm of a study shares.

    ``model_fn()``: a fresh ``torch.nn.Module`` (called under ``torch.manual_seed(seed)``, so every arm starts
    alike). ``data_fn()``: a fresh iterator of global batches (a tensor or a tuple of tensors whose dim 0 splits into
    ``nodes * local`` equal micro-batches), the same sequence on every call, at least ``steps`` long.
    ``nodes`` x ``local``: the simulated layout (integers >= 1). ``loco``: the other keys of ``zeropp_loco_param``
    (``group_size``, ``err_beta``, ``reset_T``, ``error_bits``, ``quant_grid``); not ``local_world_size`` (that is
    ``local``) nor the keys each arm's name sets (bits per hop, ``hadamard``, ``error_feedback``), except
    ``error_feedback: "inter_node"``, which narrows every LoCo arm's error feedback to that hop; kept as a copy.
    ``optimizer_fn(params)`` builds the optimizer; ``scheduler_fn(optimizer)`` (None: none) is stepped once per
    step. ``loss_fn(model, micro_batch)``: the scalar loss. ``eval_fn(model) -> float`` runs every ``eval_every``
    steps (0: only after the last; > 0 needs ``eval_fn``) and after the last. ``grad_clip``: None, or clip the
    communicated mean's global norm to this number > 0. ``device``: one torch can use here (stored as a
    ``torch.device``). ``autocast_dtype``: None, or forward/backward under ``torch.autocast`` in
    ``torch.bfloat16``/``torch.float16``. ``grad_mode``: "vmap" (one batched pass over the ranks' micro-batches;
    the model must be functional: no in-place buffer updates such as batch norm's running statistics; random ops get
    a different draw per rank) or "loop" (one backward per rank, any model). ``rank_chunk``: None, or "vmap" mode
    computes this many ranks (>= 1) per batched pass (default: all ``W``), which bounds the activation memory of a
    large ``W`` (``docs/simulation.md``). ``stream_nodes``: compute the gradients node by node and push each node's
    through its first hop before the next node's are computed (at most one node's fp32 gradients alive); the result
    is the same, bit for bit, when ``rank_chunk`` divides ``local`` (the same batched passes). ``compile``: None, or
    the ``torch.compile`` backend (e.g. ``"inductor"``) that compiles the model for the ranks' passes in "loop" mode
    (fused kernels: faster on a GPU, the same function up to floating-point rounding; evaluation stays eager).
    """
    model_fn: Callable[[], torch.nn.Module]
    data_fn: Callable[[], Iterable[Batch]]
    nodes: int = 2
    local: int = 2
    loco: Mapping[str, Any] = field(default_factory=dict)
    optimizer_fn: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer] = default_optimizer
    scheduler_fn: Optional[Callable[[torch.optim.Optimizer], Any]] = None
    loss_fn: Callable[[torch.nn.Module, Batch], torch.Tensor] = default_loss
    eval_fn: Optional[Callable[[torch.nn.Module], float]] = None
    eval_every: int = 0
    device: Union[str, torch.device] = "cpu"
    grad_clip: Optional[float] = None
    autocast_dtype: Optional[torch.dtype] = None
    grad_mode: str = "vmap"
    rank_chunk: Optional[int] = None
    stream_nodes: bool = False
    compile: Optional[str] = None

    def __post_init__(self):
        loco, device = check_setup(self)
        object.__setattr__(self, "loco", loco)
        object.__setattr__(self, "device", device)

    @property
    def world_size(self) -> int:
        return self.nodes * self.local


@dataclass(frozen=True)
class SimulationSpec:
    """One simulation: ``setup``'s training for each of ``arms`` over ``steps`` optimizer steps from seed ``seed``.

    ``arms``: a non-empty list of distinct arms, names such as ``"full"``, ``"plain4"``, ``"loco8-2h"``
    (:data:`~deepspeed_loco.simulation.arms.GRAMMAR`) or :class:`Arm` objects, stored parsed as a tuple of
    :class:`Arm`. ``steps`` >= 1, ``seed`` >= 0. ``blocks`` (derived): each arm's ``zeropp_loco_param`` block, None
    for ``full``; ``configs`` (derived): the same as :class:`~deepspeed_loco.config.LocoConfig` objects, parsed
    once here.
    """
    setup: TrainingSetup
    arms: Tuple[Arm, ...]
    steps: int
    seed: int = 0
    blocks: Tuple[Optional[Dict[str, Any]], ...] = field(init=False, repr=False, compare=False)
    configs: Tuple[Optional[LocoConfig], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if not isinstance(self.setup, TrainingSetup):
            raise TypeError(f"SimulationSpec: setup = {self.setup!r} is invalid: it must be a TrainingSetup")
        arms, blocks, configs = check_run(self)
        object.__setattr__(self, "arms", arms)
        object.__setattr__(self, "blocks", blocks)
        object.__setattr__(self, "configs", configs)
