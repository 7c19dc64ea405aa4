"""LoCo attached to one DeepSpeed ZeRO-3 optimizer: topology, hop plan (built once, here), error-feedback state,
reducer, the step rules (reset every ``reset_T`` optimizer steps, rescale on an fp16 loss-scale change, clear
on overflow), the live rho (:class:`~deepspeed_loco.runtime.comm.noise_stats.LiveRho`), the telemetry, the observers
of the reduce (:meth:`LocoHook.add_reduce_observer`) and the listeners of the optimizer step
(:meth:`LocoHook.add_step_listener`), all built with the hook.

Every touch of DeepSpeed itself goes through :mod:`deepspeed_loco.runtime.zero.deepspeed_seam`.
"""
import itertools
import json
import logging
from typing import Callable, Dict, List, Mapping, Optional, Sequence

import torch

from deepspeed_loco.config import CONFIG_KEY, LocoConfig, LocoConfigError
from deepspeed_loco.layout import HopPlan, describe_hop_cost
from deepspeed_loco.ops import kernels_for
from deepspeed_loco.runtime.zero import deepspeed_seam
from deepspeed_loco.runtime.comm.loco_reduce import LocoReducer
from deepspeed_loco.runtime.comm.noise_stats import LiveRho
from deepspeed_loco.runtime.comm import topology
from deepspeed_loco.runtime.comm.topology import LocoTopology
from deepspeed_loco.runtime.zero import checkpoint, telemetry
from deepspeed_loco.runtime.zero.regime_note import regime_note
from deepspeed_loco.runtime.comm.error_feedback import ErrorFeedbackState, error_feedback_off_reason
from deepspeed_loco.utils import clean_exit
from deepspeed_loco.utils.logging import log_rank0, logger

ENGINE_ATTRIBUTE = "loco_hook"
HOP_LABELS = {"intra_node": "intra-node", "inter_node": "inter-node"}
# observer(names, grads, partitions), called after every bucket reduce
ReduceObserver = Callable[[Sequence[str], Sequence[torch.Tensor], Sequence[torch.Tensor]], None]
# listener(step, cleared), called after every optimizer step
StepListener = Callable[[int, bool], None]


def resolve_local_size(config: LocoConfig, world_size: int) -> int:
    """Ranks per node of this job (:func:`~deepspeed_loco.runtime.comm.topology.ranks_per_node` with the
    accelerator count)."""
    return topology.ranks_per_node(config.local_world_size, world_size, deepspeed_seam.local_device_count())


def check_hpz_partition(ds_config: Mapping, config: LocoConfig) -> None:
    """LoCo's check of ``zero_optimization.zero_hpz_partition_size`` against the job's world size and ranks per
    node (:func:`~deepspeed_loco.runtime.comm.topology.check_hpz_partition`); needs the process group."""
    _check_hpz_size(ds_config.get("zero_optimization", {}).get("zero_hpz_partition_size", 1), config)


def _check_hpz_size(hpz_partition_size: int, config: LocoConfig) -> None:
    world_size = torch.distributed.get_world_size()
    topology.check_hpz_partition(hpz_partition_size, world_size, resolve_local_size(config, world_size))


def before_engine_build(config: LocoConfig, hpz_partition_size: int) -> None:
    """What an installed DeepSpeed engine constructor checks before it builds an engine from a config with LoCo's
    block: the DeepSpeed release, and ``zero_hpz_partition_size`` against the layout where the process group is up
    (DeepSpeed's ``initialize`` set it up; an engine cannot be built without it)."""
    deepspeed_seam.check_deepspeed_version()
    if torch.distributed.is_initialized():
        _check_hpz_size(hpz_partition_size, config)


def after_engine_build(engine, config: LocoConfig) -> None:
    """What an installed DeepSpeed engine constructor does after it built an engine from a config with LoCo's
    block: attaches LoCo (:func:`attach`) and registers the clean exit (:mod:`deepspeed_loco.utils.clean_exit`)."""
    clean_exit.register()
    attach(engine, config)


