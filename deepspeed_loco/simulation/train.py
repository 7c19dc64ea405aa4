"""What qgZ / LoCo would do to a training run, simulated on one device: :func:`simulate`.

Every arm trains the same model from the same initial weights on the same batches. Each step, each of the
``W = nodes x local`` virtual ranks computes the gradient of its own micro-batch (a ``1/W`` slice of the step's
batch); the arm's reduce turns the ``W`` gradients into the mean every ZeRO-3 rank would receive: the exact fp32
mean for ``full``, the library's own two-hop quantized reduce (:class:`SimulatedCluster`) otherwise. One optimizer
then steps the single replica, as every rank of a data-parallel job applies the same update.
"""
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from deepspeed_loco.config import LocoConfig
from deepspeed_loco.simulation.arms import Arm, parse_arm, zeropp_loco_param
from deepspeed_loco.simulation.cluster import SimulatedCluster

Batch = Union[torch.Tensor, Tuple[torch.Tensor, ...]]


@dataclass
class ArmResult:
    """One arm's run. Losses are means over the ``W`` micro-batches; ``validation`` holds ``(step, loss)`` from
    ``eval_fn``; ``grad_rel_errors[t]``: ``||g_comm - g_exact|| / ||g_exact||`` at step ``t + 1``;
    ``sum_rel_errors[t]``: the same for the running sums of both up to step ``t + 1`` (where error feedback shows);
    ``bytes_per_step``: what one rank sends per step on all hops (0 for ``full``), against
    ``full_precision_bytes_per_step``, a fp32 reduce-scatter's ``(W - 1) / W * N * 4``; ``wall_s``: training
    time, evaluation excluded."""
    key: str
    label: str
    seed: int
    train_losses: List[float] = field(default_factory=list)
    validation: List[Tuple[int, float]] = field(default_factory=list)
    grad_rel_errors: List[float] = field(default_factory=list)
    sum_rel_errors: List[float] = field(default_factory=list)
    bytes_per_step: float = 0.0
    full_precision_bytes_per_step: float = 0.0
    wall_s: float = 0.0

    @property
    def final_val_loss(self) -> Optional[float]:
        return self.validation[-1][1] if self.validation else None

    def to_dict(self) -> Dict[str, Any]:
        return dict(asdict(self), final_val_loss=self.final_val_loss)


def default_loss(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """``model(*batch)`` (or ``model(batch)``), which must return the scalar loss."""
    return model(*batch) if isinstance(batch, tuple) else model(batch)


def simulate(model_fn: Callable[[], torch.nn.Module], data_fn: Callable[[], Iterable[Batch]],
             arms: Sequence[Union[str, Arm]], steps: int, nodes: int = 2, local: int = 2,
             loco: Optional[Dict[str, Any]] = None,
             optimizer_fn: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer] = None,
             scheduler_fn: Optional[Callable[[torch.optim.Optimizer], Any]] = None,
             loss_fn: Callable[[torch.nn.Module, Batch], torch.Tensor] = default_loss,
             eval_fn: Optional[Callable[[torch.nn.Module], float]] = None, eval_every: int = 0,
             device: Union[str, torch.device] = "cpu", seed: int = 0, grad_clip: Optional[float] = None,
             autocast_dtype: Optional[torch.dtype] = None,
             on_step: Optional[Callable[[ArmResult, int, float], None]] = None) -> List[ArmResult]:
    """Trains one replica per arm for ``steps`` optimizer steps and reports how each arm's reduce changed training.

    ``model_fn()``: a fresh model (called under ``torch.manual_seed(seed)``, so every arm starts alike).
    ``data_fn()``: a fresh iterator of global batches (a tensor or a tuple of tensors whose dim 0 is split into
    ``nodes * local`` equal micro-batches), the same sequence for every arm. ``arms``: e.g. ``"full"``,
    ``"plain4"``, ``"loco8-2h"`` (:data:`~deepspeed_loco.simulation.arms.GRAMMAR`). ``loco``: the other keys of
    ``zeropp_loco_param`` (``group_size``, ``err_beta``, ``reset_T``, ``error_bits``, ``quant_grid``).
    ``optimizer_fn`` (default AdamW, lr 1e-3) and ``scheduler_fn`` (stepped once per step) build the optimizer.
    ``eval_fn(model) -> float`` runs every ``eval_every`` steps and after the last. ``grad_clip``: clip the
    communicated mean's global norm. ``autocast_dtype``: forward/backward under ``torch.autocast``.
    ``on_step(result, step, loss)``: progress.
    """
    if steps < 1:
        raise ValueError(f"simulate: steps = {steps!r}, it must be >= 1")
    parsed = [parse_arm(a) if isinstance(a, str) else a for a in arms]
    optimizer_fn = optimizer_fn or (lambda params: torch.optim.AdamW(params, lr=1e-3))
    results = []
    for arm in parsed:
        config = zeropp_loco_param(arm, **(loco or {}), local_world_size=local)
        cluster = SimulatedCluster(LocoConfig.from_dict(config), nodes, local) if config else None
        try:
            results.append(_train_arm(arm, cluster, nodes * local, model_fn, data_fn, steps, optimizer_fn,
                                      scheduler_fn, loss_fn, eval_fn, eval_every, torch.device(device), seed,
                                      grad_clip, autocast_dtype, on_step))
        finally:
            if cluster is not None:
                cluster.close()
    return results


