"""LoCo's limits, read from their one source, ``deepspeed_loco/csrc/quantization/loco_limits.h``.

The header is shared by the CUDA kernels and their binding (which validates against it); this module parses it so
that the config (``deepspeed_loco.config``) and the ops (:func:`check_launch`, before a call of the kernels) validate
against the same numbers. Names are the header's without the ``k`` prefix, in upper snake case:

``WIRE_BITS``: tuple of int, the gradient bits a hop can send (2, 3, 4, 8).
``MIN_GROUP_SIZE`` / ``MAX_GROUP_SIZE``: int, elements per quantization group (a power of two in that range).
``MAX_PARAMETER_PAIRS`` / ``MAX_LAUNCH_PAIRS``: int, the (row, group) pairs a parameter and a bucket may have on a
hop (the kernels index them in 32 bits).

The error-buffer storages and the grids are formats (:mod:`deepspeed_loco.layout.formats`), not limits.
"""
import re
from pathlib import Path
from typing import Dict, Sequence, Tuple, Union

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
    missing = {"WIRE_BITS", "MIN_GROUP_SIZE", "MAX_GROUP_SIZE", "MAX_PARAMETER_PAIRS", "MAX_LAUNCH_PAIRS"} - set(values)
    if missing:
        raise ImportError(f"LoCo limits header {HEADER} does not define {sorted(missing)}")
    return values


LIMITS = _load()
WIRE_BITS: Tuple[int, ...] = LIMITS["WIRE_BITS"]
MIN_GROUP_SIZE: int = LIMITS["MIN_GROUP_SIZE"]
MAX_GROUP_SIZE: int = LIMITS["MAX_GROUP_SIZE"]
MAX_PARAMETER_PAIRS: int = LIMITS["MAX_PARAMETER_PAIRS"]
MAX_LAUNCH_PAIRS: int = LIMITS["MAX_LAUNCH_PAIRS"]


def check_launch(widths: Sequence[int], rows: int, group_size: int, what: str) -> None:
    """ValueError, naming ``what[i]`` and the limit, when the parameter of padded width ``widths[i]`` has more
    (row, group) pairs on a hop of ``rows`` rows than ``MAX_PARAMETER_PAIRS``, or the bucket more than
    ``MAX_LAUNCH_PAIRS``: the sizes the kernels index in 32 bits (``what``: the bucket's tensors, e.g. ``"grads"``)."""
    if not widths:
        return
    widest = max(widths)
    if rows * (widest // group_size) > MAX_PARAMETER_PAIRS:
        index = widths.index(widest)
        raise ValueError(f"LoCo kernels: {what}[{index}] has {rows} x {widest // group_size} = "
                         f"{rows * (widest // group_size)} (row, group) pairs on this hop, above kMaxParameterPairs = "
                         f"{MAX_PARAMETER_PAIRS} (loco_limits.h); use a larger group_size")
    pairs = rows * (sum(widths) // group_size)
    if pairs > MAX_LAUNCH_PAIRS:
        raise ValueError(f"LoCo kernels: the bucket of {what} ({len(widths)} tensors) has {pairs} (row, group) pairs "
                         f"on this hop, above kMaxLaunchPairs = {MAX_LAUNCH_PAIRS} (loco_limits.h); use smaller "
                         f"buckets")
