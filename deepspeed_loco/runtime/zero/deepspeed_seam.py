"""Every place deepspeed-loco touches DeepSpeed's internals, in one module.

What is patched, and how it is undone:

* ``deepspeed.initialize``, ``DeepSpeedConfig.__init__`` and ``DeepSpeedEngine.__init__`` (process-wide, by
  :func:`install`, undone by :func:`uninstall`): the config key ``zero_optimization.zeropp_loco_param``, which
  DeepSpeed >= 0.19.8 rejects, is validated and taken out before DeepSpeed parses the config; the config class
  keeps LoCo's config (:data:`LOCO_CONFIG_ATTRIBUTE`), and the engine constructor, which every path to an engine
  passes (also a ``deepspeed.initialize`` a script imported before :func:`install`), attaches LoCo to the engine it
  built from such a config.
* On one ``DeepSpeedZeroOptimizer_Stage3`` instance (by :class:`OptimizerPatch`, undone by its ``restore``): the
  bucket reduce ``__avg_scatter_grads`` (name-mangled: :attr:`PrivateNames.reduce`), ``step``, ``state_dict`` and
  ``load_state_dict``, and the ``save`` and ``load`` of the engine's checkpoint engine (``engine.checkpoint_engine``,
  for the optimizer files' paths: :meth:`OptimizerPatch.watch_files`). ``restore`` removes LoCo's own wrappers only:
  one that something else wrapped afterwards stays under that wrapper, passing every call through (see
  :class:`_Slot`). Or, on an optimizer LoCo is not
  attached to, the bucket reduce alone, only to observe it (:class:`StockReduceObservation`, undone by its
  ``remove``).
* Read, never written: the optimizer's ``dp_process_group``, ``dtype``, ``gradient_accumulation_dtype``,
  ``loss_scale``, ``overflow``, ``param_names``, ``gradient_predivide_factor``, ``postscale_gradients`` and its
  partition-group helpers; a ZeRO-3 parameter's ``ds_id``, ``ds_numel`` and ``ds_tensor``; the engine's ``monitor``,
  ``train_micro_batch_size_per_gpu()`` and ``gradient_accumulation_steps()``; a config class's
  ``zero_config.zero_hpz_partition_size``. Code outside this module reads them
  through the named functions at its end (:func:`data_parallel_group`, :func:`param_numel`, ...), never by
  attribute.

DeepSpeed's private names (its own leading underscore) that the seam calls or replaces stand in one table,
:data:`PRIVATE_NAMES`, keyed by the DeepSpeed release they were read from; its keys are the releases this module was
tested with (:data:`TESTED_DEEPSPEED`). Another release uses the row of the newest tested release not newer than it
and starts with a warning; a release older than :data:`MIN_DEEPSPEED`, or one whose ZeRO-3 optimizer lacks a name of
its row, fails at start-up.

What LoCo's reduce leaves out of DeepSpeed's: ``gradient_predivide_factor`` and ``prescale_gradients`` (DeepSpeed's
reduce divides the gradients by the factor before the reduce-scatter and multiplies the partitions back after it).
DeepSpeed 0.19.8 itself refuses other values than their defaults (1.0 and false) with qgZ, which LoCo requires (qgZ
forces reduce-scatter on, and with it DeepSpeed asserts both); :func:`reduce_scaling_not_applied` names a value that
LoCo's reduce would silently leave out all the same, and the hook refuses it at attach: the guard for a release that
stops asserting.
"""
import dataclasses
import functools
import inspect
import logging
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
from packaging import version

from deepspeed_loco.utils.logging import log_rank0

@dataclasses.dataclass(frozen=True)
class PrivateNames:
    """DeepSpeed's private names that the seam relies on in one release, all methods of its ZeRO-3 optimizer
    (``DeepSpeedZeroOptimizer_Stage3``): ``reduce``, the bucket reduce LoCo replaces (as Python name-mangles it), and
    the three helpers LoCo's reduce calls where DeepSpeed's does: ``same_partition_group`` (asserts that a bucket's
    parameters share one partition group), ``partition_group`` (a parameter's partition group) and
    ``averaging_world_size`` (the world size a bucket is averaged over, which differs for expert groups)."""
    reduce: str
    same_partition_group: str
    partition_group: str
    averaging_world_size: str

    def missing_from(self, cls: type) -> List[str]:
        """The names of this row that ``cls`` has no callable for, in field order."""
        return [name for name in dataclasses.astuple(self) if not callable(getattr(cls, name, None))]