def _train_arm(arm: Arm, cluster: Optional[SimulatedCluster], world: int, model_fn, data_fn, steps, optimizer_fn,
               scheduler_fn, loss_fn, eval_fn, eval_every, device, seed, grad_clip, autocast_dtype,
               on_step) -> ArmResult:
    torch.manual_seed(seed)
    model = model_fn().to(device)
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    names = [name for name, _ in named]
    optimizer = optimizer_fn([p for _, p in named])
    scheduler = scheduler_fn(optimizer) if scheduler_fn else None
    result = ArmResult(arm.key, arm.label, seed)
    numel = sum(p.numel() for _, p in named)
    result.full_precision_bytes_per_step = (world - 1) / world * numel * 4
    sums = {"comm": [torch.zeros_like(p, dtype=torch.float64) for _, p in named],
            "exact": [torch.zeros_like(p, dtype=torch.float64) for _, p in named]}
    data: Iterator[Batch] = iter(data_fn())
    started, evaluating = time.monotonic(), 0.0
    for step in range(1, steps + 1):
        micro_batches = _split(next(data), world, device)
        grads, losses = [], []
        for batch in micro_batches:
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                loss = loss_fn(model, batch)
            loss.backward()
            grads.append([torch.zeros_like(p, dtype=torch.float32) if p.grad is None else p.grad.detach().float().clone()
                          for _, p in named])
            losses.append(float(loss.detach()))
        exact = [torch.stack([g[i] for g in grads]).sum(0) / world for i in range(len(named))]
        comm = exact if cluster is None else cluster.mean_gradients(grads, names)
        _track_fidelity(result, sums, comm, exact)
        for (_, p), g in zip(named, comm):
            p.grad = g.to(p.dtype)
        if grad_clip:
            torch.nn.utils.clip_grad_norm_([p for _, p in named], grad_clip)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        if cluster is not None:
            cluster.on_optimizer_step()
        result.train_losses.append(sum(losses) / len(losses))
        if eval_fn is not None and ((eval_every and step % eval_every == 0) or step == steps):
            eval_start = time.monotonic()
            model.eval()
            with torch.no_grad():
                result.validation.append((step, float(eval_fn(model))))
            model.train()
            evaluating += time.monotonic() - eval_start
        if on_step is not None:
            on_step(result, step, result.train_losses[-1])
    result.wall_s = time.monotonic() - started - evaluating
    if cluster is not None:
        result.bytes_per_step = sum(r.stats.total_bytes for r in cluster.reducers) / world / steps
    return result


def _split(batch: Batch, world: int, device: torch.device) -> List[Batch]:
    """The ``world`` micro-batches of a global batch (dim 0 split evenly), on ``device``."""
    tensors = batch if isinstance(batch, tuple) else (batch, )
    size = tensors[0].shape[0]
    if size % world:
        raise ValueError(f"simulate: a global batch of {size} does not split into {world} equal micro-batches")
    parts = [t.to(device).chunk(world) for t in tensors]
    micro = list(zip(*parts))
    return micro if isinstance(batch, tuple) else [m[0] for m in micro]


def _track_fidelity(result: ArmResult, sums: Dict[str, List[torch.Tensor]], comm: Sequence[torch.Tensor],
                    exact: Sequence[torch.Tensor]) -> None:
    """Appends this step's relative error of the communicated mean and of the running sums."""
    result.grad_rel_errors.append(_rel_error(comm, exact))
    for total, values in ((sums["comm"], comm), (sums["exact"], exact)):
        for acc, value in zip(total, values):
            acc += value.double()
    result.sum_rel_errors.append(_rel_error(sums["comm"], sums["exact"]))


def _rel_error(approx: Sequence[torch.Tensor], exact: Sequence[torch.Tensor]) -> float:
    num = sum(float((a.double() - e.double()).pow(2).sum()) for a, e in zip(approx, exact))
    den = sum(float(e.double().pow(2).sum()) for e in exact)
    return math.sqrt(num / den) if den > 0 else 0.0
