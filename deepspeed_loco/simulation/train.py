"""What qgZ / LoCo would do to a training run, simulated on one device: :func:`simulate`.

Every arm trains the same model from the same initial weights on the same batches. Each step, each of the
``W = nodes x local`` virtual ranks computes the gradient of its own micro-batch (a ``1/W`` slice of the step's
batch; by default all ``W`` in one batched pass, ``torch.func.vmap`` over ``torch.func.grad``); the arm's reduce
turns the ``W`` gradients into the mean every ZeRO-3 rank would receive: the exact fp32 mean for ``full``, the
library's own two-hop quantized reduce (:class:`SimulatedCluster`) otherwise. One optimizer then steps the single
replica, as every rank of a data-parallel job applies the same update.
"""
import math
import os
import time
import traceback
import warnings
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch.func import functional_call, grad, vmap

from deepspeed_loco.config import LocoConfig
from deepspeed_loco.runtime.comm.noise_stats import NoiseSample
from deepspeed_loco.simulation.arm_result import ArmResult
from deepspeed_loco.simulation.arms import Arm
from deepspeed_loco.simulation.cluster import SimulatedCluster
from deepspeed_loco.simulation.observer import ReducedStep, StepObserver
from deepspeed_loco.simulation.spec import Batch, SimulationSpec, TrainingSetup, default_loss

# PyTorch's warning that vmap runs an operator without a batching rule as a loop over the batch (the same values,
# slower; scaled-dot-product attention's backward among them): repeated by every process that simulates, and
# documented instead (docs/simulation.md, grad_mode), so a vmap pass does not show it
VMAP_FALLBACK_WARNING = r"There is a performance drop because we have not yet implemented the batching rule"


def simulate(spec: SimulationSpec, observer: Optional[StepObserver] = None,
             on_step: Optional[Callable[[ArmResult, int, float], None]] = None) -> List[ArmResult]:
    """Trains one replica per arm of ``spec`` for ``spec.steps`` optimizer steps and reports how each arm's reduce
    changed training: one :class:`ArmResult` per arm, in ``spec.arms``' order.

    ``spec`` was checked when built (:class:`~deepspeed_loco.simulation.spec.SimulationSpec`). ``observer``: sees
    every step's reduce and may act on it (:class:`~deepspeed_loco.simulation.observer.StepObserver`).
    ``on_step(result, step, loss)``: progress, after each step.

    Raises, during training, ValueError for a ``data_fn`` that runs out before ``steps`` (naming the step) or a
    batch that does not split into ``nodes * local`` micro-batches; TypeError for a ``model_fn`` that returns no
    ``torch.nn.Module`` or a batch that is not a tensor or a tuple of tensors.
    """
    if not isinstance(spec, SimulationSpec):
        raise TypeError(f"simulate: spec = {spec!r} is invalid: it must be a SimulationSpec")
    observer = observer or StepObserver()
    setup = spec.setup
    results = []
    for arm, block, config in zip(spec.arms, spec.blocks, spec.configs):
        cluster = SimulatedCluster(config, setup.nodes, setup.local) if config is not None else None
        shadows = [SimulatedCluster(LocoConfig.from_dict(b), setup.nodes, setup.local)
                   for b in observer.shadow_blocks(arm, block)]
        try:
            results.append(_ArmRun(setup, arm, block, cluster, shadows).train(spec, observer, on_step))
        finally:
            for each in [cluster] * (cluster is not None) + shadows:
                each.close()
    return results


class LossCallError(TypeError):
    """``setup.loss_fn`` failed on a micro-batch, or returned something other than the scalar loss
    (:func:`check_loss_call`)."""


LOSS_CONTRACT = ("it must return the micro-batch's scalar loss (a model whose forward returns logits, or takes other "
                 "arguments, needs a loss_fn that calls it and computes the loss: --loss module:function for "
                 "deepspeed-loco-advise)")


