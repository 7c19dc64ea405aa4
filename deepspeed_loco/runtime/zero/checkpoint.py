"""LoCo's error-feedback state in DeepSpeed checkpoints: what is saved, how it is checked, when it is reset.

Saving: the ZeRO-3 optimizer's ``state_dict`` gains the key ``"deepspeed_loco"`` (:func:`state_dict`), so every
rank's buffers and the reset counter land in that rank's ``zero_pp_rank_*_optim_states.pt`` next to the rest of
its optimizer state, written and read by ``engine.save_checkpoint`` / ``engine.load_checkpoint``.

Loading: the wrapped ``load_state_dict`` takes this rank's entry out of the list before DeepSpeed's own loader
sees it, checks all of it (:func:`parse_state_dict`) before anything is loaded, agrees with the other ranks, lets
DeepSpeed load, then restores the buffers and the step counter. The rules (``docs/checkpointing.md``):

* no LoCo entry (a checkpoint of stock DeepSpeed, or of the removed upstream LoCo, which never saved its buffers),
  a universal checkpoint, or ``load_optimizer_states=False``: buffers start from zero, with a WARNING saying why;
* a different layout (``W``, ``L``, ``group_size``, ``error_bits``, ``hadamard``, ``error_feedback``): buffers
  start from zero, with a WARNING naming the saved and the current values; the step counter is restored;
* a corrupt or truncated entry (wrong types, shapes, missing fields, an unknown parameter, non-finite values, an
  unknown format version): :class:`LocoCheckpointError` naming what is wrong, raised on every rank before the
  ZeRO-3 optimizer state is loaded (DeepSpeed has read the module's file by then), or, with
  ``zeropp_loco_param.on_corrupt_checkpoint: "reset"``, buffers from zero with a WARNING.

Parameters are identified by their name in ``engine.module.named_parameters()``, not by ZeRO-3's ``ds_id``: ds_ids
come from a process-wide counter (``deepspeed.zero.Init.param_id``), so the same model built a second time in one
process (an in-process restart, a second engine) gets different ds_ids. The ds_id is saved for information only.
"""
import inspect
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

from deepspeed_loco.layout import padded_partition_size
from deepspeed_loco.utils.logging import logger

STATE_KEY = "deepspeed_loco"
FORMAT = "deepspeed_loco.error_feedback"
FORMAT_VERSION = 1
# signature entries whose difference makes the saved buffers meaningless here (layout, storage or basis)
RESET_KEYS = ("world_size", "local_size", "group_size", "error_bits", "hadamard", "error_feedback")
# recorded and compared for information only: the buffers hold not-yet-sent gradient in gradient units, which
# does not depend on the wire's bit width
INFO_KEYS = ("intra_node_bits", "inter_node_bits")
SIGNATURE_KEYS = RESET_KEYS + INFO_KEYS
ON_CORRUPT_CHOICES = ("error", "reset")


class LocoCheckpointError(RuntimeError):
    """The LoCo state in a checkpoint is corrupt, truncated or does not fit this model; the message says what."""


class LocoCheckpointMismatch(Exception):
    """The checkpoint was saved with another layout (``W``, ``L``, group size, ...): its buffers cannot be used."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


# ----------------------------------------------------------------------------------------------------- saving
def signature(state) -> Dict[str, Any]:
    """What the buffers' layout and meaning depend on, for an :class:`ErrorFeedbackState`."""
    cfg, topo = state.config, state.topology
    return {
        "world_size": int(topo.world_size),
        "local_size": int(topo.local_size),
        "group_size": int(cfg.group_size),
        "error_bits": int(cfg.error_bits),
        "hadamard": bool(getattr(cfg, "hadamard", False)),
        "error_feedback": bool(cfg.error_feedback),
        "intra_node_bits": int(cfg.intra_node_bits),
        "inter_node_bits": int(cfg.inter_node_bits),
    }


def state_dict(state, named_params: Mapping[str, torch.Tensor]) -> Dict[str, Any]:
    """The state of ``state`` (an :class:`ErrorFeedbackState`) as plain types and CPU tensor copies.

    ``{"format", "version", "signature", "step", "params": {name: {"ds_id", "numel", "hop1", "hop2"}}}`` where a
    hop is None or ``{"values": int8|fp32 (rows, P'), "scale": fp32 (rows, P'/group) | None}``.
    """
    from deepspeed_loco.runtime.zero.error_feedback import PARAM_ATTRIBUTE
    names = {id(p): n for n, p in named_params.items()}
    params = {}
    for param in state.params:
        name = names.get(id(param))
        if name is None:
            raise RuntimeError(f"deepspeed-loco: parameter ds_id={getattr(param, 'ds_id', None)} has error-feedback "
                               f"buffers but is not a parameter of the model being checkpointed")
        feedback = getattr(param, PARAM_ATTRIBUTE)
        params[name] = {
            "ds_id": getattr(param, "ds_id", None),
            "numel": _numel(param),
            "hop1": _buffer_state(feedback.hop1),
            "hop2": _buffer_state(feedback.hop2),
        }
    return {"format": FORMAT, "version": FORMAT_VERSION, "signature": signature(state), "step": int(state.step),
            "params": params}