def describe_wire(plan: HopPlan) -> str:
    """The start-up line's wire figures: bytes per gradient element each hop puts on the wire, scales included, or
    ``n/a`` for a hop this layout does not have (``L == 1``: no intra-node hop; ``M == 1``: no inter-node hop)."""
    hops = {hop.name: hop for hop in plan.hops}
    figures = (f"{label} {describe_hop_cost(hops[name].bits, plan.group_size) if name in hops else 'n/a'}"
               for name, label in HOP_LABELS.items())
    return "wire per element: " + ", ".join(figures)


class ObserverHandle:
    """What :meth:`LocoHook.add_reduce_observer` and :meth:`LocoHook.add_step_listener` return: :meth:`remove`
    unregisters that callback."""

    def __init__(self, callbacks: Dict[int, Callable], key: int):
        self._callbacks, self._key = callbacks, key

    def remove(self) -> None:
        """The callback is not called again; a second call does nothing."""
        self._callbacks.pop(self._key, None)


class Callbacks:
    """Callbacks of one kind, called in registration order: :meth:`add` registers one, calling the object calls each
    with the same arguments."""

    def __init__(self):
        self._callbacks: Dict[int, Callable] = {}  # by registration number
        self._keys = itertools.count()

    def add(self, callback: Callable) -> ObserverHandle:
        key = next(self._keys)
        self._callbacks[key] = callback
        return ObserverHandle(self._callbacks, key)

    def __call__(self, *args) -> None:
        for callback in list(self._callbacks.values()):  # one may remove itself or another while called
            callback(*args)


class LocoHook:
    """LoCo attached to one ZeRO-3 optimizer: its topology, hop plan (built once from the config), error-feedback
    state and reducer (both given that plan), the live rho, the telemetry, the observers of its reduce and the
    listeners of its steps, all built here.

    ``named_params`` (``{name: parameter}``, default the optimizer's ``param_names``) names the parameters: the
    state keeps each one's error buffers, and checkpoints save them, under that name. ``rank_batch`` (samples per
    rank and micro-step) and ``micro_steps`` (micro-steps per optimizer step) are the live rho's
    (:class:`~deepspeed_loco.runtime.comm.noise_stats.LiveRho`), which is the first step listener. ``monitor``: the
    DeepSpeed monitor the telemetry writes to (:class:`~deepspeed_loco.runtime.zero.telemetry.LocoTelemetry`, then
    the first reduce observer and the second step listener), or None for no telemetry.
    """

    def __init__(self, optimizer, config: LocoConfig, named_params: Optional[Mapping[str, torch.Tensor]] = None, *,
                 rank_batch: int, micro_steps: int, monitor=None):
        self.optimizer = optimizer
        self.config = config
        group = deepspeed_seam.data_parallel_group(optimizer)
        world_size = torch.distributed.get_world_size(group)
        self.topology = LocoTopology.build(group, local_size=resolve_local_size(config, world_size))
        self.reducer = LocoReducer.for_topology(config, self.topology)
        self.plan: HopPlan = self.reducer.plan
        self.state: ErrorFeedbackState = self.reducer.state
        self._observers, self._step_listeners = Callbacks(), Callbacks()
        self.live_rho = LiveRho(self.reducer, self.topology.group, config.rho_every, config.rho_log_every, rank_batch,
                                micro_steps, deepspeed_seam.current_device(), next_step=self.state.step + 1)
        self.add_step_listener(self.live_rho.on_step)
        self.telemetry: Optional[telemetry.LocoTelemetry] = None
        if monitor is not None:
            error_norm_every = config.rho_every if config.error_norm_every is None else config.error_norm_every
            self.telemetry = telemetry.LocoTelemetry(monitor, self.reducer, self.topology.world_size,
                                                     config.error_feedback, self.live_rho, error_norm_every,
                                                     next_step=self.state.step + 1, every=config.telemetry_every)
            self.add_reduce_observer(self.telemetry.on_reduce)
            self.add_step_listener(self.telemetry.on_step)
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
        return self._observers.add(observer)

    def add_step_listener(self, listener: StepListener) -> ObserverHandle:
        """Calls ``listener(step, cleared)`` after every optimizer step, once, in registration order, after LoCo's
        step rules ran: ``step`` the optimizer step just taken (1-based, the count ``reset_T`` uses), ``cleared``
        whether it left the error buffers zero (a ``reset_T`` reset or an fp16 overflow). ``.remove()`` on the
        handle stops it."""
        return self._step_listeners.add(listener)

    def _reduce(self, params, grads):
        names = self._names_of(params)
        partitions = self.reducer.reduce_scatter(names, grads)
        self._observers(names, grads, partitions)
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
        self._step_listeners(self.state.step, reset or overflow)

    def detach(self) -> None:
        """Gives the optimizer back its stock reduce, step and checkpoint methods; one that something wrapped again
        after LoCo keeps that wrapper, with LoCo's under it passing calls through (``OptimizerPatch.restore``)."""
        self.patch.restore()

    def planned_buffer_bytes(self, params) -> int:
        """Error-buffer bytes this rank will hold for ``params`` (ZeRO-3 parameters with ``ds_numel``)."""
        return planned_buffer_bytes(self.state, params)

    def describe(self, params) -> str:
        """The start-up line for ``params`` (:func:`describe_active`)."""
        return describe_active(self.topology, self.config, self.state, params)


