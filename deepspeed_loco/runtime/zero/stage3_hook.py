"""LoCo attached to one DeepSpeed ZeRO-3 optimizer: topology, hop plan (built once, here), error-feedback state,
reducer, the step rules (reset every ``reset_T`` optimizer steps, rescale on an fp16 loss-scale change, clear
on overflow), the live rho (:class:`~deepspeed_loco.runtime.comm.noise_stats.LiveRho`) and the observers of the
reduce (:meth:`LocoHook.add_reduce_observer`).

Every touch of DeepSpeed itself goes through :mod:`deepspeed_loco.runtime.zero.deepspeed_seam`.
"""
import itertools
import logging
from typing import Callable, Dict, List, Mapping, Optional, Sequence

import torch

from deepspeed_loco.config import LocoConfig
from deepspeed_loco.layout import HopPlan, describe_hop_cost
from deepspeed_loco.ops import kernels_for
from deepspeed_loco.runtime.zero import deepspeed_seam
from deepspeed_loco.runtime.comm.loco_reduce import LocoReducer
from deepspeed_loco.runtime.comm.noise_stats import LiveRho
from deepspeed_loco.runtime.comm import topology
from deepspeed_loco.runtime.comm.topology import LocoTopology
from deepspeed_loco.runtime.zero import checkpoint, telemetry
from deepspeed_loco.runtime.zero.regime_note import regime_note
from deepspeed_loco.runtime.comm.error_feedback import ErrorFeedbackState
from deepspeed_loco.utils.logging import log_rank0, logger

ENGINE_ATTRIBUTE = "loco_hook"
HOP_LABELS = {"intra_node": "intra-node", "inter_node": "inter-node"}
# observer(names, grads, partitions), called after every bucket reduce
ReduceObserver = Callable[[Sequence[str], Sequence[torch.Tensor], Sequence[torch.Tensor]], None]


def resolve_local_size(config: LocoConfig, world_size: int) -> int:
    """Ranks per node of this job (:func:`~deepspeed_loco.runtime.comm.topology.ranks_per_node` with the
    accelerator count)."""
    return topology.ranks_per_node(config.local_world_size, world_size, deepspeed_seam.local_device_count())


def check_hpz_partition(ds_config: Mapping, config: LocoConfig) -> None:
    """LoCo's check of ``zero_optimization.zero_hpz_partition_size`` against the job's world size and ranks per
    node (:func:`~deepspeed_loco.runtime.comm.topology.check_hpz_partition`); needs the process group."""
    world_size = torch.distributed.get_world_size()
    hpz = ds_config.get("zero_optimization", {}).get("zero_hpz_partition_size", 1)
    topology.check_hpz_partition(hpz, world_size, resolve_local_size(config, world_size))


def describe_wire(plan: HopPlan) -> str:
    """The start-up line's wire figures: bytes per gradient element each hop puts on the wire, scales included, or
    ``n/a`` for a hop this layout does not have (``L == 1``: no intra-node hop; ``M == 1``: no inter-node hop)."""
    hops = {hop.name: hop for hop in plan.hops}
    figures = (f"{label} {describe_hop_cost(hops[name].bits, plan.group_size) if name in hops else 'n/a'}"
               for name, label in HOP_LABELS.items())
    return "wire per element: " + ", ".join(figures)


class ObserverHandle:
    """What :meth:`LocoHook.add_reduce_observer` returns: :meth:`remove` unregisters that observer."""

    def __init__(self, observers: Dict[int, ReduceObserver], key: int):
        self._observers, self._key = observers, key

    def remove(self) -> None:
        """The observer is not called again; a second call does nothing."""
        self._observers.pop(self._key, None)


