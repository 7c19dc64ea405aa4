"""The checks of :class:`~deepspeed_loco.simulation.spec.TrainingSetup` and
:class:`~deepspeed_loco.simulation.spec.SimulationSpec`, made once, when one is built, before anything trains.

A failure is one ``TypeError`` (a value of the wrong kind) or ``ValueError`` (the right kind, an invalid value)
whose message names the field and what is valid: ``TrainingSetup: <field> = <value> is invalid: it must be ...``. A
``loco`` block that no arm could run with is the :class:`~deepspeed_loco.config.LocoConfigError` (a ``ValueError``)
naming its ``zeropp_loco_param`` key, raised whatever the arms, ``full`` alone included.
"""
import math
import numbers
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from deepspeed_loco.config import CONFIG_KEY, INTER_NODE_ONLY, LocoConfig, LocoConfigError
from deepspeed_loco.simulation.arms import Arm, check_distinct, parse_arm, zeropp_loco_param

GRAD_MODES = ("vmap", "loop")
AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)
ARM_KEYS = ("intra_node_bits", "inter_node_bits", "hadamard", "error_feedback")  # each arm's name sets them
SETUP, RUN = "TrainingSetup", "SimulationSpec"


def check_setup(setup) -> Tuple[Dict[str, Any], torch.device]:
    """Checks every field of a ``TrainingSetup``; returns its ``loco`` block as a dict (checked by
    :class:`LocoConfig` with default bits) and its ``torch.device``.

    Raises TypeError or ValueError naming the first bad field and what would be valid."""
    for name in ("model_fn", "data_fn", "loss_fn", "optimizer_fn"):
        _callable(SETUP, name, getattr(setup, name), optional=False)
    for name in ("scheduler_fn", "eval_fn"):
        _callable(SETUP, name, getattr(setup, name), optional=True)
    for name, minimum in (("nodes", 1), ("local", 1), ("eval_every", 0)):
        _integer(SETUP, name, getattr(setup, name), minimum)
    if setup.rank_chunk is not None:
        _integer(SETUP, "rank_chunk", setup.rank_chunk, 1)
    if setup.eval_every and setup.eval_fn is None:
        raise ValueError(f"{SETUP}: eval_every = {setup.eval_every!r} is invalid without an eval_fn: nothing would "
                         f"be evaluated; pass eval_fn, or leave eval_every at 0")
    _grad_clip(setup.grad_clip)
    _choice("grad_mode", setup.grad_mode, GRAD_MODES)
    _choice("autocast_dtype", setup.autocast_dtype, (None, ) + AUTOCAST_DTYPES)
    if not isinstance(setup.stream_nodes, bool):
        raise TypeError(f"{SETUP}: stream_nodes = {setup.stream_nodes!r} is invalid: it must be True or False")
    _compile(setup.compile, setup.grad_mode)
    loco = _loco(setup.loco, setup.local)
    _valid_block(loco, dict(loco, local_world_size=setup.local))
    return loco, _device(setup.device)


def check_run(spec) -> Tuple[Tuple[Arm, ...], Tuple[Optional[Dict[str, Any]], ...], Tuple[Optional[LocoConfig], ...]]:
    """Checks a ``SimulationSpec``'s arms, steps and seed; returns the arms parsed, each arm's ``zeropp_loco_param``
    block and its :class:`LocoConfig` (both None for ``full``)."""
    _integer(RUN, "steps", spec.steps, 1)
    _integer(RUN, "seed", spec.seed, 0)
    arms = tuple(_arms(spec.arms))
    loco, local = spec.setup.loco, spec.setup.local
    blocks = tuple(zeropp_loco_param(arm, **loco, local_world_size=local) for arm in arms)
    return arms, blocks, tuple(None if block is None else _valid_block(loco, block) for block in blocks)


def _callable(owner: str, name: str, value: Any, optional: bool) -> None:
    if value is None and optional:
        return
    if not callable(value):
        raise TypeError(f"{owner}: {name} = {value!r} is invalid: it must be a callable"
                        + (" or None" if optional else ""))


def _integer(owner: str, name: str, value: Any, minimum: int) -> None:
    rule = f"{owner}: {name} = {value!r} is invalid: it must be an integer >= {minimum}"
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(rule)
    if value < minimum:
        raise ValueError(rule)


