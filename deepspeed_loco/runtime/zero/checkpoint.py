"""LoCo's error-feedback state in DeepSpeed checkpoints: what is saved, how it is checked, when it is reset.

Saving: the ZeRO-3 optimizer's ``state_dict`` gains the key ``"deepspeed_loco"`` (:func:`state_dict`), so every
rank's buffers and the reset counter land in that rank's ``zero_pp_rank_*_optim_states.pt`` next to the rest of
its optimizer state, written and read by ``engine.save_checkpoint`` / ``engine.load_checkpoint``.

Loading: the wrapped ``load_state_dict`` (``runtime/deepspeed_seam.py``, which owns every touch of DeepSpeed) takes
this rank's entry out of the list before DeepSpeed's own loader sees it, asks :func:`decide_load` (which checks all
of it with :func:`parse_state_dict` before anything is loaded), agrees with the other ranks, lets DeepSpeed load,
then :func:`apply_decision` restores the buffers and the step counter. This module is the serializer: it wraps the
error state's own :meth:`~deepspeed_loco.runtime.comm.error_feedback.ErrorFeedbackState.state_dict` (buffers keyed by
parameter name, ``{parameter name: {hop name: buffer}}``) in the checkpoint format, checks an entry before handing it
to the state's ``load_state_dict``, and never touches DeepSpeed. The rules (``docs/checkpointing.md``):

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
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional

import torch

from deepspeed_loco.config import INTER_NODE_ONLY
from deepspeed_loco.layout import INTER_NODE, INTRA_NODE
from deepspeed_loco.runtime.zero import deepspeed_seam
from deepspeed_loco.utils.logging import logger

STATE_KEY = "deepspeed_loco"
FORMAT = "deepspeed_loco.error_feedback"
FORMAT_VERSION = 2  # 2: buffers keyed by hop name; 1 (read too): fixed keys "hop1" (intra-node), "hop2" (inter-node)
READ_VERSIONS = (1, 2)
V1_HOP_NAMES = {"hop1": INTRA_NODE, "hop2": INTER_NODE}
# signature entries whose difference makes the saved buffers meaningless here (layout, storage or basis)
RESET_KEYS = ("world_size", "local_size", "group_size", "error_bits", "hadamard", "error_feedback")
# recorded and compared for information only: the buffers hold not-yet-sent gradient in gradient units, which
# does not depend on the wire's bit width
INFO_KEYS = ("intra_node_bits", "inter_node_bits")
SIGNATURE_KEYS = RESET_KEYS + INFO_KEYS
PREFIX = "deepspeed-loco: "  # what starts every error and warning of this module, once


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
    cfg, plan = state.config, state.plan
    return {
        "world_size": int(plan.world_size),
        "local_size": int(plan.local_size),
        "group_size": int(plan.group_size),
        "error_bits": int(state.error_bits),
        "hadamard": bool(plan.hadamard),
        "error_feedback": state.error_feedback,
        "intra_node_bits": int(cfg.intra_node_bits),
        "inter_node_bits": int(cfg.inter_node_bits),
    }


def state_dict(state, named_params: Mapping[str, torch.Tensor]) -> Dict[str, Any]:
    """The state of ``state`` (an :class:`ErrorFeedbackState`) as plain types and CPU tensor copies.

    ``{"format", "version", "signature", "step", "params": {name: {"ds_id", "numel", "buffers": {hop name:
    {"values": int8|fp32 (rows, P'), "scale": fp32 (rows, P'/group) | None}}}}}``, one buffer per hop of the plan:
    the state's own ``state_dict`` with the format, the signature and each parameter's ``ds_id`` (for
    information; ``named_params`` maps the state's parameter names to the model's parameters).
    """
    saved = state.state_dict()
    params = {}
    for name, entry in saved["params"].items():
        if name not in named_params:
            raise RuntimeError(f"deepspeed-loco: parameter {name!r} has error-feedback buffers but is not a parameter "
                               f"of the model being checkpointed")
        params[name] = {"ds_id": deepspeed_seam.param_id(named_params[name]), **entry}
    return {"format": FORMAT, "version": FORMAT_VERSION, "signature": signature(state), "step": int(saved["step"]),
            "params": params}


# ---------------------------------------------------------------------------------------------------- loading
@dataclass
class LoadPlan:
    """A checked LoCo entry, ready to be applied: the step, per parameter name the saved ``{"numel", "buffers":
    {hop name: {"values", "scale"}}}`` (the shape of ``ErrorFeedbackState.state_dict``), and the device of each
    parameter's partition (where the buffers a parameter does not have yet are allocated)."""
    step: int
    params: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    devices: Dict[str, torch.device] = field(default_factory=dict)


