"""LoCo's kernels as ``torch.library`` ops in the namespace ``deepspeed_loco``, and the bucket entry points that
call them.

Ops (explicit schemas: tensors, lists of tensors and scalars only; the mutated tensors are declared):

``deepspeed_loco::quantize_bucket``
    Hop 1 of a bucket: partition, swizzle, [rotate,] compensate, quantize, update the errors, pack. Mutates
    ``error_values``, ``error_scales`` and ``send`` uint8 ``(world_size, row_bytes)``; returns nothing.
``deepspeed_loco::requantize_bucket``
    A later hop: dequantize and sum the ``in_blocks`` received blocks of ``recv`` (``in_bits`` bits), compensate,
    quantize to ``bits``, update the errors. Mutates ``error_values``, ``error_scales`` and ``send``.
``deepspeed_loco::final_mean_bucket``
    The last hop's received rows to this rank's mean partitions, concatenated: returns ``out_dtype``
    ``(sum of ceil(numel / world_size),)``.

Every op takes, last, an optional fp32 ``stats`` (None by default) that it adds its noise statistics to, mutated in
place: ``(2,)`` for the quantizing ops (``||input||^2``, quantization error power), ``(1,)`` for the final mean
(``||mean||^2``); :mod:`deepspeed_loco.ops.loco_reference` defines them. The live rho
(:mod:`deepspeed_loco.runtime.comm.noise_stats`) passes it on measured steps only.

The arguments' contract (shapes, dtypes, the error lists) is :mod:`deepspeed_loco.ops.reference_impl`'s.
Implementations: CUDA tensors run the fused kernels (:mod:`deepspeed_loco.ops.loco_cuda`); every other device runs
the PyTorch reference (:mod:`deepspeed_loco.ops.reference_impl`); fake tensors (``torch.compile``, meta) get the
output's shape from the fake implementations below, so a compiled reduce step traces the ops without a graph break.

The entry points :func:`quantize_bucket_`, :func:`requantize_bucket_` and :func:`final_mean_bucket` keep the
signatures of :mod:`deepspeed_loco.ops.loco_reference`'s bucket entry points (``HopArgs``, ``WireLayout``,
``ErrorBuffer``) and turn them into the ops' arguments; ``deepspeed_loco.ops.kernels_for`` hands them to the reducer.
"""
from typing import List, Optional, Sequence, Tuple, Union

import torch

from deepspeed_loco.layout import HopArgs, MeanArgs, WireLayout
from deepspeed_loco.ops import loco_cuda, loco_reference, reference_impl
from deepspeed_loco.ops.error_buffer import ErrorBuffer

NAMESPACE = "deepspeed_loco"
_MUTATED = ("error_values", "error_scales", "send", "stats")
_STATS = "Tensor(d!)? stats=None"  # the optional noise-statistics output, last in every schema

quantize_bucket_op = torch.library.custom_op(
    f"{NAMESPACE}::quantize_bucket", reference_impl.quantize_bucket, mutates_args=_MUTATED,
    schema="(Tensor[] grads, Tensor(a!)[] error_values, Tensor(b!)[] error_scales, Tensor(c!) send, int world_size, "
    f"int local_size, int bits, int group_size, float err_beta, bool hadamard, str grid, {_STATS}) -> ()")

requantize_bucket_op = torch.library.custom_op(
    f"{NAMESPACE}::requantize_bucket", reference_impl.requantize_bucket, mutates_args=_MUTATED,
    schema="(Tensor recv, Tensor(a!)[] error_values, Tensor(b!)[] error_scales, Tensor(c!) send, int[] widths, "
    "int world_size, int local_size, int bits, int in_bits, int in_blocks, int group_size, float err_beta, "
    f"str grid, {_STATS}) -> ()")

final_mean_bucket_op = torch.library.custom_op(
    f"{NAMESPACE}::final_mean_bucket", reference_impl.final_mean_bucket, mutates_args=("stats", ),
    schema="(Tensor recv, int[] numels, int world_size, int bits, int group_size, bool hadamard, str grid, int rank, "
    f"ScalarType out_dtype, {_STATS}) -> Tensor")

quantize_bucket_op.register_kernel("cuda")(loco_cuda.quantize_bucket)
requantize_bucket_op.register_kernel("cuda")(loco_cuda.requantize_bucket)
final_mean_bucket_op.register_kernel("cuda")(loco_cuda.final_mean_bucket)


