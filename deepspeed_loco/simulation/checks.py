"""The argument checks of :func:`~deepspeed_loco.simulation.train.simulate`, all made before anything trains.

A failure is one ``TypeError`` (a value of the wrong kind) or ``ValueError`` (the right kind, an invalid value)
whose message names the argument and what is valid: ``simulate: <argument> = <value> is invalid: it must be
...``. A ``loco`` block that no arm could run with is the :class:`~deepspeed_loco.config.LocoConfigError` (a
``ValueError``) naming its ``zeropp_loco_param`` key, raised whatever the arms, ``full`` alone included.
"""
import math
import numbers
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from deepspeed_loco.config import CONFIG_KEY, LocoConfig, LocoConfigError
from deepspeed_loco.layout import plan_hops
from deepspeed_loco.simulation.arms import Arm, check_distinct, parse_arm, zeropp_loco_param

GRAD_MODES = ("vmap", "loop")
AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)
ARM_KEYS = ("intra_node_bits", "inter_node_bits", "hadamard", "error_feedback")  # each arm's name sets them


def check_arguments(*, model_fn, data_fn, arms, steps, nodes, local, loco, optimizer_fn, scheduler_fn, loss_fn,
                    eval_fn, eval_every, device, seed, grad_clip, autocast_dtype, grad_mode, error_feedback_hops,
                    diagnostics, rank_chunk, error_feedback_from_step, stream_nodes,
                    on_step) -> Tuple[List[Arm], List[Optional[Dict[str, Any]]], torch.device]:
    """Checks every argument of ``simulate`` (same names and meanings); returns the arms parsed, each arm's
    ``zeropp_loco_param`` block (None for ``full``; validated by :class:`LocoConfig`) and the torch device.

    Raises TypeError or ValueError naming the first bad argument and what would be valid.
    """
    for name, value in (("model_fn", model_fn), ("data_fn", data_fn), ("loss_fn", loss_fn)):
        _callable(name, value, optional=False)
    for name, value in (("optimizer_fn", optimizer_fn), ("scheduler_fn", scheduler_fn), ("eval_fn", eval_fn),
                        ("on_step", on_step)):
        _callable(name, value, optional=True)
    for name, value, minimum in (("steps", steps, 1), ("nodes", nodes, 1), ("local", local, 1), ("seed", seed, 0),
                                 ("eval_every", eval_every, 0),
                                 ("error_feedback_from_step", error_feedback_from_step, 1)):
        _integer(name, value, minimum)
    if rank_chunk is not None:
        _integer("rank_chunk", rank_chunk, 1)
    if eval_every and eval_fn is None:
        raise ValueError(f"simulate: eval_every = {eval_every!r} is invalid without an eval_fn: nothing would be "
                         f"evaluated; pass eval_fn, or leave eval_every at 0")
    _grad_clip(grad_clip)
    _choice("grad_mode", grad_mode, GRAD_MODES)
    _choice("autocast_dtype", autocast_dtype, (None, ) + AUTOCAST_DTYPES)
    for name, value in (("diagnostics", diagnostics), ("stream_nodes", stream_nodes)):
        if not isinstance(value, bool):
            raise TypeError(f"simulate: {name} = {value!r} is invalid: it must be True or False")
    parsed = _arms(arms)
    blocks = _loco_blocks(parsed, loco, local)
    _hops(error_feedback_hops, nodes, local)
    return parsed, blocks, _device(device)


def _callable(name: str, value: Any, optional: bool) -> None:
    if value is None and optional:
        return
    if not callable(value):
        raise TypeError(f"simulate: {name} = {value!r} is invalid: it must be a callable"
                        + (" or None" if optional else ""))


def _integer(name: str, value: Any, minimum: int) -> None:
    rule = f"simulate: {name} = {value!r} is invalid: it must be an integer >= {minimum}"
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(rule)
    if value < minimum:
        raise ValueError(rule)


def _grad_clip(value: Any) -> None:
    if value is None:
        return
    rule = (f"simulate: grad_clip = {value!r} is invalid: it must be a number > 0 (the largest global norm of the "
            f"communicated mean), or None for no clipping")
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(rule)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(rule)


