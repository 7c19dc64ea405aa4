"""Pure-PyTorch reference of the group quantizer (on the grids of :data:`deepspeed_loco.layout.formats.GRIDS`:
symmetric and mid-rise) and its bit packing.

These functions are the contract the CUDA kernels in ``deepspeed_loco/csrc/quantization`` match bit for bit:

* symmetric grid: ``qmax = 2**(bits-1) - 1``; per group of ``group_size`` elements ``scale = absmax / qmax`` (fp32,
  IEEE division) and ``q = clamp(round_half_even(c * inv), -qmax, qmax)``, value ``q * scale``.
* mid-rise grid (every code used): ``scale = absmax / (2**(bits-1) - 0.5)``, ``q = clamp(floor(c * inv),
  -2**(bits-1), 2**(bits-1) - 1)``, value ``(float(q) + 0.5) * scale`` (exact sum, one rounding). ``|c - value| <=
  scale / 2`` up to fp32 rounding.
* The ratio ``c * inv`` is the fp32 product with the group's IEEE reciprocal ``inv = fl(1 / scale)`` (DeepSpeed's
  arithmetic: one multiplication per value). A subnormal scale (below ``2**-126``), whose reciprocal may overflow, is
  first lifted with its values by ``2**64`` (exact): the ratio is ``(c * 2**64) * fl(1 / (scale * 2**64))``.
* An all-zero group has ``scale = 0`` and ``q = 0`` (value 0 on both grids).
* A group holding any non-finite value gets ``scale = NaN`` and ``q = 0``, so its dequantized values are NaN
  and DeepSpeed's overflow check still sees the step as an overflow.
* Packing: every 8 consecutive values of ``bits`` bits form one little-endian ``bits``-byte word, value ``j``
  in bits ``[j*bits, (j+1)*bits)`` as two's complement (4-bit: two per byte, low nibble = even element).
"""
from typing import Callable, Dict, Tuple

import torch

from deepspeed_loco.layout.formats import Rounding, grid_named

ROUNDED: Dict[Rounding, Callable[[torch.Tensor], torch.Tensor]] = {  # each rounding of the ratios c * inv
    Rounding.NEAREST_EVEN: torch.round,  # half to even
    Rounding.FLOOR: torch.floor,
}


def qmax(bits: int) -> int:
    """Largest quantized magnitude for ``bits`` (symmetric, no lopsided negative value)."""
    return (1 << (bits - 1)) - 1


def grid_levels(bits: int, grid: str) -> Tuple[float, int, int]:
    """``(divisor, lowest code, highest code)`` of the grid called ``grid`` (``Grid.levels``): ``scale = absmax /
    divisor``.

    symmetric: divisor ``qmax``, codes ``[-qmax, qmax]``; midrise: divisor ``2^(bits-1) - 0.5``, codes
    ``[-2^(bits-1), 2^(bits-1) - 1]`` (every code used; code ``k`` stands for ``(k + 0.5) * scale``).
    """
    levels = grid_named(grid).levels(bits)
    return levels.divisor, levels.low, levels.high


SMALLEST_NORMAL = 2.0 ** -126  # fp32's smallest normal number: a scale below it is lifted before it is inverted
SUBNORMAL_LIFT = 2.0 ** 64  # a subnormal scale times this is normal, its group's values stay finite: both exact