def check_loss_call(setup: TrainingSetup) -> torch.nn.Module:
    """What a run does before its first step, once: builds the model, its optimizer and scheduler as a run does,
    splits the first global batch of a fresh ``data_fn()`` into the ranks' micro-batches and computes
    ``loss_fn(model, micro_batch)`` on the first, on the setup's device under its autocast. Returns the model.

    Raises what a run would raise for the model, optimizer or data (TypeError, ValueError naming them), and
    :class:`LossCallError` where ``loss_fn`` raises (its message, and where in the caller's code it arose, else how
    the loss is called) or returns anything but a 0-dim floating-point tensor that depends on the parameters."""
    model, _, _, _ = _build(setup)
    micro = _split(next(_batches(setup.data_fn, 1)), setup.world_size, setup.device)
    call = (f"model({'*' * isinstance(micro[0], tuple)}micro_batch), the default loss_fn,"
            if setup.loss_fn is default_loss else "loss_fn(model, micro_batch)")
    dtype = setup.autocast_dtype
    try:
        with torch.autocast(device_type=setup.device.type, dtype=dtype, enabled=dtype is not None):
            loss = setup.loss_fn(model, micro[0])
    except Exception as err:  # the caller's code: its error in one line, with where in its code it arose, if it did
        where = _raised_at(err)
        raise LossCallError(f"{call} raised {type(err).__name__}: {' '.join(str(err).split())}"
                            + (f" ({where})" if where else f"; {LOSS_CONTRACT}")) from err
    if not (isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.is_floating_point() and loss.requires_grad):
        raise LossCallError(f"{call} returned {_describe_loss(loss)}; {LOSS_CONTRACT}")
    return model


def _build(setup: TrainingSetup):
    """A run's model (``model_fn()`` on the setup's device), its trainable ``(name, parameter)`` pairs, optimizer and
    scheduler (None without ``scheduler_fn``)."""
    model = setup.model_fn()
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"simulate: model_fn() returned {type(model).__name__}: it must return a torch.nn.Module")
    model = model.to(setup.device)
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    optimizer = setup.optimizer_fn([p for _, p in named])
    scheduler = setup.scheduler_fn(optimizer) if setup.scheduler_fn else None
    return model, named, optimizer, scheduler


def _raised_at(err: BaseException) -> str:
    """``at file.py:12, in forward``: the innermost frame of ``err``'s traceback outside torch and this package
    (the caller's own code), or "" where there is none (the call itself failed, as a wrong number of arguments
    does)."""
    inside = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    frames = [f for f in traceback.extract_tb(err.__traceback__) if not f.filename.startswith(inside)]
    return f"at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}, in {frames[-1].name}" if frames else ""


def _describe_loss(value: Any) -> str:
    """What a loss function returned, in words: ``a tensor of shape (4, 1)``, ``a dict``, ``a tensor that does not
    depend on the parameters``."""
    if not isinstance(value, torch.Tensor):
        return f"a {type(value).__name__}"
    if value.dim() != 0:
        return f"a tensor of shape {tuple(value.shape)}"
    if not value.is_floating_point():
        return f"a {value.dtype} tensor"
    return "a tensor that does not depend on the model's parameters (no gradient)"


class _LossOf(torch.nn.Module):
    """``forward(batch) = loss_fn(model, batch)``, so that ``functional_call`` can swap the model's parameters."""

    def __init__(self, model: torch.nn.Module, loss_fn):
        super().__init__()
        self.model, self.loss_fn = model, loss_fn

    def forward(self, batch):
        return self.loss_fn(self.model, batch)