# each tested DeepSpeed release, oldest first, with the private names read from its source
PRIVATE_NAMES: Dict[str, PrivateNames] = {
    "0.19.8": PrivateNames(reduce="_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads",
                           same_partition_group="_assert_same_partition_group",
                           partition_group="_get_param_partition_group",
                           averaging_world_size="_gradient_averaging_world_size"),
}
TESTED_DEEPSPEED = tuple(PRIVATE_NAMES)
MIN_DEEPSPEED = TESTED_DEEPSPEED[0]

# the DeepSpeed config keys (top level) whose effect lives inside the bucket reduce LoCo replaces, each with the
# value at which it has none: LoCo's reduce applies neither
REDUCE_SCALING_DEFAULTS: Dict[str, Any] = {"gradient_predivide_factor": 1.0, "prescale_gradients": False}

_STOCK: Dict[str, Any] = {}  # what install() replaced: {"initialize": fn, "config_init": fn, "engine_init": fn}
LOCO_CONFIG_ATTRIBUTE = "loco_config"
"""Set on every ``DeepSpeedConfig`` built while installed: LoCo's validated config taken out of it, or None."""


# ------------------------------------------------------------------------------------------------ versions
def names_for(release: str) -> PrivateNames:
    """The private names of DeepSpeed ``release``: the row of the newest tested release not newer than it.
    RuntimeError for a release older than :data:`MIN_DEEPSPEED`."""
    parsed = version.parse(release)
    known = [tested for tested in PRIVATE_NAMES if version.parse(tested) <= parsed]
    if not known:
        raise RuntimeError(f"deepspeed-loco needs DeepSpeed >= {MIN_DEEPSPEED}, found {release}; DeepSpeed "
                           f"0.16.2-0.19.7 ship their own zeropp_loco_param (use that, or upgrade DeepSpeed)")
    return PRIVATE_NAMES[max(known, key=version.parse)]


def private_names() -> PrivateNames:
    """The private names of the installed DeepSpeed (:func:`names_for` its ``__version__``)."""
    import deepspeed
    return names_for(deepspeed.__version__)


def check_deepspeed_version() -> None:
    """Fails unless the installed DeepSpeed's ZeRO-3 optimizer has every name of its :data:`PRIVATE_NAMES` row;
    warns for a release that is not a key of the table."""
    import deepspeed
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    installed = deepspeed.__version__
    missing = private_names().missing_from(DeepSpeedZeroOptimizer_Stage3)
    if missing:
        raise RuntimeError(f"deepspeed-loco cannot hook DeepSpeed {installed}: its ZeRO-3 optimizer has no "
                           f"{', '.join(missing)} (tested with {', '.join(TESTED_DEEPSPEED)}); pin one of those")
    if installed not in TESTED_DEEPSPEED:
        log_rank0(f"deepspeed-loco: DeepSpeed {installed} is untested (tested: {', '.join(TESTED_DEEPSPEED)})",
                  logging.WARNING)


def is_stage3_optimizer(optimizer) -> bool:
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    return isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3)


# --------------------------------------------------------------------------------------- process-wide patch
def stock_initialize() -> Callable:
    """``deepspeed.initialize`` as DeepSpeed shipped it, whether or not :func:`install` replaced it."""
    import deepspeed
    return _STOCK.get("initialize", deepspeed.initialize)


