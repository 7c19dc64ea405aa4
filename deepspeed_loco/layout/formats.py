"""The formats of LoCo's numbers, declared once: how an error buffer stores its error (:class:`ErrorStorage`) and
the quantization grids (:data:`GRIDS`, each a :class:`Rounding` of the ratio ``c / scale``, computed as
``deepspeed_loco.ops.quantizer.ratios`` computes it).

The CUDA kernels mirror both in ``deepspeed_loco/csrc/quantization/loco_formats.h`` (same names, values and order;
``tests/unit/layout/test_formats.py`` compiles that header and compares). The config's JSON values are these
formats' public names: ``error_bits`` is the ``bits`` of a stored :class:`ErrorStorage` (4, 8 or 32; ``of_bits``),
``quant_grid`` a name of
:data:`GRIDS` (or ``"auto"``).
"""
import enum
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from deepspeed_loco.layout.partition import SCALE_BYTES


@dataclass(frozen=True)
class StorageFormat:
    """What an error buffer's storage is: its values' ``dtype``, ``per_element`` stored values in one element of that
    dtype (2: two 4-bit codes a byte, the even column in the low nibble), ``bits`` of one value (``error_bits``), and
    whether one fp32 scale per group comes with them (``scaled``: the error is ``code * scale``, symmetric,
    ``qmax = 2^(bits-1) - 1``, nearest-even)."""
    label: str
    bits: int
    dtype: Optional[torch.dtype]
    per_element: int
    scaled: bool


class ErrorStorage(enum.IntEnum):
    """How an error-feedback buffer keeps its fp32 error ``(rows, cols)`` between steps. The value is the kernels'
    code for it (``loco_formats.h``), not a bit count; :attr:`format` describes it (its ``bits`` are the config's
    ``error_bits``). ``NONE``: no buffer (error feedback off), a case only the kernels take."""
    NONE = 0
    INT4 = 1  # 4-bit codes, two per byte: uint8 (rows, cols // 2), and one fp32 scale per group: qmax 7
    INT8 = 2  # int8 codes (rows, cols) and one fp32 scale per group (rows, cols // group_size): qmax 127
    FP32 = 3  # fp32 values (rows, cols), no scale

    @property
    def format(self) -> StorageFormat:
        return FORMATS[self]

    @property
    def label(self) -> str:
        """The storage as the start-up line and messages name it: ``"int4"``, ``"int8"``, ``"fp32"`` or ``"none"``."""
        return self.format.label

    @property
    def bits(self) -> int:
        """Bits of one stored value (``zeropp_loco_param.error_bits``); 0 for ``NONE``."""
        return self.format.bits

    @property
    def values_dtype(self) -> torch.dtype:
        """The dtype of the buffer's values tensor (ValueError for ``NONE``, which has none)."""
        if self.format.dtype is None:
            raise ValueError("ErrorStorage.NONE holds no values")
        return self.format.dtype

    @property
    def scaled(self) -> bool:
        """Whether the values come with one fp32 scale per group (their error is ``code * scale``)."""
        return self.format.scaled

    def values_shape(self, rows: int, cols: int) -> Tuple[int, int]:
        """The shape of the values tensor of a ``(rows, cols)`` error (``cols`` a multiple of 8)."""
        return rows, cols // self.format.per_element

    def row_bytes(self, cols: int, group_size: int) -> int:
        """Bytes of one buffer row of ``cols`` columns (a multiple of ``group_size``), scales included."""
        values = cols // self.format.per_element * torch.empty((), dtype=self.values_dtype).element_size()
        return values + (cols // group_size * SCALE_BYTES if self.scaled else 0)

    @classmethod
    def of_bits(cls, bits: int) -> "ErrorStorage":
        """The storage of ``error_bits = bits``; ValueError naming the valid ones otherwise."""
        for storage in STORED:
            if storage.bits == bits:
                return storage
        raise ValueError(f"error_bits {bits!r}: an error buffer stores {', '.join(str(s.bits) for s in STORED)} bits")

    @classmethod
    def of_values(cls, dtype: torch.dtype) -> "ErrorStorage":
        """The storage whose values tensor has ``dtype`` (each stored format has its own); ValueError naming the
        valid ones otherwise."""
        for storage in STORED:
            if storage.values_dtype == dtype:
                return storage
        raise ValueError(f"error values of dtype {dtype}: an error buffer holds "
                         f"{' or '.join(f'{s.values_dtype} ({s.label})' for s in STORED)} values")


FORMATS: Dict[ErrorStorage, StorageFormat] = {
    ErrorStorage.NONE: StorageFormat("none", 0, None, 1, False),
    ErrorStorage.INT4: StorageFormat("int4", 4, torch.uint8, 2, True),
    ErrorStorage.INT8: StorageFormat("int8", 8, torch.int8, 1, True),
    ErrorStorage.FP32: StorageFormat("fp32", 32, torch.float32, 1, False),
}
STORED: Tuple[ErrorStorage, ...] = (ErrorStorage.INT4, ErrorStorage.INT8, ErrorStorage.FP32)  # what a buffer can be


class Rounding(enum.IntEnum):
    """How a grid turns the ratio ``c / scale`` into a code ``k``, and the value ``k`` stands for: the centre of
    the cell of ratios that round to ``k``, :attr:`cell_centre` above ``k``."""
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