class LocoHook:
    """LoCo attached to one ZeRO-3 optimizer: its topology, hop plan (built once from the config), error-feedback
    state and reducer (both given that plan), and the observers of its reduce.

    ``named_params`` (``{name: parameter}``, default the optimizer's ``param_names``) names the parameters: the
    state keeps each one's error buffers, and checkpoints save them, under that name.
    """

    def __init__(self, optimizer, config: LocoConfig, named_params: Optional[Mapping[str, torch.Tensor]] = None):
        self.optimizer = optimizer
        self.config = config
        group = deepspeed_seam.data_parallel_group(optimizer)
        world_size = torch.distributed.get_world_size(group)
        self.topology = LocoTopology.build(group, local_size=resolve_local_size(config, world_size))
        self.reducer = LocoReducer.for_topology(config, self.topology)
        self.plan: HopPlan = self.reducer.plan
        self.state: ErrorFeedbackState = self.reducer.state
        self.telemetry: Optional[telemetry.LocoTelemetry] = None  # set by attach() when a DeepSpeed monitor is on
        self.live_rho: Optional[LiveRho] = None  # set by attach() (it needs the engine's batch sizes)
        self._observers: Dict[int, ReduceObserver] = {}  # by registration number, called in that order
        self._observer_keys = itertools.count()
        named = dict(named_params) if named_params is not None else deepspeed_seam.param_names(optimizer)
        self._names: Dict[torch.Tensor, str] = {param: name for name, param in named.items()}
        self.patch = patch_optimizer(optimizer, self.state, named, self._reduce, self._after_step)

    def _names_of(self, params: Sequence[torch.Tensor]) -> List[str]:
        """The names of ``params``; RuntimeError for a parameter the model does not name."""
        unnamed = [deepspeed_seam.param_id(p) for p in params if p not in self._names]
        if unnamed:
            raise RuntimeError(f"deepspeed-loco: parameter(s) with ds_id {unnamed} are not named parameters of the "
                               f"model; LoCo keeps (and checkpoints) error-feedback buffers by parameter name")
        return [self._names[p] for p in params]

    def add_reduce_observer(self, observer: ReduceObserver) -> ObserverHandle:
        """Calls ``observer(names, grads, partitions)`` after every bucket reduce, once per bucket, in registration
        order: ``names`` the bucket's parameter names, ``grads`` the full gradients fed into the reduce (in the
        communication dtype), ``partitions`` this rank's mean partitions the reducer returned (``ceil(N / W)``
        elements each, in the gradients' dtype, before the seam's expert-group and accumulation-dtype corrections).
        The observer must not modify them. ``.remove()`` on the handle stops it."""
        key = next(self._observer_keys)
        self._observers[key] = observer
        return ObserverHandle(self._observers, key)

    def _reduce(self, params, grads):
        names = self._names_of(params)
        partitions = self.reducer.reduce_scatter(names, grads)
        for observer in list(self._observers.values()):
            observer(names, grads, partitions)
        return partitions

    def _after_step(self, overflow: bool, scale_ratio: float) -> None:
        if overflow:
            self.state.reset()
        elif scale_ratio != 1.0:
            self.state.rescale(scale_ratio)
        reset = self.state.on_optimizer_step()
        if reset:
            logger.debug(f"LoCo: error buffers reset at optimizer step {self.state.step} "
                         f"(reset_T={self.config.reset_T})")
        estimate = self.live_rho.on_step(self.state.step) if self.live_rho else None
        if self.telemetry:
            self.telemetry.on_step(self.state.step, reset or overflow, estimate)

    def detach(self) -> None:
        """Gives the optimizer back its stock reduce, step and checkpoint methods; one that something wrapped again
        after LoCo keeps that wrapper, with LoCo's under it passing calls through (``OptimizerPatch.restore``)."""
        self.patch.restore()

    def planned_buffer_bytes(self, params) -> int:
        """Error-buffer bytes this rank will hold for ``params`` (ZeRO-3 parameters with ``ds_numel``)."""
        return sum(self.state.planned_bytes(deepspeed_seam.param_numel(p)) for p in params)

    def describe(self, params) -> str:
        """The start-up line: mode, layout, bits, group size, hadamard, the wire cost of each hop
        (:func:`describe_wire`), ``err_beta``/``reset_T``, this rank's error-buffer memory, the kernels and how often
        the live rho is measured (``rho_every``)."""
        topo, cfg = self.topology, self.config
        numel = sum(deepspeed_seam.param_numel(p) for p in params)
        buffer_bytes = self.planned_buffer_bytes(params)
        kernels = kernels_for(deepspeed_seam.current_device(), cfg.kernels).name
        mode = "LoCo error feedback" if cfg.error_feedback else "plain qgZ (error feedback off)"
        return (f"deepspeed-loco active: {mode}; {topo.describe()}; bits intra/inter {cfg.intra_node_bits}/"
                f"{cfg.inter_node_bits}, group {cfg.group_size}, grid {self.plan.grid}"
                f"{' (auto)' if cfg.quant_grid == 'auto' else ''}, hadamard "
                f"{'on' if cfg.hadamard else 'off'}; {describe_wire(self.plan)}; err_beta {cfg.err_beta}, reset_T "
                f"{cfg.reset_T}; error buffers {buffer_bytes / 2**20:.2f} MiB ({buffer_bytes / max(numel, 1):.3f} B "
                f"per parameter element, {self.state.storage.label}) on this rank; kernels: {kernels}; live rho "
                f"{f'every {cfg.rho_every} steps' if cfg.rho_every else 'off'}")