def install(initialize: Callable, split_config: Callable[[Any], Tuple[Any, Any]],
            before_build: Callable[[Any, int], None], after_build: Callable[[Any, Any], None]) -> None:
    """Turns LoCo on process-wide (idempotent).

    ``deepspeed.initialize`` becomes ``initialize``. ``DeepSpeedConfig`` takes its config through ``split_config``
    (a dict or JSON path -> (the config DeepSpeed may see, LoCo's config or None)) and keeps LoCo's under
    :data:`LOCO_CONFIG_ATTRIBUTE`. ``DeepSpeedEngine.__init__`` (hence every engine class, however the script reached
    it) hands DeepSpeed the split config too, and for an engine whose config held LoCo's calls
    ``before_build(loco, zero_hpz_partition_size)`` before DeepSpeed builds it and ``after_build(engine, loco)``
    after. An engine that ``initialize`` builds gets a config without LoCo's block and is not touched."""
    import deepspeed
    from deepspeed.runtime import config as ds_runtime_config
    from deepspeed.runtime.engine import DeepSpeedEngine

    if _STOCK:
        return
    stock_config_init = ds_runtime_config.DeepSpeedConfig.__init__
    stock_engine_init = DeepSpeedEngine.__init__
    engine_signature = inspect.signature(stock_engine_init)

    @functools.wraps(stock_config_init)
    def config_init(self, config, *args, **kwargs):
        stripped, loco = split_config(config)
        stock_config_init(self, stripped, *args, **kwargs)
        setattr(self, LOCO_CONFIG_ATTRIBUTE, loco)

    @functools.wraps(stock_engine_init)
    def engine_init(engine, *args, **kwargs):
        call = engine_signature.bind(engine, *args, **kwargs)
        given = call.arguments
        config_class = given.get("config_class")
        loco = getattr(config_class, LOCO_CONFIG_ATTRIBUTE, None)
        if given.get("config") is not None:  # the raw config the engine keeps (and saves in checkpoints)
            given["config"], from_raw = split_config(given["config"])
            loco = loco if loco is not None else from_raw
        if loco is not None:
            before_build(loco, int(config_class.zero_config.zero_hpz_partition_size))
        stock_engine_init(*call.args, **call.kwargs)
        if loco is not None:
            after_build(engine, loco)

    _STOCK.update(initialize=deepspeed.initialize, config_init=stock_config_init, engine_init=stock_engine_init)
    deepspeed.initialize = initialize
    ds_runtime_config.DeepSpeedConfig.__init__ = config_init
    DeepSpeedEngine.__init__ = engine_init


def uninstall() -> None:
    """Restores the stock ``deepspeed.initialize``, ``DeepSpeedConfig.__init__`` and ``DeepSpeedEngine.__init__``
    (a no-op if not installed). Engines already built keep LoCo."""
    import deepspeed
    from deepspeed.runtime import config as ds_runtime_config
    from deepspeed.runtime.engine import DeepSpeedEngine

    if not _STOCK:
        return
    deepspeed.initialize = _STOCK["initialize"]
    ds_runtime_config.DeepSpeedConfig.__init__ = _STOCK["config_init"]
    DeepSpeedEngine.__init__ = _STOCK["engine_init"]
    _STOCK.clear()


def installed() -> bool:
    return bool(_STOCK)


# ------------------------------------------------------------------------------------ per-optimizer patch
class _Slot:
    """One method of an object that LoCo wrapped, and how to take LoCo out of it again.

    What is installed (an instance attribute) is a forwarder that calls ``replacement`` until :meth:`release`, and
    from then on the method it replaced (``replaced``: what the attribute gave before, the class's bound method or
    an earlier instance attribute).
    """

    def __init__(self, owner: Any, name: str, replacement: Callable):
        self.owner, self.name = owner, name
        self.had_own = name in vars(owner)  # an instance attribute was there (else the class's method showed)
        self.replaced = getattr(owner, name)
        self.target = replacement

        @functools.wraps(replacement)
        def forwarder(*args, **kwargs):
            return self.target(*args, **kwargs)

        self.forwarder = forwarder
        setattr(owner, name, forwarder)

    def release(self) -> bool:
        """Takes LoCo out of the method. True: the forwarder was still the attribute and the object has what it had
        before again. False: something was installed on top of the forwarder after LoCo; it stays, and the forwarder
        under it now passes every call to the replaced method."""
        self.target = self.replaced
        if vars(self.owner).get(self.name) is not self.forwarder:
            return False
        if self.had_own:
            setattr(self.owner, self.name, self.replaced)
        else:
            delattr(self.owner, self.name)
        return True