def planned_buffer_bytes(state: ErrorFeedbackState, params) -> int:
    """Error-buffer bytes ``state`` will hold on this rank for ``params`` (ZeRO-3 parameters with ``ds_numel``)."""
    return sum(state.planned_bytes(deepspeed_seam.param_numel(p)) for p in params)


def describe_active(topo: LocoTopology, config: LocoConfig, state: ErrorFeedbackState, params) -> str:
    """The start-up line, saying only what acts: the mode (which hops keep error), the layout, each hop's bits, group
    size, grid, hadamard, the exact own block when on, the wire cost of each hop (:func:`describe_wire`); where error
    feedback acts, ``err_beta``, ``reset_T`` and this rank's error-buffer memory for ``params``; the kernels and how
    often the live rho is measured (``rho_every``)."""
    plan, with_error = state.plan, state.hops_with_error
    if not with_error:
        mode = "plain qgZ (error feedback off)" if not config.error_feedback else (
            f"plain qgZ (error_feedback {json.dumps(config.error_feedback)} keeps error on the inter-node hop only, "
            f"and one node has none: error feedback off)")
    elif len(with_error) < len(plan.hops):
        mode = f"LoCo error feedback on the {' and '.join(HOP_LABELS[name] for name in with_error)} hop only"
    else:
        mode = "LoCo error feedback"
    bits = {HOP_LABELS[hop.name].split("-")[0]: hop.bits for hop in plan.hops}  # intra, inter: the hops there are
    line = (f"deepspeed-loco active: {mode}; {topo.describe()}; bits {'/'.join(bits)} "
            f"{'/'.join(map(str, bits.values()))}, group {config.group_size}, grid {plan.grid}"
            f"{' (auto)' if config.quant_grid == 'auto' else ''}, hadamard {'on' if config.hadamard else 'off'}"
            f"{', own blocks exact' if plan.exact_own_block else ''}; "
            f"{describe_wire(plan)}")
    if with_error:
        numel = sum(deepspeed_seam.param_numel(p) for p in params)
        buffer_bytes = planned_buffer_bytes(state, params)
        line += (f"; err_beta {config.err_beta}, reset_T {config.reset_T}; error buffers {buffer_bytes / 2**20:.2f} "
                 f"MiB ({buffer_bytes / max(numel, 1):.3f} B per parameter element, {state.storage.label}) on this "
                 f"rank")
    kernels = kernels_for(deepspeed_seam.current_device(), config.kernels).name
    return f"{line}; kernels: {kernels}; live rho {f'every {config.rho_every} steps' if config.rho_every else 'off'}"