def _choice(name: str, value: Any, valid: Sequence[Any]) -> None:
    if not any(value is v or value == v for v in valid):
        raise ValueError(f"simulate: {name} = {value!r} is invalid: it must be one of {tuple(valid)}")


def _arms(arms: Any) -> List[Arm]:
    """The arms parsed; raises for a single string, a non-list, a bad token, an empty list or a repeated arm."""
    if isinstance(arms, (str, Arm)) or not isinstance(arms, Sequence):
        raise TypeError(f"simulate: arms = {arms!r} is invalid: it must be a list of arm names or Arm objects, "
                        f"e.g. ['full', 'plain4', 'loco4']")
    for arm in arms:
        if not isinstance(arm, (str, Arm)):
            raise TypeError(f"simulate: arms: {arm!r} is invalid: an arm is a name such as 'loco4' or an Arm")
    try:
        parsed = [parse_arm(a) if isinstance(a, str) else a for a in arms]
        check_distinct(parsed)
    except ValueError as err:
        raise ValueError(f"simulate: arms: {err}") from None
    return parsed


def _loco_blocks(arms: Sequence[Arm], loco: Any, local: int) -> List[Optional[Dict[str, Any]]]:
    """Each arm's ``zeropp_loco_param`` block over ``loco``, checked by :class:`LocoConfig`; with no qgZ arm, the
    block of default bits over ``loco`` is checked all the same."""
    if loco is None:
        loco = {}
    if not isinstance(loco, Mapping):
        raise TypeError(f"simulate: loco = {loco!r} is invalid: it must be a dict of {CONFIG_KEY} keys (e.g. "
                        f"{{'group_size': 256, 'err_beta': 0.8}}) or None")
    if "local_world_size" in loco:
        raise ValueError(f"simulate: loco['local_world_size'] = {loco['local_world_size']!r} is invalid: the ranks "
                         f"per node are simulate's local= argument (local = {local}); leave the key out of loco")
    by_arm = [key for key in ARM_KEYS if key in loco]
    if by_arm:
        raise ValueError(f"simulate: loco keys {by_arm} are invalid: each arm's name sets them (bits per hop, "
                         f"Hadamard, error feedback: e.g. 'plain4', 'loco8-2h'); leave them out of loco")
    blocks = [zeropp_loco_param(arm, **loco, local_world_size=local) for arm in arms]
    for block in [b for b in blocks if b is not None] or [dict(loco, local_world_size=local)]:
        try:
            LocoConfig.from_dict(block)
        except LocoConfigError as err:
            raise LocoConfigError(f"simulate: loco = {dict(loco)!r} is invalid: {err}") from None
    return blocks


def _hops(error_feedback_hops: Any, nodes: int, local: int) -> None:
    """``error_feedback_hops``: None, or hop names of the ``nodes x local`` layout."""
    if error_feedback_hops is None:
        return
    known = [hop.name for hop in plan_hops(nodes * local, local, LocoConfig()).hops]
    if isinstance(error_feedback_hops, str) or not isinstance(error_feedback_hops, (Sequence, set, frozenset)):
        raise TypeError(f"simulate: error_feedback_hops = {error_feedback_hops!r} is invalid: it must be a tuple of "
                        f"hop names from {known}, or None")
    unknown = sorted(set(map(str, error_feedback_hops)) - set(known))
    if unknown:
        raise ValueError(f"simulate: error_feedback_hops {unknown} are not hops of this layout {known}")


def _device(device: Any) -> torch.device:
    """The torch device, checked to hold a tensor on this machine."""
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"simulate: device = {device!r} is invalid: it must be a device string such as 'cpu' or "
                        f"'cuda:0', or a torch.device")
    try:
        parsed = torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"simulate: device = {device!r} is invalid: it must be a device string such as 'cpu', "
                         f"'cuda' or 'cuda:1' (torch: {_first_line(err)})") from None
    try:
        torch.empty(0, device=parsed)
    except (RuntimeError, AssertionError) as err:
        raise ValueError(f"simulate: device = {device!r} is invalid on this machine ({_first_line(err)}): it must "
                         f"be a device torch can use here, e.g. 'cpu'") from None
    return parsed


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]