class OptimizerPatch:
    """Routes one ZeRO-3 optimizer's bucket reduce, ``step`` and checkpoint methods through LoCo.

    ``reduce(params, grads) -> partitions``: the mean partitions of a bucket (``grads`` already in the
    communication dtype); DeepSpeed's contract around it (dtype casts, the averaging world size of expert groups)
    is kept here. ``after_step(overflow, scale_ratio)`` runs after every optimizer step (``scale_ratio``: new
    over old fp16 loss scale). ``save() -> entry`` adds LoCo's entry to the optimizer state; ``decide(entry,
    universal, load_optimizer_states) -> LoadDecision`` and ``apply(decision)`` carry it through a load (``apply``
    raises for an "error" decision, which is applied before DeepSpeed loads anything). :meth:`watch_files` adds the
    engine's checkpoint engine (LoCo's files beside the optimizer files).
    """

    def __init__(self, optimizer, reduce: Callable, after_step: Callable, save: Callable, decide: Callable,
                 apply: Callable, state_key: str, missing: Any):
        self.optimizer = optimizer
        self._reduce, self._after_step = reduce, after_step
        self._save, self._decide, self._apply = save, decide, apply
        self._state_key, self._missing = state_key, missing
        self._group_ranks: Optional[List[int]] = None  # the data-parallel ranks, read at the first reduce
        self._checked_groups = set()
        self._names = private_names()
        self._slots = [_Slot(optimizer, name, method) for name, method in (
            (self._names.reduce, self._avg_scatter_grads), ("step", self._step), ("state_dict", self._state_dict),
            ("load_state_dict", self._load_state_dict))]
        self._stock = {slot.name: slot.replaced for slot in self._slots}  # what LoCo's methods call through to
        self._load_signature = inspect.signature(self._stock["load_state_dict"])

    def restore(self) -> None:
        """Takes LoCo out of the optimizer's methods (LoCo's state is left as it is); a second call does nothing.

        A method whose attribute is still LoCo's wrapper gets back exactly what it had before (the class's method
        shows through again). A method that something else wrapped after LoCo (a profiler or a debugger wrapping
        the reduce) keeps that wrapper, which goes on working: LoCo's wrapper under it now passes every call
        straight to the method LoCo replaced. (Raising instead would leave LoCo in the data path of an optimizer
        whose later wrapper cannot be taken off first.)
        """
        slots, self._slots = self._slots, []
        stacked = [slot.name for slot in slots if not slot.release()]
        if stacked:
            log_rank0(f"deepspeed-loco: {', '.join(stacked)} of the ZeRO-3 optimizer were wrapped again after LoCo; "
                      f"those wrappers stay, and LoCo's under them only passes calls through")

    @property
    def group_ranks(self) -> List[int]:
        if self._group_ranks is None:
            self._group_ranks = dist.get_process_group_ranks(data_parallel_group(self.optimizer))
        return self._group_ranks

    @property
    def world_size(self) -> int:
        return len(self.group_ranks)

    def rank(self) -> int:
        return dist.get_rank(group=data_parallel_group(self.optimizer)) if dist.is_initialized() else 0

    def _avg_scatter_grads(self, params: List[torch.nn.Parameter],
                           communication_data_type: torch.dtype) -> List[torch.Tensor]:
        """Mean partitions of a bucket, in the optimizer's gradient-accumulation dtype (DeepSpeed's contract)."""
        opt, names = self.optimizer, self._names
        getattr(opt, names.same_partition_group)(params)
        self._check_partition_group(getattr(opt, names.partition_group)(params[0]))
        grads = [p.grad if communication_data_type == opt.dtype else p.grad.to(communication_data_type) for p in params]
        partitions = self._reduce(params, grads)
        averaging = getattr(opt, names.averaging_world_size)(params, self.world_size)
        if averaging != self.world_size:
            partitions = [p.mul(self.world_size / float(averaging)) for p in partitions]
        if communication_data_type != opt.gradient_accumulation_dtype:
            partitions = [p.to(opt.gradient_accumulation_dtype) for p in partitions]
        return partitions

    def _check_partition_group(self, group) -> None:
        """LoCo's subgroups were built for the data-parallel ranks; a bucket over other ranks is an error."""
        if id(group) in self._checked_groups:
            return
        if dist.get_process_group_ranks(group) != self.group_ranks:
            raise RuntimeError("deepspeed-loco: a ZeRO-3 bucket is partitioned over a process group other than the "
                               "data-parallel group LoCo was set up for (MiCS/expert groups are not supported)")
        self._checked_groups.add(id(group))

    def _step(self, *args, **kwargs):
        opt = self.optimizer
        scale_before = opt.loss_scale
        result = self._stock["step"](*args, **kwargs)
        self._after_step(bool(opt.overflow), opt.loss_scale / scale_before)
        return result

    def _state_dict(self, *args, **kwargs):
        sd = self._stock["state_dict"](*args, **kwargs)
        sd[self._state_key] = self._save()
        return sd

    def _load_state_dict(self, *args, **kwargs):
        bound = self._load_signature.bind(*args, **kwargs)
        bound.apply_defaults()
        call = bound.arguments
        state_dict_list, folder = call.get("state_dict_list"), call.get("checkpoint_folder")
        entry = self._missing
        if not folder and state_dict_list is not None:
            mine = state_dict_list[self.rank()]
            if isinstance(mine, dict):
                entry = mine.pop(self._state_key, self._missing)  # DeepSpeed's loader never sees it
        decision = self._decide(entry, bool(folder), call.get("load_optimizer_states", True))
        if call.get("load_serial") is None:  # serial loading runs the ranks one after another: no collective
            decision = self._agree(decision)
        if decision.kind == "error":
            self._apply(decision)  # raises: neither DeepSpeed's state nor LoCo's is loaded
        result = self._stock["load_state_dict"](*args, **kwargs)
        self._apply(decision)
        return result

    def _agree(self, decision):
        """Every rank raises if one does, so that no rank goes on into a collective the others never reach: one
        all-gather of each rank's ``(kind, why)`` gives every rank the failures; without one, the resets' reasons
        with the ranks each concerns (``decision.agreed``), which rank 0 logs once each."""
        group = data_parallel_group(self.optimizer)
        if not dist.is_initialized() or dist.get_world_size(group=group) == 1:
            return decision
        reasons = [None] * dist.get_world_size(group=group)
        dist.all_gather_object(reasons, (decision.kind, decision.why), group=group)
        failed = tuple((rank, why) for rank, (kind, why) in enumerate(reasons) if kind == "error")
        if failed:
            return dataclasses.replace(decision, kind="error", failed=failed)
        resets = {}
        for rank, (kind, why) in enumerate(reasons):
            if kind == "reset":
                resets.setdefault(why, []).append(rank)
        agreed = tuple((why, tuple(ranks)) for why, ranks in resets.items())
        return dataclasses.replace(decision, agreed=agreed) if agreed else decision

    def watch_files(self, checkpoint_engine, write: Callable, locate: Callable) -> None:
        """Routes the files the engine's ``checkpoint_engine`` saves and loads through LoCo: a ZeRO-3 optimizer file
        about to be saved to ``path`` with LoCo's ``entry`` gets ``write(entry, path)`` in its place (LoCo writes its
        own file beside ``path`` there); one loaded from ``path`` gets ``locate(entry, path)``. :meth:`restore`
        undoes it with the rest."""
        self._write, self._locate = write, locate
        for name, method in (("save", self._save_file), ("load", self._load_file)):
            slot = _Slot(checkpoint_engine, name, method)
            self._slots.append(slot)
            self._stock[name] = slot.replaced

    def _save_file(self, state_dict, path, *args, **kwargs):
        key, entry = self._entry_in(state_dict)
        if key is not None:
            state_dict = {**state_dict, key: {**state_dict[key], self._state_key: self._write(entry, path)}}
        return self._stock["save"](state_dict, path, *args, **kwargs)

    def _load_file(self, path, *args, **kwargs):
        state_dict = self._stock["load"](path, *args, **kwargs)
        key, entry = self._entry_in(state_dict)
        if key is not None:
            state_dict[key][self._state_key] = self._locate(entry, path)
        return state_dict

    def _entry_in(self, state_dict):
        """``(key, entry)``: LoCo's entry in a checkpoint file's state dict, under DeepSpeed's key of the optimizer
        state (``optimizer_state_dict``); ``(None, None)`` in a file without one."""
        from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT
        optimizer_sd = state_dict.get(OPTIMIZER_STATE_DICT) if isinstance(state_dict, dict) else None
        if isinstance(optimizer_sd, dict) and self._state_key in optimizer_sd:
            return OPTIMIZER_STATE_DICT, optimizer_sd[self._state_key]
        return None, None