def patch_optimizer(optimizer, state: ErrorFeedbackState, names: Mapping[str, torch.Tensor], reduce, after_step):
    """Routes ``optimizer``'s bucket reduce to ``reduce``, its steps to ``after_step`` and its checkpoints through
    ``state`` (whose parameter names ``names`` maps to the model's parameters)."""
    patch = deepspeed_seam.OptimizerPatch(
        optimizer, reduce=reduce, after_step=after_step, save=lambda: checkpoint.manifest(state),
        decide=lambda entry, universal, load_optimizer_states: checkpoint.decide_load(
            state, entry, names, universal, load_optimizer_states),
        apply=lambda decision: checkpoint.apply_decision(state, decision, patch.rank()),
        state_key=checkpoint.STATE_KEY, missing=checkpoint.MISSING)
    return patch


def check_reduce_scaling(optimizer) -> None:
    """LocoConfigError naming the DeepSpeed config key when the optimizer runs with a gradient scaling that lives in
    the bucket reduce LoCo replaces (``gradient_predivide_factor``, ``prescale_gradients``:
    :func:`~deepspeed_loco.runtime.zero.deepspeed_seam.reduce_scaling_not_applied`): LoCo's reduce would leave it
    out silently. DeepSpeed 0.19.8 refuses them itself under qgZ; this is the guard for a release that does not."""
    skipped = deepspeed_seam.reduce_scaling_not_applied(optimizer)
    if skipped:
        found = ", ".join(f"{key} = {value!r}" for key, value in skipped.items())
        valid = ", ".join(f"\"{key}\": {json.dumps(deepspeed_seam.REDUCE_SCALING_DEFAULTS[key])}" for key in skipped)
        raise LocoConfigError(f"zero_optimization.{CONFIG_KEY} does not apply DeepSpeed's {' or '.join(skipped)} "
                              f"(this run has {found}; LoCo's reduce would leave it out): set {valid} (the "
                              f"default), or remove {CONFIG_KEY}")


def attach(engine, config: LocoConfig) -> Optional[LocoHook]:
    """Attaches LoCo to ``engine``'s ZeRO-3 optimizer and logs what it does; the hook is ``engine.loco_hook``."""
    deepspeed_seam.check_deepspeed_version()
    optimizer = engine.optimizer
    if not deepspeed_seam.is_stage3_optimizer(optimizer):
        raise RuntimeError(f"zero_optimization.zeropp_loco_param needs the ZeRO stage-3 optimizer, but the engine "
                           f"built {type(optimizer).__name__}")
    check_reduce_scaling(optimizer)
    named = dict(engine.module.named_parameters())
    hook = LocoHook(optimizer, config, named, rank_batch=deepspeed_seam.micro_batch_per_rank(engine),
                    micro_steps=deepspeed_seam.accumulation_steps(engine), monitor=telemetry.rank0_monitor(engine))
    hook.patch.watch_files(deepspeed_seam.checkpoint_engine(engine), locate=checkpoint.locate,
                           write=lambda entry, path: checkpoint.write_entry(hook.state, named, entry, path))
    params = [p for p in engine.module.parameters() if p.requires_grad]
    if hook.topology.world_size == 1:
        log_rank0("deepspeed-loco: zeropp_loco_param is set but the data-parallel world has one rank: nothing is "
                  "communicated, so LoCo does nothing in this run", logging.WARNING)
    else:
        log_rank0(hook.describe(params))
        off = error_feedback_off_reason(hook.plan, config.error_feedback)
        if off:  # error feedback asked for, and no hop of this layout keeps error
            log_rank0(f"deepspeed-loco: zeropp_loco_param.{off}", logging.WARNING)
        note = regime_note(hook.plan, config.error_feedback, sum(deepspeed_seam.param_numel(p) for p in params),
                           error_bits=config.error_bits)
        if note:
            log_rank0(note)
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