def _buffer_state(buffer) -> Optional[Dict[str, Optional[torch.Tensor]]]:
    if buffer is None:
        return None
    copy = lambda t: None if t is None else t.detach().to("cpu", copy=True)
    return {"values": copy(buffer.values), "scale": copy(buffer.scale)}


def _numel(param: torch.Tensor) -> int:
    return int(getattr(param, "ds_numel", param.numel()))


# ---------------------------------------------------------------------------------------------------- loading
@dataclass
class LoadPlan:
    """A checked LoCo entry, ready to be applied: the step and, per parameter, the saved hop tensors."""
    step: int
    entries: List[Tuple[torch.Tensor, int, Optional[tuple], Optional[tuple]]] = field(default_factory=list)


def parse_state_dict(state, sd: Any, named_params: Mapping[str, torch.Tensor]) -> LoadPlan:
    """Checks a saved entry against ``state`` (config, topology) and the model; touches nothing.

    Raises :class:`LocoCheckpointError` for a corrupt or truncated entry and :class:`LocoCheckpointMismatch` for a
    valid entry saved with another layout.
    """
    try:
        return _parse(state, sd, named_params)
    except (LocoCheckpointError, LocoCheckpointMismatch):
        raise
    except Exception as exc:  # whatever else a damaged entry trips over is reported as corruption, not a crash
        raise LocoCheckpointError(f"deepspeed-loco: checkpoint key {STATE_KEY!r} could not be read "
                                  f"({type(exc).__name__}: {exc})") from exc


def _parse(state, sd: Any, named_params: Mapping[str, torch.Tensor]) -> LoadPlan:
    where = f"checkpoint key {STATE_KEY!r}"
    if not isinstance(sd, Mapping):
        _corrupt(f"{where} is a {type(sd).__name__}, expected a dict")
    missing = [k for k in ("format", "version", "signature", "step", "params") if k not in sd]
    if missing:
        _corrupt(f"{where} lacks field(s) {missing} (truncated or not written by deepspeed-loco)")
    if sd["format"] != FORMAT:
        _corrupt(f"{where}: format is {sd['format']!r}, expected {FORMAT!r}")
    version = sd["version"]
    if not _is_int(version) or version < 1:
        _corrupt(f"{where}: version is {version!r}, expected a positive integer")
    if version != FORMAT_VERSION:
        _corrupt(f"{where}: format version {version} was written by another deepspeed-loco release; this one reads "
                 f"version {FORMAT_VERSION}")
    step = sd["step"]
    if not _is_int(step) or step < 0:
        _corrupt(f"{where}: step is {step!r}, expected an integer >= 0")
    saved = sd["signature"]
    if not isinstance(saved, Mapping):
        _corrupt(f"{where}: signature is a {type(saved).__name__}, expected a dict")
    for key in SIGNATURE_KEYS:
        if key not in saved:
            _corrupt(f"{where}: signature lacks {key!r}")
        kind_ok = isinstance(saved[key], bool) if key in ("hadamard", "error_feedback") else _is_int(saved[key])
        if not kind_ok:
            _corrupt(f"{where}: signature[{key!r}] is {saved[key]!r}, of the wrong type")
    params = sd["params"]
    if not isinstance(params, Mapping):
        _corrupt(f"{where}: params is a {type(params).__name__}, expected a dict")

    current = signature(state)
    changed = [k for k in RESET_KEYS if saved[k] != current[k]]
    if changed:
        diff = ", ".join(f"{k} {saved[k]} -> {current[k]}" for k in changed)
        raise LocoCheckpointMismatch(
            f"the checkpoint's error buffers were saved with {_describe(saved)} and this run has "
            f"{_describe(current)} ({diff}), so they do not fit", int(step))

    plan = LoadPlan(step=int(step))
    topo, cfg = state.topology, state.config
    has_buffers = cfg.error_feedback and topo.world_size > 1
    if params and not has_buffers:
        _corrupt(f"{where} holds buffers for {len(params)} parameter(s) but its signature says there are none")
    for name, entry in params.items():
        if not isinstance(name, str) or name not in named_params:
            _corrupt(f"{where}: buffers for parameter {name!r}, which this model does not have")
        param = named_params[name]
        at = f"{where}, parameter {name!r}"
        if not isinstance(entry, Mapping) or any(k not in entry for k in ("numel", "hop1", "hop2")):
            _corrupt(f"{at}: expected a dict with 'numel', 'hop1' and 'hop2', got {_brief(entry)}")
        numel = _numel(param)
        if not _is_int(entry["numel"]) or entry["numel"] != numel:
            _corrupt(f"{at}: saved for {entry['numel']!r} elements, the model's parameter has {numel}")
        cols = padded_partition_size(numel, topo.world_size, cfg.group_size)
        hop1 = _check_buffer(f"{at}, hop1", entry["hop1"], topo.world_size if topo.local_size > 1 else None, cols,
                             cfg)
        hop2 = _check_buffer(f"{at}, hop2", entry["hop2"], topo.num_nodes if topo.num_nodes > 1 else None, cols,
                             cfg)
        plan.entries.append((param, numel, hop1, hop2))
    return plan