class _ArmRun:
    """One arm's training loop: ``cluster`` reduces (None for ``full``); ``shadows`` (an observer's) reduce the
    same rank gradients in the same stream."""

    def __init__(self, setup: TrainingSetup, arm: Arm, block: Optional[Dict[str, Any]],
                 cluster: Optional[SimulatedCluster], shadows: List[SimulatedCluster]):
        self.setup, self.arm, self.block, self.cluster, self.shadows = setup, arm, block, cluster, shadows
        self.clusters = [cluster] * (cluster is not None) + shadows  # every cluster the rank gradients go through
        self.device, self.world, self.local = setup.device, setup.world_size, setup.local
        self.rank_chunk = setup.rank_chunk or self.world
        self.forward_model: Optional[torch.nn.Module] = None  # the model the "loop" passes call (compiled or not)

    def train(self, spec: SimulationSpec, observer: StepObserver, on_step) -> ArmResult:
        setup, steps = self.setup, spec.steps
        torch.manual_seed(spec.seed)
        model, named, optimizer, scheduler = _build(setup)
        self.forward_model = torch.compile(model, backend=setup.compile) if setup.compile else model
        params = [p for _, p in named]
        result = ArmResult(self.arm.key, self.arm.label, spec.seed, self.block, world_size=self.world)
        numel = sum(p.numel() for p in params)
        result.full_precision_bytes_per_step = (self.world - 1) / self.world * numel * 4
        sums = _RunningSums(numel, self.device)
        wrapper = _LossOf(model, setup.loss_fn)
        data = _batches(setup.data_fn, steps)
        started, evaluating = time.monotonic(), 0.0
        for step in range(1, steps + 1):
            micro = _split(next(data), self.world, self.device)
            result.rank_batch = result.rank_batch or _leading_size(micro[0])
            measured = self._measures_noise(step)
            if measured:
                self.cluster.measure_noise(step)
            exact, spread, losses, means = self._step_gradients(model, wrapper, named, micro)
            if measured:
                self._record_noise(result, step, self.cluster.noise_totals(self.device))
            comm = means[0] if self.cluster is not None else exact
            observer.after_reduce(ReducedStep(step, self.arm, result, self.cluster, exact, comm,
                                              means[1:] if self.cluster is not None else means))
            fidelity = sums.add(comm, exact)  # before clipping scales the gradients in place
            for p, g in zip(params, comm):
                p.grad = g.to(p.dtype)
            if setup.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(params, setup.grad_clip)
            lr = optimizer.param_groups[0]["lr"]
            before = torch.nn.utils.parameters_to_vector(params).detach().float()
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            for cluster in self.clusters:
                cluster.on_optimizer_step()
            moved = (torch.nn.utils.parameters_to_vector(params).detach().float() - before) / lr
            _StepStats.of(fidelity, spread, moved).append_to(result)
            result.train_losses.append(sum(losses.tolist()) / self.world)
            if setup.eval_fn is not None and ((setup.eval_every and step % setup.eval_every == 0) or step == steps):
                eval_start = time.monotonic()
                model.eval()
                with torch.no_grad():
                    result.validation.append((step, float(setup.eval_fn(model))))
                model.train()
                evaluating += time.monotonic() - eval_start
            if on_step is not None:
                on_step(result, step, result.train_losses[-1])
        result.wall_s = time.monotonic() - started - evaluating
        result.bytes_per_step = (sum(r.stats.total_bytes for r in self.cluster.reducers) / self.world / steps
                                 if self.cluster is not None else result.full_precision_bytes_per_step)
        return result

    def _step_gradients(self, model, wrapper, named, micro: List[Batch]):
        """One step's exact mean gradient, ``[mean over ranks of ||g_rank||^2, ||g_exact||^2]``, the ``W`` micro-batch
        losses and each cluster's communicated mean.

        The ranks' gradients are computed block by block (a node of ``L`` ranks with ``stream_nodes``, else all
        ``W``) and each block goes into every cluster's reduce before the next is computed; the exact mean is summed
        node by node and the norms are taken per node in both cases, so the two give the same bits."""
        names = [name for name, _ in named]
        block = self.local if self.setup.stream_nodes else self.world
        sums, rank_sq, losses = None, [], []
        with ExitStack() as stack:
            reduces = [stack.enter_context(cluster.stream(names)) for cluster in self.clusters]
            for start in range(0, self.world, block):
                stacked, block_losses = self._rank_grads(model, wrapper, named, micro[start:start + block])
                for node in range(0, block, self.local):
                    node_grads = [g[node:node + self.local] for g in stacked]
                    sums = [g.sum(0) for g in node_grads] if sums is None else [
                        total.add_(g.sum(0)) for total, g in zip(sums, node_grads)]
                    rank_sq.append(sum(g.double().pow(2).flatten(1).sum(1) for g in node_grads))
                losses.append(block_losses)
                for reduce in reduces:
                    reduce.add([[g[rank] for g in stacked] for rank in range(len(stacked[0]))])
                del stacked, node_grads  # the reduces hold the block's gradients until their first hop is done
                for reduce in reduces:
                    reduce.wait_released()
        exact = [total / self.world for total in sums]
        spread = torch.stack([torch.cat(rank_sq).mean(), sum(g.double().pow(2).sum() for g in exact)])
        return exact, spread, torch.cat(losses), [reduce.mean_gradients() for reduce in reduces]

    def _rank_grads(self, model, wrapper, named, micro: List[Batch]) -> Tuple[List[torch.Tensor], torch.Tensor]:
        """The fp32 gradients of the ranks of ``micro``, stacked per parameter ``(len(micro), *shape)``, and their
        micro-batch losses."""
        dtype = self.setup.autocast_dtype
        autocast = dict(device_type=self.device.type, dtype=dtype, enabled=dtype is not None)
        if self.setup.grad_mode == "vmap":
            def loss_of(weights, batch):
                with torch.autocast(**autocast):
                    loss = functional_call(wrapper, weights, (batch, ))
                return loss, loss.detach()

            weights = {f"model.{name}": p.detach() for name, p in named}
            per_rank = vmap(grad(loss_of, has_aux=True), in_dims=(None, 0), randomness="different")
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=VMAP_FALLBACK_WARNING, category=UserWarning)
                chunks = [per_rank(weights, _stack(micro[start:start + self.rank_chunk]))
                          for start in range(0, len(micro), self.rank_chunk)]
            grads = [_cat([g[f"model.{name}"] for g, _ in chunks]).float() for name, _ in named]
            return grads, _cat([losses for _, losses in chunks]).float()
        grads, losses = [], []
        for batch in micro:
            model.zero_grad(set_to_none=True)
            with torch.autocast(**autocast):
                loss = self.setup.loss_fn(self.forward_model, batch)
            loss.backward()
            grads.append([torch.zeros_like(p, dtype=torch.float32) if p.grad is None else p.grad.detach().float()
                          for _, p in named])
            losses.append(loss.detach().float())
        model.zero_grad(set_to_none=True)
        return [torch.stack([g[i] for g in grads]) for i in range(len(named))], torch.stack(losses)

    def _measures_noise(self, step: int) -> bool:
        """Whether step ``step`` is one the arm's ``rho_every`` measures (qgZ arms with hops only)."""
        every = self.cluster.config.rho_every if self.cluster is not None else 0
        return bool(every) and step % every == 0 and bool(self.cluster.plan.hops)

    def _record_noise(self, result: ArmResult, step: int, totals: torch.Tensor) -> None:
        sample = NoiseSample.from_totals(totals, len(self.cluster.plan.hops), self.world, 1)
        if sample is not None:  # not finite: an overflow, skipped as a real run skips it
            result.live_rho_steps.append(step)
            result.live_hop_error_sq.append(list(sample.hop_error_sq))
            result.live_noise_sq.append(sample.noise_sq)
            result.live_grad_sq.append(sample.grad_sq)