def _grad_clip(value: Any) -> None:
    if value is None:
        return
    rule = (f"{SETUP}: grad_clip = {value!r} is invalid: it must be a number > 0 (the largest global norm of the "
            f"communicated mean), or None for no clipping")
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(rule)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(rule)


def _choice(name: str, value: Any, valid: Sequence[Any]) -> None:
    if not any(value is v or value == v for v in valid):
        raise ValueError(f"{SETUP}: {name} = {value!r} is invalid: it must be one of {tuple(valid)}")


def _compile(backend: Any, grad_mode: str) -> None:
    """``compile``: None, or a ``torch.compile`` backend name, with ``grad_mode="loop"`` (the passes it compiles)."""
    if backend is None:
        return
    known = torch.compiler.list_backends(exclude_tags=())
    if not isinstance(backend, str) or backend not in known:
        raise ValueError(f"{SETUP}: compile = {backend!r} is invalid: it must be None or a torch.compile backend "
                         f"of this torch, one of {tuple(known)}")
    if grad_mode != "loop":
        raise ValueError(f"{SETUP}: compile = {backend!r} is invalid with grad_mode = {grad_mode!r}: only the "
                         f"'loop' passes are compiled; set grad_mode='loop' or compile=None")


def _arms(arms: Any) -> List[Arm]:
    """The arms parsed; raises for a single string, a non-list, a bad token, an empty list or a repeated arm."""
    if isinstance(arms, (str, Arm)) or not isinstance(arms, Sequence):
        raise TypeError(f"{RUN}: arms = {arms!r} is invalid: it must be a list of arm names or Arm objects, "
                        f"e.g. ['full', 'plain4', 'loco4']")
    for arm in arms:
        if not isinstance(arm, (str, Arm)):
            raise TypeError(f"{RUN}: arms: {arm!r} is invalid: an arm is a name such as 'loco4' or an Arm")
    try:
        parsed = [parse_arm(a) if isinstance(a, str) else a for a in arms]
        check_distinct(parsed)
    except ValueError as err:
        raise ValueError(f"{RUN}: arms: {err}") from None
    return parsed


def _loco(loco: Any, local: int) -> Dict[str, Any]:
    """A copy of the setup's ``loco`` keys, refused if not a mapping or if it holds a key the layout or the arms
    set."""
    if not isinstance(loco, Mapping):
        raise TypeError(f"{SETUP}: loco = {loco!r} is invalid: it must be a dict of {CONFIG_KEY} keys (e.g. "
                        f"{{'group_size': 256, 'err_beta': 0.8}})")
    if "local_world_size" in loco:
        raise ValueError(f"{SETUP}: loco['local_world_size'] = {loco['local_world_size']!r} is invalid: the ranks "
                         f"per node are the setup's local field (local = {local}); leave the key out of loco")
    # error_feedback "inter_node" narrows every LoCo arm's error feedback to that hop (zeropp_loco_param)
    by_arm = [key for key in ARM_KEYS if key in loco and not (key == "error_feedback" and loco[key] == INTER_NODE_ONLY)]
    if by_arm:
        raise ValueError(f"{SETUP}: loco keys {by_arm} are invalid: each arm's name sets them (bits per hop, "
                         f"Hadamard, error feedback: e.g. 'plain4', 'loco8-2h'); leave them out of loco")
    return dict(loco)


def _valid_block(loco: Dict[str, Any], block: Dict[str, Any]) -> LocoConfig:
    """``block`` (``loco`` with an arm's keys) as a :class:`LocoConfig`; raises :class:`LocoConfigError` naming
    ``loco`` if it is invalid."""
    try:
        return LocoConfig.from_dict(block)
    except LocoConfigError as err:
        raise LocoConfigError(f"{SETUP}: loco = {loco!r} is invalid: {err}") from None


def _device(device: Any) -> torch.device:
    """The torch device, checked to hold a tensor on this machine."""
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"{SETUP}: device = {device!r} is invalid: it must be a device string such as 'cpu' or "
                        f"'cuda:0', or a torch.device")
    try:
        parsed = torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"{SETUP}: device = {device!r} is invalid: it must be a device string such as 'cpu', "
                         f"'cuda' or 'cuda:1' (torch: {_first_line(err)})") from None
    try:
        torch.empty(0, device=parsed)
    except (RuntimeError, AssertionError) as err:
        raise ValueError(f"{SETUP}: device = {device!r} is invalid on this machine ({_first_line(err)}): it must "
                         f"be a device torch can use here, e.g. 'cpu'") from None
    return parsed


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]