@quantize_bucket_op.register_fake
def _quantize_bucket_fake(grads, error_values, error_scales, send, world_size, local_size, bits, group_size, err_beta,
                          hadamard, grid, stats=None) -> None:
    return None


@requantize_bucket_op.register_fake
def _requantize_bucket_fake(recv, error_values, error_scales, send, widths, world_size, local_size, bits, in_bits,
                            in_blocks, group_size, err_beta, grid, stats=None) -> None:
    return None


@final_mean_bucket_op.register_fake
def _final_mean_bucket_fake(recv, numels, world_size, bits, group_size, hadamard, grid, rank, out_dtype, stats=None):
    return recv.new_empty(sum(-(-n // world_size) for n in numels), dtype=out_dtype)


# ------------------------------------------------------------------------------------------------ bucket entry points
def _error_lists(errors: Sequence[Optional[ErrorBuffer]]) -> Optional[Tuple[List[torch.Tensor], List[torch.Tensor]]]:
    """``(values, scales)`` as the ops take them (empty lists without error feedback); None for a bucket mixing
    parameters with and without error buffers, which the ops do not take."""
    if all(e is None for e in errors):
        return [], []
    if any(e is None for e in errors):
        return None
    return [e.values for e in errors], [e.scale for e in errors if e.scale is not None]


def _check_wire(wire: WireLayout, args: Union[HopArgs, MeanArgs], bits: int, what: str) -> None:
    if wire.bits != bits or wire.group_size != args.group_size:
        raise ValueError(f"LoCo ops: {what} has {wire.bits} bits and group size {wire.group_size}, the hop "
                         f"{bits} bits and group size {args.group_size}")


def quantize_bucket_(grads: Sequence[torch.Tensor], errors: Sequence[Optional[ErrorBuffer]], args: HopArgs,
                     wire: WireLayout, send: torch.Tensor, stats: Optional[torch.Tensor] = None) -> None:
    """See :func:`deepspeed_loco.ops.loco_reference.quantize_bucket_` (``wire``'s widths are the gradients' padded
    partitions, as ``HopPlan.widths`` gives them); runs ``deepspeed_loco::quantize_bucket``."""
    lists = _error_lists(errors)
    if lists is None:
        return loco_reference.quantize_bucket_(grads, errors, args, wire, send, stats)
    _check_wire(wire, args, args.bits, "wire")
    torch.ops.deepspeed_loco.quantize_bucket(list(grads), *lists, send, args.world_size, args.local_size, args.bits,
                                             args.group_size, float(args.err_beta), bool(args.hadamard), args.grid,
                                             stats)


def requantize_bucket_(recv: torch.Tensor, in_wire: WireLayout, errors: Sequence[Optional[ErrorBuffer]],
                       args: HopArgs, wire: WireLayout, send: torch.Tensor,
                       stats: Optional[torch.Tensor] = None) -> None:
    """See :func:`deepspeed_loco.ops.loco_reference.requantize_bucket_` (``in_wire`` and ``wire`` of the same
    widths); runs ``deepspeed_loco::requantize_bucket``."""
    lists = _error_lists(errors)
    if lists is None:
        return loco_reference.requantize_bucket_(recv, in_wire, errors, args, wire, send, stats)
    _check_wire(wire, args, args.bits, "wire")
    _check_wire(in_wire, args, args.in_bits, "in_wire")
    if in_wire.widths != wire.widths:
        raise ValueError("LoCo ops: in_wire and wire must have the same parameter widths")
    torch.ops.deepspeed_loco.requantize_bucket(recv, *lists, send, list(wire.widths), args.world_size,
                                               args.local_size, args.bits, args.in_bits, args.in_blocks,
                                               args.group_size, float(args.err_beta), args.grid, stats)


def final_mean_bucket(recv: torch.Tensor, wire: WireLayout, args: MeanArgs, numels: Sequence[int], rank: int,
                      out_dtype: torch.dtype, stats: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
    """See :func:`deepspeed_loco.ops.loco_reference.final_mean_bucket`; runs ``deepspeed_loco::final_mean_bucket``.
    The partitions returned are views of one flat tensor (in parameter order)."""
    _check_wire(wire, args, args.bits, "wire")
    flat = torch.ops.deepspeed_loco.final_mean_bucket(recv, list(numels), args.world_size, args.bits,
                                                      args.group_size, bool(args.hadamard), args.grid, rank, out_dtype,
                                                      stats)
    return list(flat.split([-(-n // args.world_size) for n in numels]))