class _RunningSums:
    """The running sums of the communicated and the exact mean gradients (fp64, flattened, on the device)."""

    def __init__(self, numel: int, device: torch.device):
        self.comm = torch.zeros(numel, dtype=torch.float64, device=device)
        self.exact = torch.zeros(numel, dtype=torch.float64, device=device)

    def add(self, comm: List[torch.Tensor], exact: List[torch.Tensor]) -> torch.Tensor:
        """Adds this step; returns, on the device, the squared norms of the step's error and of the exact mean, the
        same for the running sums, and the share of nonzero coordinates in the communicated mean."""
        comm_flat, exact_flat = _flat(comm), _flat(exact)
        self.comm.add_(comm_flat)
        self.exact.add_(exact_flat)
        return torch.stack([(comm_flat - exact_flat).pow(2).sum(), exact_flat.pow(2).sum(),
                            (self.comm - self.exact).pow(2).sum(), self.exact.pow(2).sum(),
                            (comm_flat != 0).double().mean()])


@dataclass(frozen=True)
class _StepStats:
    """One step's statistics on the host, as :class:`ArmResult` records them."""
    error_sq: float
    exact_sq: float
    sum_error_sq: float
    sum_exact_sq: float
    nonzero_fraction: float
    rank_grad_sq: float
    mean_grad_sq: float
    update_rms: float

    @classmethod
    def of(cls, fidelity: torch.Tensor, spread: torch.Tensor, moved: torch.Tensor) -> "_StepStats":
        """From :meth:`_RunningSums.add`'s fidelity, the gradient spread and the parameter change over the learning
        rate (one host sync)."""
        return cls(*torch.cat([fidelity, spread, moved.double().pow(2).mean().sqrt().view(1)]).tolist())

    def append_to(self, result: ArmResult) -> None:
        result.rank_grad_sq.append(self.rank_grad_sq)
        result.mean_grad_sq.append(self.mean_grad_sq)
        result.grad_rel_errors.append(_ratio(self.error_sq, self.exact_sq))
        result.sum_rel_errors.append(_ratio(self.sum_error_sq, self.sum_exact_sq))
        result.nonzero_fractions.append(self.nonzero_fraction)
        result.update_rms.append(self.update_rms)