def load_state_dict(state, sd: Any, named_params: Mapping[str, torch.Tensor]) -> None:
    """Restores a :func:`state_dict` into ``state``: checks all of it first (``LocoCheckpointError`` if corrupt,
    ``LocoCheckpointMismatch`` if saved with another layout), then sets the buffers and the step counter."""
    apply_plan(state, parse_state_dict(state, sd, named_params))


def parse_state_dict(state, sd: Any, named_params: Mapping[str, torch.Tensor]) -> LoadPlan:
    """Checks a saved entry against ``state`` (config, hop plan) and the model; touches nothing.

    Raises :class:`LocoCheckpointError` for a corrupt or truncated entry and :class:`LocoCheckpointMismatch` for a
    valid entry saved with another layout.
    """
    try:
        return _parse(state, sd, named_params)
    except (LocoCheckpointError, LocoCheckpointMismatch):
        raise
    except Exception as exc:  # whatever else a damaged entry trips over is reported as corruption, not a crash
        raise LocoCheckpointError(f"{PREFIX}checkpoint key {STATE_KEY!r} could not be read "
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
    if version not in READ_VERSIONS:
        _corrupt(f"{where}: format version {version} was written by another deepspeed-loco release; this one reads "
                 f"versions {list(READ_VERSIONS)}")
    step = sd["step"]
    if not _is_int(step) or step < 0:
        _corrupt(f"{where}: step is {step!r}, expected an integer >= 0")
    saved = sd["signature"]
    if not isinstance(saved, Mapping):
        _corrupt(f"{where}: signature is a {type(saved).__name__}, expected a dict")
    for key in SIGNATURE_KEYS:
        if key not in saved:
            _corrupt(f"{where}: signature lacks {key!r}")
        value = saved[key]
        if key == "error_feedback":  # true, false or "inter_node", as the config key
            kind_ok = isinstance(value, bool) or value == INTER_NODE_ONLY
        else:
            kind_ok = isinstance(value, bool) if key == "hadamard" else _is_int(value)
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
    rows = state.rows()
    if params and not rows:
        _corrupt(f"{where} holds buffers for {len(params)} parameter(s) but its signature says there are none")
    for name, entry in params.items():
        if not isinstance(name, str) or name not in named_params:
            _corrupt(f"{where}: buffers for parameter {name!r}, which this model does not have")
        param = named_params[name]
        at = f"{where}, parameter {name!r}"
        buffers = _entry_buffers(at, entry, version)
        numel = deepspeed_seam.param_numel(param)
        if not _is_int(entry["numel"]) or entry["numel"] != numel:
            _corrupt(f"{at}: saved for {entry['numel']!r} elements, the model's parameter has {numel}")
        extra = sorted(set(buffers) - set(rows))
        if extra:
            _corrupt(f"{at}: buffers for hop(s) {extra}, which this layout does not have (hops: {list(rows)})")
        cols = state.plan.widths([numel])[0]
        plan.params[name] = {"numel": numel, "buffers": {
            hop: _check_buffer(f"{at}, {hop}", buffers.get(hop), count, cols, state) for hop, count in rows.items()}}
        plan.devices[name] = deepspeed_seam.partition_device(param)
    return plan


def _entry_buffers(at: str, entry: Any, version: int) -> Mapping[str, Any]:
    """A parameter entry's ``{hop name: saved buffer}``; version 1 named the hops ``hop1`` and ``hop2``."""
    fields_ = ("numel", "buffers") if version >= 2 else ("numel", ) + tuple(V1_HOP_NAMES)
    if not isinstance(entry, Mapping) or any(k not in entry for k in fields_):
        _corrupt(f"{at}: expected a dict with {', '.join(repr(k) for k in fields_[:-1])} and {fields_[-1]!r}, "
                 f"got {_brief(entry)}")
    if version == 1:
        return {hop: entry[old] for old, hop in V1_HOP_NAMES.items() if entry[old] is not None}
    if not isinstance(entry["buffers"], Mapping):
        _corrupt(f"{at}: buffers is {_brief(entry['buffers'])}, expected a dict keyed by hop name")
    return entry["buffers"]


def _check_buffer(at: str, saved: Any, rows: int, cols: int, state) -> Dict[str, Any]:
    if not isinstance(saved, Mapping) or "values" not in saved or "scale" not in saved:
        _corrupt(f"{at}: expected a dict with 'values' and 'scale', got {_brief(saved)}")
    values, scale = saved["values"], saved["scale"]
    storage = state.storage
    _check_tensor(f"{at}, values", values, storage.values_dtype, storage.values_shape(rows, cols))
    if storage.scaled:
        _check_tensor(f"{at}, scale", scale, torch.float32, (rows, cols // state.plan.group_size))
    elif scale is not None:
        _corrupt(f"{at}: scale must be None for error_bits {storage.bits}, got {_brief(scale)}")
    return {"values": values, "scale": scale}


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
    state.load_state_dict({"step": plan.step, "params": plan.params}, plan.devices)


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
    raise LocoCheckpointError(f"{PREFIX}{message}")


# ------------------------------------------------------------------------------------------- what a load does
@dataclass
class LoadDecision:
    """What loading a checkpoint does to the LoCo state: ``kind`` is "load" (``plan``, None when there is nothing
    to restore), "reset" (zero the buffers, restore ``step`` unless None; ``why`` is logged) or "error" (raise)."""
    kind: str
    why: str = ""
    plan: Optional[LoadPlan] = None
    step: Optional[int] = None


def decide_load(state, entry: Any, named_params: Mapping[str, torch.Tensor], universal: bool,
                load_optimizer_states: bool) -> LoadDecision:
    """The rules of ``docs/checkpointing.md`` for this rank's saved ``entry`` (``MISSING`` when the file has none)."""
    if universal:
        return LoadDecision("reset", "a universal checkpoint carries no LoCo error-feedback state")
    if not load_optimizer_states:
        return LoadDecision("reset", "load_optimizer_states=False: LoCo's buffers are optimizer state")
    if entry is MISSING:
        if not state.rows():
            return LoadDecision("load")
        return LoadDecision("reset", f"the checkpoint has no {STATE_KEY!r} entry (saved without deepspeed-loco, or "
                            f"by the removed upstream LoCo, which never saved its buffers)")
    try:
        return LoadDecision("load", plan=parse_state_dict(state, entry, named_params))
    except LocoCheckpointMismatch as mismatch:
        return LoadDecision("reset", str(mismatch), step=mismatch.step)
    except LocoCheckpointError as err:
        if state.config.on_corrupt_checkpoint == "reset":  # the warning says "deepspeed-loco: rank N:" itself
            return LoadDecision("reset", f"{str(err).removeprefix(PREFIX)} (zeropp_loco_param.on_corrupt_checkpoint "
                                f"is 'reset')")
        return LoadDecision("error", f"{err}; the ZeRO-3 optimizer state and LoCo state were not loaded. Set "
                            f"zeropp_loco_param.on_corrupt_checkpoint to 'reset' to start the error buffers from "
                            f"zero instead")


def apply_decision(state, decision: LoadDecision, rank: int) -> None:
    """Carries out a "load" or "reset" decision on ``state`` and logs it (rank ``rank``); an "error" decision
    raises :class:`LocoCheckpointError` with its ``why`` and leaves ``state`` as it is."""
    if decision.kind == "error":
        raise LocoCheckpointError(decision.why)
    if decision.kind == "load":
        if decision.plan is not None:
            apply_plan(state, decision.plan)
            if rank == 0:
                logger.info(f"deepspeed-loco: restored error-feedback state ({len(decision.plan.params)} "
                            f"parameters, optimizer step {state.step})")
        return
    state.reset()
    if decision.step is not None:
        state.step = decision.step
    logger.warning(f"{PREFIX}rank {rank}: error-feedback buffers start from zero: {decision.why}")


MISSING = object()  # a checkpoint file without a LoCo entry

__all__ = ["LocoCheckpointError", "LocoCheckpointMismatch", "STATE_KEY", "FORMAT_VERSION", "state_dict",
           "load_state_dict", "parse_state_dict", "apply_plan", "LoadDecision", "decide_load", "apply_decision",
           "MISSING"]
