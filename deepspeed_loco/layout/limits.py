"""LoCo's limits, read from their one source, ``deepspeed_loco/csrc/quantization/loco_limits.h``.

The header is shared by the CUDA kernels and their binding (which validates against it); this module parses it so
that the config (``deepspeed_loco.config``) and the ops validate against the same numbers. Names are the header's
without the ``k`` prefix, in upper snake case:

``WIRE_BITS``: tuple of int, the gradient bits a hop can send (2, 3, 4, 8).
``ERROR_BITS``: tuple of int, the error-buffer storage bits (8: int8 + fp32 scale per group; 32: fp32).
``MIN_GROUP_SIZE`` / ``MAX_GROUP_SIZE``: int, elements per quantization group (a power of two in that range).
"""
import re
from pathlib import Path
from typing import Dict, Tuple, Union

HEADER = Path(__file__).resolve().parents[1] / "csrc" / "quantization" / "loco_limits.h"
_DEFINITION = re.compile(r"^\s*constexpr\s+int\s+k(\w+?)(\[\])?\s*=\s*(\{[^}]*\}|-?\d+)\s*;", re.MULTILINE)


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).upper()


def parse(text: str) -> Dict[str, Union[int, Tuple[int, ...]]]:
    """The ``constexpr int`` definitions of a limits header: scalars as int, arrays as tuples of int."""
    found = {}
    for name, array, value in _DEFINITION.findall(text):
        numbers = tuple(int(v) for v in re.findall(r"-?\d+", value))
        found[_snake(name)] = numbers if array else numbers[0]
    return found


def _load() -> Dict[str, Union[int, Tuple[int, ...]]]:
    try:
        values = parse(HEADER.read_text())
    except OSError as exc:
        raise ImportError(f"LoCo limits header {HEADER} is missing (an install without its package data?)") from exc
    missing = {"WIRE_BITS", "ERROR_BITS", "MIN_GROUP_SIZE", "MAX_GROUP_SIZE"} - set(values)
    if missing:
        raise ImportError(f"LoCo limits header {HEADER} does not define {sorted(missing)}")
    return values


LIMITS = _load()
WIRE_BITS: Tuple[int, ...] = LIMITS["WIRE_BITS"]
ERROR_BITS: Tuple[int, ...] = LIMITS["ERROR_BITS"]
MIN_GROUP_SIZE: int = LIMITS["MIN_GROUP_SIZE"]
MAX_GROUP_SIZE: int = LIMITS["MAX_GROUP_SIZE"]