def _flat(tensors: List[torch.Tensor]) -> torch.Tensor:
    """The tensors flattened into one fp64 vector."""
    return torch.cat([t.reshape(-1) for t in tensors]).double()


def gradient_noise_scale(result: ArmResult, first_step: int = 1) -> Optional[float]:
    """The simple gradient noise scale ``B = tr(Sigma) / ||G||^2`` (McCandlish et al. 2018), in units of
    ``rank_batch`` (sequences or samples), estimated from steps ``first_step..`` of ``result``.

    A rank's gradient has ``E||g_r||^2 = ||G||^2 + tr(Sigma) / b`` and the exact mean over ``W`` ranks
    ``||G||^2 + tr(Sigma) / (W b)``; both sides are averaged over the steps before the ratio is taken (as the paper
    advises). None with one rank, no steps, or a non-positive ``||G||^2`` estimate (noise swamps the signal).
    """
    small, big = result.rank_grad_sq[first_step - 1:], result.mean_grad_sq[first_step - 1:]
    if not small or result.rank_batch < 1 or len(small) != len(big):
        return None
    ranks = result.world_size
    if ranks < 2:
        return None
    b, total = result.rank_batch, result.rank_batch * ranks
    small_sq, big_sq = sum(small) / len(small), sum(big) / len(big)
    signal = (total * big_sq - b * small_sq) / (total - b)
    noise = (small_sq - big_sq) / (1 / b - 1 / total)
    return noise / signal if signal > 0 else None


def _ratio(num_sq: float, den_sq: float) -> float:
    return math.sqrt(num_sq / den_sq) if den_sq > 0 else 0.0


def _leading_size(batch: Batch) -> int:
    """Dim 0 of a micro-batch (of its first tensor)."""
    return (batch[0] if isinstance(batch, tuple) else batch).shape[0]


def _cat(parts: List[torch.Tensor]) -> torch.Tensor:
    """``torch.cat`` along dim 0 that returns a single part as it is (no copy)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _batches(data_fn, steps: int) -> Iterator[Batch]:
    """``data_fn()``'s batches, one per step; raises ValueError naming the step where they run out."""
    batches = data_fn()
    try:
        data = iter(batches)
    except TypeError:
        raise TypeError(f"simulate: data_fn() returned {type(batches).__name__}: it must return an iterable of "
                        f"batches") from None
    for step in range(1, steps + 1):
        try:
            yield next(data)
        except StopIteration:
            raise ValueError(f"simulate: data_fn() ran out of batches at step {step} of steps = {steps}: it must "
                             f"yield at least {steps} batches (one per step)") from None


def _split(batch: Batch, world: int, device: torch.device) -> List[Batch]:
    """The ``world`` micro-batches of a global batch (dim 0 split evenly), on ``device``."""
    tensors = batch if isinstance(batch, tuple) else (batch, )
    if not tensors or not all(isinstance(t, torch.Tensor) and t.dim() > 0 for t in tensors):
        raise TypeError(f"simulate: a batch from data_fn is {_describe(batch)}: it must be a tensor or a tuple of "
                        f"tensors, each with the global batch on dim 0")
    sizes = {t.shape[0] for t in tensors}
    size = tensors[0].shape[0]
    if len(sizes) > 1 or size == 0 or size % world:
        raise ValueError(f"simulate: a global batch of {'/'.join(map(str, sorted(sizes)))} does not split into "
                         f"{world} equal micro-batches: dim 0 of every tensor must be the same multiple of "
                         f"nodes * local = {world}")
    parts = [t.to(device).chunk(world) for t in tensors]
    micro = list(zip(*parts))
    return micro if isinstance(batch, tuple) else [m[0] for m in micro]


def _describe(batch) -> str:
    """A batch's type in words: ``"a list"``, ``"a tuple of (Tensor, int)"``, ``"a 0-dim tensor"``."""
    if isinstance(batch, torch.Tensor):
        return "a 0-dim tensor"
    if isinstance(batch, tuple):
        return f"a tuple of ({', '.join(type(t).__name__ for t in batch)})"
    return f"a {type(batch).__name__}"


def _stack(micro: List[Batch]) -> Batch:
    """The micro-batches stacked on a new leading rank dimension."""
    if isinstance(micro[0], tuple):
        return tuple(torch.stack(parts) for parts in zip(*micro))
    return torch.stack(micro)