def ratios(groups: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 ``groups`` ``(..., g, group_size)`` over positive fp32 ``scale`` ``(..., g, 1)``: ``(groups * f) * fl(1
    / (scale * f))``, ``f = 2^64`` for a subnormal scale and 1 otherwise (both products by ``f`` exact): one IEEE
    reciprocal per group and one product per value."""
    # no branch on the data (a compiled reducer traces this without a graph break); the reciprocal tensor by tensor
    # (PyTorch on CUDA would turn a Python scalar's division into a product)
    lift = torch.where(scale < SMALLEST_NORMAL, SUBNORMAL_LIFT, 1.0).to(scale.dtype)
    return (groups * lift) * (torch.ones_like(scale) / (scale * lift))


def quantize_groups(c: torch.Tensor, bits: int, group_size: int,
                    grid: str = "symmetric") -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantizes fp32 ``c`` of shape ``(..., n)``, ``n % group_size == 0``, on ``grid`` (:func:`grid_levels`).

    Returns ``q`` int8 ``(..., n)`` (codes) and ``scale`` fp32 ``(..., n // group_size)``: ``q = rounding(c *
    fl(1 / scale))`` (:func:`ratios`; the grid's :class:`Rounding`: symmetric half to even, midrise floor) clamped to
    the grid's codes.
    """
    assert c.dtype == torch.float32 and c.shape[-1] % group_size == 0, (c.dtype, c.shape, group_size)
    divisor, low, high = grid_levels(bits, grid)
    groups = c.reshape(*c.shape[:-1], c.shape[-1] // group_size, group_size)
    finite = torch.isfinite(groups).all(dim=-1)
    absmax = groups.abs().amax(dim=-1)
    # a tensor divisor: PyTorch on CUDA turns division by a Python scalar into a multiplication by its reciprocal
    scale = torch.where(finite, absmax / torch.full_like(absmax, divisor), torch.full_like(absmax, float("nan")))
    safe = torch.where(finite & (scale > 0), scale, torch.ones_like(scale)).unsqueeze(-1)
    ratio = ratios(groups, safe)
    q = ROUNDED[grid_named(grid).rounding](ratio).clamp_(low, high)
    q = torch.where((finite & (scale > 0)).unsqueeze(-1), q, torch.zeros_like(q))
    return q.to(torch.int8).reshape(c.shape), scale


def dequantize_groups(q: torch.Tensor, scale: torch.Tensor, group_size: int, grid: str = "symmetric") -> torch.Tensor:
    """Inverse of :func:`quantize_groups`: int8 ``(..., n)`` and fp32 ``(..., n // group_size)`` to fp32 ``(..., n)``:
    ``q * scale`` (symmetric) or ``(q + 0.5) * scale`` (midrise; exact in fp32, then one rounding)."""
    groups = q.to(torch.float32).reshape(*q.shape[:-1], q.shape[-1] // group_size, group_size)
    half = grid_named(grid).rounding.cell_centre
    if half:
        groups = groups + half
    return (groups * scale.unsqueeze(-1)).reshape(q.shape)


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Packs int8 values ``(..., n)`` (``n % 8 == 0``) of ``bits`` bits into uint8 ``(..., n * bits // 8)``."""
    if bits == 8:
        return q.view(torch.uint8)
    mask = (1 << bits) - 1
    values = q.to(torch.int64).bitwise_and_(mask).reshape(*q.shape[:-1], q.shape[-1] // 8, 8)
    shifts = torch.arange(8, device=q.device, dtype=torch.int64) * bits
    word = (values << shifts).sum(dim=-1, keepdim=True)
    byte_shifts = torch.arange(bits, device=q.device, dtype=torch.int64) * 8
    out = (word >> byte_shifts).bitwise_and_(0xFF).to(torch.uint8)
    return out.reshape(*q.shape[:-1], q.shape[-1] * bits // 8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`: uint8 ``(..., m)`` to int8 ``(..., m * 8 // bits)``, sign-extended."""
    if bits == 8:
        return packed.contiguous().view(torch.int8)
    words = packed.to(torch.int64).reshape(*packed.shape[:-1], packed.shape[-1] // bits, bits)
    byte_shifts = torch.arange(bits, device=packed.device, dtype=torch.int64) * 8
    word = (words << byte_shifts).sum(dim=-1, keepdim=True)
    shifts = torch.arange(8, device=packed.device, dtype=torch.int64) * bits
    values = (word >> shifts).bitwise_and_((1 << bits) - 1)
    values = torch.where(values >= (1 << (bits - 1)), values - (1 << bits), values)
    return values.to(torch.int8).reshape(*packed.shape[:-1], packed.shape[-1] // bits * 8)
