"""The PyTorch reference behind the ``deepspeed_loco`` ops, taking the ops' schema arguments.

:mod:`deepspeed_loco.ops.library` registers these as the ops' implementation for every device but CUDA, and
:mod:`deepspeed_loco.ops.loco_cuda` falls back to them for calls its kernels do not take. Each rebuilds the
reference's objects (``HopArgs``, ``WireLayout``, ``ErrorBuffer``) from the scalars and calls the bucket entry point
of :mod:`deepspeed_loco.ops.loco_reference` with them, so the results are the reference's, bit for bit.

Error buffers as the ops take them: ``error_values`` empty (no error feedback) or one tensor per parameter, int8
(with ``error_scales``, one fp32 ``(rows, cols // group_size)`` tensor per parameter) or fp32 (``error_scales``
empty); both are updated in place. Wire buffers: uint8 ``(rows, row_bytes)`` of ``deepspeed_loco.layout.WireLayout``
(the widths of the first hop and of the final mean are the gradients' padded partitions,
``deepspeed_loco.layout.padded_widths``). ``stats``: None, or the fp32 noise statistics each op adds to (``(2,)`` for
the quantizing ops, ``(1,)`` for the final mean; :mod:`deepspeed_loco.ops.loco_reference`'s docstring).
"""
from typing import List, Optional, Sequence

import torch

from deepspeed_loco.layout import HopArgs, MeanArgs, WireLayout, padded_widths
from deepspeed_loco.ops import loco_reference
from deepspeed_loco.ops.error_buffer import ErrorBuffer


def error_buffers(error_values: Sequence[torch.Tensor], error_scales: Sequence[torch.Tensor], rows: int,
                  group_size: int) -> List[Optional[ErrorBuffer]]:
    """The reference's error buffers of the ops' error lists, for a bucket of ``rows`` parameters (all None when
    ``error_values`` is empty); they share the tensors, so updating them updates the lists' tensors."""
    if not error_values:
        return [None] * rows
    if len(error_values) != rows or (error_scales and len(error_scales) != rows):
        raise ValueError(f"LoCo ops: {len(error_values)} error values and {len(error_scales)} error scales for a "
                         f"bucket of {rows} parameters")
    if error_values[0].dtype == torch.int8 and not error_scales:
        raise ValueError("LoCo ops: int8 error values need their fp32 scales (error_scales)")
    scales = list(error_scales) if error_scales else [None] * rows
    return [ErrorBuffer(v, s, group_size) for v, s in zip(error_values, scales)]


def quantize_bucket(grads: List[torch.Tensor], error_values: List[torch.Tensor], error_scales: List[torch.Tensor],
                    send: torch.Tensor, world_size: int, local_size: int, bits: int, group_size: int,
                    err_beta: float, hadamard: bool, grid: str, stats: Optional[torch.Tensor]) -> None:
    """The first hop (``loco_reference.quantize_bucket_``) into ``send`` uint8 ``(world_size, row_bytes)``."""
    args = HopArgs(world_size, local_size, bits, group_size, err_beta, hadamard, grid)
    wire = WireLayout(padded_widths([g.numel() for g in grads], world_size, group_size), bits, group_size)
    errors = error_buffers(error_values, error_scales, len(grads), group_size)
    loco_reference.quantize_bucket_(grads, errors, args, wire, send, stats)


def requantize_bucket(recv: torch.Tensor, error_values: List[torch.Tensor], error_scales: List[torch.Tensor],
                      send: torch.Tensor, widths: List[int], world_size: int, local_size: int, bits: int,
                      in_bits: int, in_blocks: int, group_size: int, err_beta: float, grid: str,
                      stats: Optional[torch.Tensor]) -> None:
    """A later hop (``loco_reference.requantize_bucket_``): ``recv`` uint8 ``(in_blocks * rows, in_row_bytes)`` on
    the wire of ``in_bits`` bits into ``send`` uint8 ``(rows, row_bytes)`` on ``bits`` bits (both of ``widths``)."""
    args = HopArgs(world_size, local_size, bits, group_size, err_beta, False, grid, in_bits, in_blocks)
    in_wire, wire = WireLayout(tuple(widths), in_bits, group_size), WireLayout(tuple(widths), bits, group_size)
    errors = error_buffers(error_values, error_scales, len(widths), group_size)
    loco_reference.requantize_bucket_(recv, in_wire, errors, args, wire, send, stats)


def final_mean_bucket(recv: torch.Tensor, numels: List[int], world_size: int, bits: int, group_size: int,
                      hadamard: bool, grid: str, rank: int, out_dtype: torch.dtype,
                      stats: Optional[torch.Tensor]) -> torch.Tensor:
    """The final mean (``loco_reference.final_mean_bucket``): this rank's mean partitions, concatenated,
    ``out_dtype`` ``(sum of ceil(numel / world_size),)``."""
    args = MeanArgs(world_size, bits, group_size, hadamard, grid)
    wire = WireLayout(padded_widths(numels, world_size, group_size), bits, group_size)
    parts = loco_reference.final_mean_bucket(recv, wire, args, numels, rank, out_dtype, stats)
    return torch.cat(parts) if parts else recv.new_empty(0, dtype=out_dtype)
