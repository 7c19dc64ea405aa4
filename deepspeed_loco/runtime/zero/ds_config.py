"""Takes ``zero_optimization.zeropp_loco_param`` out of a DeepSpeed config before DeepSpeed sees it.

DeepSpeed >= 0.19.8 rejects the key; deepspeed-loco validates it, removes it, and hands DeepSpeed the rest. The
block anywhere else in the config (at the top level, under a misspelled ``zero_optimisation``, inside another
block) is an error naming where it belongs: DeepSpeed itself would ignore it there, and the job would train without
LoCo and say nothing.
"""
import copy
import json
from typing import Any, Iterator, Mapping, Optional, Tuple

from deepspeed_loco.config import CONFIG_KEY, LocoConfig, LocoConfigError


def load_config(config: Any) -> Optional[dict]:
    """A DeepSpeed config given as a dict or a path to a JSON/HJSON file, as a new dict (None stays None)."""
    if config is None:
        return None
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    if isinstance(config, str):
        with open(config) as handle:
            text = handle.read()
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            import hjson  # DeepSpeed's own config format, a DeepSpeed dependency
            return hjson.loads(text)
    raise TypeError(f"DeepSpeed config must be a dict or a path to a JSON file, got {type(config).__name__}")


def split_given_config(config: Any) -> Tuple[Any, Optional[LocoConfig]]:
    """(the config DeepSpeed may see, the validated LoCo config or None) for a config as a caller gives it to
    DeepSpeed: a dict or JSON/HJSON path with the block becomes a dict without it; anything else (no block, None,
    another type) is returned as it is."""
    if not isinstance(config, (str, Mapping)):
        return config, None
    stripped, loco = split_loco_config(load_config(config))
    return (stripped if loco is not None else config), loco


def split_loco_config(ds_config: dict) -> Tuple[dict, Optional[LocoConfig]]:
    """Returns (the config without ``zeropp_loco_param``, the validated LoCo config or None if absent).

    LoCo needs ZeRO stage 3 with ``zero_quantized_gradients: true``; anything else is an error saying what to set.
    A ``zeropp_loco_param`` anywhere but under ``zero_optimization`` is an error naming where it belongs
    (:func:`misplaced_blocks`).
    """
    misplaced = list(misplaced_blocks(ds_config))
    if misplaced:
        found = ", ".join("the top level of the config" if where == CONFIG_KEY else where for where in misplaced)
        raise LocoConfigError(f"{CONFIG_KEY} is at {found}, where nothing reads it (LoCo would be off): it belongs at "
                              f"zero_optimization.{CONFIG_KEY}, inside the \"zero_optimization\" block beside "
                              f"\"stage\": 3; move it there")
    zero = ds_config.get("zero_optimization")
    if not isinstance(zero, Mapping) or CONFIG_KEY not in zero:
        return ds_config, None
    stripped = dict(ds_config)
    stripped["zero_optimization"] = {k: v for k, v in zero.items() if k != CONFIG_KEY}
    loco = LocoConfig.from_dict(zero[CONFIG_KEY])
    stage = zero.get("stage", 0)
    if stage != 3:
        raise LocoConfigError(f"zero_optimization.{CONFIG_KEY} needs ZeRO stage 3, but zero_optimization.stage = "
                              f"{stage!r}: set \"stage\": 3 (or remove {CONFIG_KEY})")
    if zero.get("zero_quantized_gradients") is not True:
        found = (f"= {zero['zero_quantized_gradients']!r}" if "zero_quantized_gradients" in zero else "is not set")
        raise LocoConfigError(f"zero_optimization.{CONFIG_KEY} needs quantized gradients (ZeRO++ qgZ), but "
                              f"zero_optimization.zero_quantized_gradients {found}: "
                              f"set \"zero_quantized_gradients\": true (or remove {CONFIG_KEY})")
    return stripped, loco


def misplaced_blocks(node: Any, path: str = "") -> Iterator[str]:
    """The path (``zero_optimisation.zeropp_loco_param``, ``a.b[0].zeropp_loco_param``) of every ``zeropp_loco_param``
    key in the config ``node`` other than ``zero_optimization.zeropp_loco_param``, in the config's order."""
    if isinstance(node, Mapping):
        for key, value in node.items():
            where = f"{path}.{key}" if path else str(key)
            if key == CONFIG_KEY and where != f"zero_optimization.{CONFIG_KEY}":
                yield where
            else:
                yield from misplaced_blocks(value, where)
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from misplaced_blocks(value, f"{path}[{index}]")