def _check_buffer(at: str, saved: Any, rows: Optional[int], cols: int, cfg) -> Optional[tuple]:
    if rows is None:
        if saved is not None:
            _corrupt(f"{at}: saved, but this layout has no such hop")
        return None
    if not isinstance(saved, Mapping) or "values" not in saved or "scale" not in saved:
        _corrupt(f"{at}: expected a dict with 'values' and 'scale', got {_brief(saved)}")
    values, scale = saved["values"], saved["scale"]
    int8 = cfg.error_bits == 8
    _check_tensor(f"{at}, values", values, torch.int8 if int8 else torch.float32, (rows, cols))
    if int8:
        _check_tensor(f"{at}, scale", scale, torch.float32, (rows, cols // cfg.group_size))
    elif scale is not None:
        _corrupt(f"{at}: scale must be None for error_bits 32, got {_brief(scale)}")
    return values, scale


def _check_tensor(at: str, value: Any, dtype: torch.dtype, shape: tuple) -> None:
    if not isinstance(value, torch.Tensor):
        _corrupt(f"{at}: expected a {dtype} tensor, got {_brief(value)}")
    if value.dtype != dtype:
        _corrupt(f"{at}: dtype {value.dtype}, expected {dtype}")
    if tuple(value.shape) != shape:
        _corrupt(f"{at}: shape {tuple(value.shape)}, expected {shape} (truncated?)")
    if value.is_floating_point() and not bool(torch.isfinite(value).all()):
        bad = int((~torch.isfinite(value)).sum())
        _corrupt(f"{at}: {bad} non-finite value(s); a saved buffer is always finite")


def apply_plan(state, plan: LoadPlan) -> None:
    """Makes ``state`` exactly the checked entry: every buffer zeroed, the saved ones copied in, the step set."""
    state.reset()
    for param, numel, hop1, hop2 in plan.entries:
        feedback = state.for_param(param, numel, _device(param))
        for buffer, saved in ((feedback.hop1, hop1), (feedback.hop2, hop2)):
            if buffer is not None:
                buffer.values.copy_(saved[0])
                if buffer.scale is not None:
                    buffer.scale.copy_(saved[1])
    state.step = plan.step


def _device(param: torch.Tensor) -> torch.device:
    partition = getattr(param, "ds_tensor", None)
    return partition.device if isinstance(partition, torch.Tensor) else param.device


def _describe(sig: Mapping[str, Any]) -> str:
    return (f"W={sig['world_size']} L={sig['local_size']} group_size={sig['group_size']} "
            f"error_bits={sig['error_bits']} hadamard={sig['hadamard']} error_feedback={sig['error_feedback']}")


def _brief(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    if isinstance(value, Mapping):
        return f"a dict with keys {sorted(map(str, value))}"
    return f"{type(value).__name__} {value!r}"[:120]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _corrupt(message: str):
    raise LocoCheckpointError(f"deepspeed-loco: {message}")


# ------------------------------------------------------------------------------------- the optimizer wrapping
_MISSING = object()


@dataclass
class _Decision:
    kind: str  # "load", "reset" or "error"
    why: str = ""
    plan: Optional[LoadPlan] = None
    step: Optional[int] = None  # for "reset": the step counter to restore, None keeps the current one


class CheckpointHooks:
    """Wraps one ZeRO-3 optimizer's ``state_dict`` and ``load_state_dict`` to carry ``hook.state``."""

    def __init__(self, hook, named_params: Mapping[str, torch.Tensor]):
        self.hook = hook
        self.named_params = dict(named_params)
        optimizer = hook.optimizer
        self._original_state_dict = optimizer.state_dict
        self._original_load_state_dict = optimizer.load_state_dict
        self._load_signature = inspect.signature(self._original_load_state_dict)
        optimizer.state_dict = self.state_dict
        optimizer.load_state_dict = self.load_state_dict

    def state_dict(self, *args, **kwargs):
        sd = self._original_state_dict(*args, **kwargs)
        sd[STATE_KEY] = self.hook.state.state_dict(self.named_params)
        return sd

    def load_state_dict(self, *args, **kwargs):
        bound = self._load_signature.bind(*args, **kwargs)
        bound.apply_defaults()
        call = bound.arguments
        decision = self._decide(call.get("state_dict_list"), call.get("checkpoint_folder"),
                                call.get("load_optimizer_states", True))
        if call.get("load_serial") is None:  # serial loading runs the ranks one after another: no collective
            decision = self._agree(decision)
        if decision.kind == "error":
            raise LocoCheckpointError(decision.why)
        result = self._original_load_state_dict(*args, **kwargs)
        self._apply(decision)
        return result

    def _rank(self) -> int:
        group = self.hook.optimizer.dp_process_group
        return dist.get_rank(group=group) if dist.is_initialized() else 0

    def _decide(self, state_dict_list, checkpoint_folder, load_optimizer_states) -> _Decision:
        state = self.hook.state
        entry = _MISSING
        if not checkpoint_folder and state_dict_list is not None:
            mine = state_dict_list[self._rank()]
            if isinstance(mine, dict):
                entry = mine.pop(STATE_KEY, _MISSING)  # DeepSpeed's loader never sees it
        if checkpoint_folder:
            return _Decision("reset", "a universal checkpoint carries no LoCo error-feedback state")
        if not load_optimizer_states:
            return _Decision("reset", "load_optimizer_states=False: LoCo's buffers are optimizer state")
        if entry is _MISSING:
            if not (state.config.error_feedback and state.topology.world_size > 1):
                return _Decision("load", plan=None)
            return _Decision("reset", f"the checkpoint has no {STATE_KEY!r} entry (saved without deepspeed-loco, or "
                             f"by the removed upstream LoCo, which never saved its buffers)")
        try:
            return _Decision("load", plan=parse_state_dict(state, entry, self.named_params))
        except LocoCheckpointMismatch as mismatch:
            return _Decision("reset", str(mismatch), step=mismatch.step)
        except LocoCheckpointError as err:
            if getattr(state.config, "on_corrupt_checkpoint", "error") == "reset":
                return _Decision("reset", f"{err} (zeropp_loco_param.on_corrupt_checkpoint is 'reset')")
            return _Decision("error", f"{err}; the ZeRO-3 optimizer state and LoCo state were not loaded. Set "
                             f"zeropp_loco_param.on_corrupt_checkpoint to 'reset' to start the error buffers from "
                             f"zero instead")

    def _agree(self, decision: _Decision) -> _Decision:
        """Every rank raises if one does, so that no rank goes on into a collective the others never reach."""
        group = self.hook.optimizer.dp_process_group
        if not dist.is_initialized() or dist.get_world_size(group=group) == 1:
            return decision
        from deepspeed.accelerator import get_accelerator
        flag = torch.tensor([1 if decision.kind == "error" else 0], dtype=torch.int32,
                            device=get_accelerator().current_device_name())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if int(flag.item()) and decision.kind != "error":
            return _Decision("error", "deepspeed-loco: the LoCo state in another rank's checkpoint file is corrupt "
                             "(that rank's LocoCheckpointError says what); the ZeRO-3 optimizer state and LoCo "
                             "state were not loaded")
        return decision

    def _apply(self, decision: _Decision) -> None:
        state = self.hook.state
        if decision.kind == "load":
            if decision.plan is not None:
                apply_plan(state, decision.plan)
                if self._rank() == 0:
                    logger.info(f"deepspeed-loco: restored error-feedback state ({len(decision.plan.entries)} "
                                f"parameters, optimizer step {state.step})")
            return
        state.reset()
        if decision.step is not None:
            state.step = decision.step
        logger.warning(f"deepspeed-loco: rank {self._rank()}: error-feedback buffers start from zero: {decision.why}")


def install(hook, named_params: Optional[Mapping[str, torch.Tensor]] = None) -> CheckpointHooks:
    """Makes ``hook.optimizer``'s checkpoints carry ``hook.state``; ``named_params`` default: the optimizer's
    ``param_names`` (DeepSpeed's ``{param: name}`` of the engine's module)."""
    if named_params is None:
        named_params = {name: p for p, name in getattr(hook.optimizer, "param_names", {}).items()}
    return CheckpointHooks(hook, named_params)


__all__ = ["LocoCheckpointError", "STATE_KEY", "FORMAT_VERSION", "state_dict", "parse_state_dict", "apply_plan",
           "install", "ON_CORRUPT_CHOICES"]