class StockReduceObservation:
    """Calls ``observer(params, grads, partitions)`` after every bucket reduce of a ZeRO-3 optimizer that runs
    DeepSpeed's own reduce (LoCo not attached): ``grads`` copies of the bucket's gradients in the communication
    dtype, taken before the reduce (DeepSpeed's reduce-scatter may reuse a gradient's memory), ``partitions`` what
    the reduce returned. :meth:`remove` takes the observation out again (:class:`_Slot`'s rules)."""

    def __init__(self, optimizer, observer: Callable):
        self._observer = observer
        self._slot = _Slot(optimizer, private_names().reduce, self._avg_scatter_grads)

    def _avg_scatter_grads(self, params: List[torch.nn.Parameter],
                           communication_data_type: torch.dtype) -> List[torch.Tensor]:
        grads = [p.grad.to(communication_data_type, copy=True) for p in params]
        partitions = self._slot.replaced(params, communication_data_type)
        self._observer(params, grads, partitions)
        return partitions

    def remove(self) -> None:
        """DeepSpeed's reduce is no longer observed; a second call does nothing."""
        self._slot.release()


# ------------------------------------------------------------------------------- reads of DeepSpeed's state
def data_parallel_group(optimizer):
    """The ZeRO-3 optimizer's data-parallel process group (``dp_process_group``): the ranks a bucket is reduced
    over."""
    return optimizer.dp_process_group


