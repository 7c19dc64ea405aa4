"""The formats of LoCo's numbers, declared once: how an error buffer stores its error (:class:`ErrorStorage`) and
the quantization grids (:data:`GRIDS`, each a :class:`Rounding` of the quotient ``c / scale``).

The CUDA kernels mirror both in ``deepspeed_loco/csrc/quantization/loco_formats.h`` (same names, values and order;
``tests/unit/layout/test_formats.py`` compiles that header and compares). The config's JSON values are these
formats' public names: ``error_bits`` is an :class:`ErrorStorage` value (8 or 32), ``quant_grid`` a name of
:data:`GRIDS` (or ``"auto"``).
"""
import enum
from dataclasses import dataclass
from typing import Dict, Tuple

import torch

from deepspeed_loco.layout.partition import SCALE_BYTES


class ErrorStorage(enum.IntEnum):
    """How an error-feedback buffer keeps its fp32 error ``(rows, cols)`` between steps; the value is its bits
    (``zeropp_loco_param.error_bits``). ``NONE``: no buffer (error feedback off), a case only the kernels take."""
    NONE = 0
    INT8 = 8  # int8 codes (rows, cols) and one fp32 scale per group (rows, cols // group_size): symmetric, qmax 127
    FP32 = 32  # fp32 values (rows, cols), no scale

    @property
    def label(self) -> str:
        """The storage as the start-up line and messages name it: ``"int8"``, ``"fp32"`` or ``"none"``."""
        return self.name.lower()

    @property
    def values_dtype(self) -> torch.dtype:
        """The dtype of the buffer's values (ValueError for ``NONE``, which has none)."""
        if self is ErrorStorage.NONE:
            raise ValueError("ErrorStorage.NONE holds no values")
        return torch.int8 if self is ErrorStorage.INT8 else torch.float32

    @property
    def scaled(self) -> bool:
        """Whether the values come with one fp32 scale per group (their error is ``values * scale``)."""
        return self is ErrorStorage.INT8

    def row_bytes(self, cols: int, group_size: int) -> int:
        """Bytes of one buffer row of ``cols`` columns (a multiple of ``group_size``), scales included."""
        values = cols * torch.empty((), dtype=self.values_dtype).element_size()
        return values + (cols // group_size * SCALE_BYTES if self.scaled else 0)

    @classmethod
    def of_values(cls, dtype: torch.dtype) -> "ErrorStorage":
        """The storage whose values have ``dtype``; ValueError naming the valid ones otherwise."""
        for storage in STORED:
            if storage.values_dtype == dtype:
                return storage
        raise ValueError(f"error values of dtype {dtype}: an error buffer holds "
                         f"{' or '.join(str(s.values_dtype) for s in STORED)} values")


STORED: Tuple[ErrorStorage, ...] = (ErrorStorage.INT8, ErrorStorage.FP32)  # what a buffer can be: the error_bits


class Rounding(enum.IntEnum):
    """How a grid turns the quotient ``c / scale`` into a code ``k``, and the value ``k`` stands for: the centre of
    the cell of quotients that round to ``k``, :attr:`cell_centre` above ``k``."""
    NEAREST_EVEN = 0  # k = rint(c / scale), ties to even: cell [k - 1/2, k + 1/2], value k * scale
    FLOOR = 1  # k = floor(c / scale): cell [k, k + 1), value (k + 1/2) * scale

    @property
    def cell_centre(self) -> float:
        """The code's value offset: code ``k`` stands for ``(k + cell_centre) * scale`` (0 or 0.5, exact in fp32)."""
        return 0.5 if self is Rounding.FLOOR else 0.0


@dataclass(frozen=True)
class Levels:
    """A grid at ``b`` bits, as the kernels' ``math::Levels`` hold it: ``scale = absmax / divisor``, codes in
    ``[low, high]``, the value of code ``k`` is ``(k + half) * scale``."""
    divisor: float
    low: int
    high: int
    half: float


@dataclass(frozen=True)
class Grid:
    """A quantization grid: its values are symmetric about zero, the largest at ``absmax``; its :class:`Rounding`
    decides the rest (:meth:`levels`)."""
    name: str
    rounding: Rounding

    def levels(self, bits: int) -> Levels:
        """The grid at ``bits`` bits: highest code ``2^(b-1) - 1``, the lowest its mirror (``-(high + 2 half)``),
        the divisor the highest value in steps (``high + half``)."""
        high, half = (1 << (bits - 1)) - 1, self.rounding.cell_centre
        return Levels(high + half, -high - int(2 * half), high, half)


GRIDS: Dict[str, Grid] = {grid.name: grid for grid in (  # by name; the order is loco_formats.h's kGrids
    Grid("symmetric", Rounding.NEAREST_EVEN),  # DeepSpeed's qgZ grid: k in [-qmax, qmax], qmax = 2^(b-1) - 1
    Grid("midrise", Rounding.FLOOR),  # every code used: k in [-2^(b-1), 2^(b-1) - 1]
)}
GRID_NAMES: Tuple[str, ...] = tuple(GRIDS)


def grid_named(name: str) -> Grid:
    """The grid called ``name``; ValueError naming the valid ones otherwise."""
    try:
        return GRIDS[name]
    except KeyError:
        valid = ", ".join(map(repr, GRID_NAMES[:-1])) + " or " + repr(GRID_NAMES[-1])
        raise ValueError(f"quantization grid {name!r}: must be {valid}") from None