def patch_optimizer(optimizer, state: ErrorFeedbackState, names: Mapping[str, torch.Tensor], reduce, after_step):
    """Routes ``optimizer``'s bucket reduce to ``reduce``, its steps to ``after_step`` and its checkpoints through
    ``state`` (whose parameter names ``names`` maps to the model's parameters)."""
    patch = deepspeed_seam.OptimizerPatch(
        optimizer, reduce=reduce, after_step=after_step, save=lambda: checkpoint.state_dict(state, names),
        decide=lambda entry, universal, load_optimizer_states: checkpoint.decide_load(
            state, entry, names, universal, load_optimizer_states),
        apply=lambda decision: checkpoint.apply_decision(state, decision, patch.rank()),
        state_key=checkpoint.STATE_KEY, missing=checkpoint.MISSING)
    return patch


def attach(engine, config: LocoConfig) -> Optional[LocoHook]:
    """Attaches LoCo to ``engine``'s ZeRO-3 optimizer and logs what it does; the hook is ``engine.loco_hook``."""
    deepspeed_seam.check_deepspeed_version()
    optimizer = engine.optimizer
    if not deepspeed_seam.is_stage3_optimizer(optimizer):
        raise RuntimeError(f"zero_optimization.zeropp_loco_param needs the ZeRO stage-3 optimizer, but the engine "
                           f"built {type(optimizer).__name__}")
    hook = LocoHook(optimizer, config, dict(engine.module.named_parameters()))
    params = [p for p in engine.module.parameters() if p.requires_grad]
    if hook.topology.world_size == 1:
        log_rank0("deepspeed-loco: zeropp_loco_param is set but the data-parallel world has one rank: nothing is "
                  "communicated, so LoCo does nothing in this run", logging.WARNING)
    else:
        log_rank0(hook.describe(params))
        note = regime_note(hook.plan, config.error_feedback, sum(deepspeed_seam.param_numel(p) for p in params))
        if note:
            log_rank0(note)
    hook.live_rho = LiveRho(hook.reducer, hook.topology.group, config.rho_every, config.rho_log_every,
                            deepspeed_seam.micro_batch_per_rank(engine), deepspeed_seam.accumulation_steps(engine),
                            deepspeed_seam.current_device(), next_step=hook.state.step + 1)
    hook.telemetry = telemetry.for_engine(engine, hook)
    setattr(engine, ENGINE_ATTRIBUTE, hook)
    return hook


def add_reduce_observer(engine, observer: ReduceObserver):
    """Calls ``observer(names, grads, partitions)`` after every bucket reduce of ``engine``'s ZeRO-3 optimizer, with
    or without LoCo, so that a measurement sees every arm alike: with LoCo through the hook
    (:meth:`LocoHook.add_reduce_observer`), without it around DeepSpeed's own reduce
    (:class:`~deepspeed_loco.runtime.zero.deepspeed_seam.StockReduceObservation`; ``partitions`` as DeepSpeed
    returns them). ``names`` are the parameters' names in ``engine.module``. Returns a handle whose ``.remove()``
    stops the observer."""
    hook = getattr(engine, ENGINE_ATTRIBUTE, None)
    if hook is not None:
        return hook.add_reduce_observer(observer)
    optimizer = engine.optimizer
    if not deepspeed_seam.is_stage3_optimizer(optimizer):
        raise RuntimeError(f"deepspeed-loco: reduce observers need the ZeRO stage-3 optimizer, but the engine built "
                           f"{type(optimizer).__name__}")
    names = {param: name for name, param in engine.module.named_parameters()}
    return deepspeed_seam.StockReduceObservation(
        optimizer, lambda params, grads, partitions: observer([names[p] for p in params], grads, partitions))