def reduce_scaling_not_applied(optimizer) -> Dict[str, Any]:
    """The keys of :data:`REDUCE_SCALING_DEFAULTS` that the ZeRO-3 optimizer runs with another value (its
    ``gradient_predivide_factor``, and ``prescale_gradients`` as ``not postscale_gradients``), by key with that value:
    the scaling LoCo's reduce would leave out. Empty when DeepSpeed's reduce would not scale either."""
    running = {"gradient_predivide_factor": optimizer.gradient_predivide_factor,
               "prescale_gradients": not optimizer.postscale_gradients}
    return {key: value for key, value in running.items() if value != REDUCE_SCALING_DEFAULTS[key]}


def param_names(optimizer) -> Mapping[str, torch.Tensor]:
    """``{name: parameter}`` from the optimizer's ``param_names`` (DeepSpeed's ``{parameter: name}``); empty when
    the optimizer has none."""
    return {name: p for p, name in getattr(optimizer, "param_names", {}).items()}


def param_id(param: torch.Tensor) -> Optional[int]:
    """ZeRO-3's id of ``param`` (``ds_id``); None for a tensor ZeRO-3 did not partition. Not stable across
    processes: for messages and information only."""
    return getattr(param, "ds_id", None)


def param_numel(param: torch.Tensor) -> int:
    """Elements of the full parameter: ZeRO-3's ``ds_numel`` (its local tensor is an empty placeholder), else
    ``param.numel()`` for a tensor ZeRO-3 did not partition."""
    return int(getattr(param, "ds_numel", param.numel()))


def partition_device(param: torch.Tensor) -> torch.device:
    """Where this rank's ZeRO-3 partition of ``param`` lives (``ds_tensor.device``), else ``param.device``."""
    partition = getattr(param, "ds_tensor", None)
    return partition.device if isinstance(partition, torch.Tensor) else param.device


def checkpoint_engine(engine):
    """The engine's checkpoint engine (``engine.checkpoint_engine``), which saves and loads its checkpoint files."""
    return engine.checkpoint_engine


def engine_monitor(engine):
    """The engine's DeepSpeed monitor (``engine.monitor``: tensorboard, wandb, csv, comet, as the config enables
    them) when one is enabled; None otherwise."""
    monitor = getattr(engine, "monitor", None)
    return monitor if monitor is not None and monitor.enabled else None


def micro_batch_per_rank(engine) -> int:
    """Samples per rank and micro-step (the engine's ``train_micro_batch_size_per_gpu()``)."""
    return int(engine.train_micro_batch_size_per_gpu())


def accumulation_steps(engine) -> int:
    """Micro-steps per optimizer step (the engine's ``gradient_accumulation_steps()``); ZeRO-3 reduces every one."""
    return int(engine.gradient_accumulation_steps())


def local_device_count() -> int:
    from deepspeed.accelerator import get_accelerator
    return get_accelerator().device_count()


def current_device() -> torch.device:
    from deepspeed.accelerator import get_accelerator
    return torch.device(get_accelerator().current_device_name())


__all__ = ["PrivateNames", "PRIVATE_NAMES", "MIN_DEEPSPEED", "TESTED_DEEPSPEED", "REDUCE_SCALING_DEFAULTS", "names_for",
           "private_names", "check_deepspeed_version", "is_stage3_optimizer", "stock_initialize",
           "LOCO_CONFIG_ATTRIBUTE", "install", "uninstall", "installed", "OptimizerPatch", "StockReduceObservation",
           "data_parallel_group", "reduce_scaling_not_applied", "param_names", "param_id", "param_numel",
           "partition_device", "checkpoint_engine", "engine_monitor", "micro_batch_per_rank", "accumulation_steps",
           "local_device_count",
           "current_device"]
