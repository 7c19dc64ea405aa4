"""The fused CUDA implementation of ``hop1_``, ``hop2_`` and ``final_mean`` (signatures of ``loco_reference``).

Each call runs one kernel from ``deepspeed_loco/csrc/quantization/loco_kernels.cu`` (built by
:class:`deepspeed_loco.ops.op_builder.LocoBuilder`) on the current CUDA stream, writing into the given views of the
wire buffers and updating the error buffer in place, with no temporary in device memory. Outputs are
bit-identical to the reference evaluated on the CPU (the reference fixes the fp32 operation order).

Calls the kernels do not cover run the reference instead, and each distinct reason is logged once (WARNING, logger
``deepspeed_loco``): tensors off CUDA, a gradient dtype other than float32/float16/bfloat16, bits outside
{2, 3, 4, 8}, a group size that is not a power of two in [32, 4096], an error buffer with another group size or
storage, or a wire view without unit stride along its rows. Hadamard rotation (``hadamard=True``) runs inside
the hop-1 and final kernels.
"""
from typing import List, Optional, Sequence

import torch

from deepspeed_loco.layout import HopArgs, WireLayout
from deepspeed_loco.ops import loco_reference
from deepspeed_loco.ops.error_buffer import ErrorBuffer
from deepspeed_loco.utils.logging import logger

_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_BITS = (2, 3, 4, 8)
_op = None
_reported = set()


def load():
    """Builds (first time, with ninja) and loads the ``loco_ops`` extension; raises if that fails."""
    global _op
    if _op is None:
        from deepspeed_loco.ops.op_builder import LocoBuilder
        _op = LocoBuilder().load(verbose=False)
    return _op


def _unsupported(tensors, bits, group_size: int, error: Optional[ErrorBuffer], grad_dtype=None) -> Optional[str]:
    """Why the kernels cannot run this call, or None."""
    if not all(t.is_cuda for t in tensors):
        return "a tensor is not on a CUDA device"
    if len({t.device for t in tensors}) != 1:
        return "tensors are on different devices"
    if grad_dtype is not None and grad_dtype not in _DTYPE_CODES:
        return f"dtype {grad_dtype} (kernels take float32, float16, bfloat16)"
    if any(b not in _BITS for b in bits):
        return f"bits {bits} (kernels take {_BITS})"
    if not (32 <= group_size <= 4096 and group_size & (group_size - 1) == 0):
        return f"group_size {group_size} (kernels take powers of two from 32 to 4096)"
    for t in tensors:
        if t.dim() == 2 and t.shape[1] > 1 and t.stride(1) != 1:
            return "a wire or error view without unit stride along its rows"
    if error is not None:
        if error.group_size != group_size:
            return f"error buffer group size {error.group_size} != {group_size}"
        if error.error_bits == 8 and error.values.dtype != torch.int8:
            return f"int8 error storage holding {error.values.dtype}"
        if error.error_bits == 32 and error.values.dtype != torch.float32:
            return f"fp32 error storage holding {error.values.dtype}"
    return None


def _fallback(function: str, reason: str) -> None:
    if (function, reason) not in _reported:
        _reported.add((function, reason))
        logger.warning("deepspeed_loco: %s runs the PyTorch reference for this call (and others like it): %s",
                       function, reason)


def _error_args(error: Optional[ErrorBuffer]):
    """``(values, scale, error_bits)`` for the op: ``(None, None, 0)`` without error feedback."""
    if error is None:
        return None, None, 0
    return error.values, error.scale, error.error_bits


def _error_tensors(error: Optional[ErrorBuffer]):
    return [] if error is None else [t for t in (error.values, error.scale) if t is not None]


def hop1_(grad: torch.Tensor, world_size: int, local_size: int, error: Optional[ErrorBuffer], beta: float, bits: int,
          group_size: int, out_data: torch.Tensor, out_scale: torch.Tensor, hadamard: bool = False) -> None:
    """See :func:`deepspeed_loco.ops.loco_reference.hop1_`: grad (any shape, fp32/fp16/bf16) to ``out_data`` uint8
    ``(W, P'*bits/8)`` and ``out_scale`` fp32 ``(W, P'/S)`` in slot order; ``error`` ``(W, P')`` updated in place."""
    tensors = [grad, out_data, out_scale] + _error_tensors(error)
    reason = _unsupported(tensors, (bits,), group_size, error, grad.dtype)
    if reason is not None:
        _fallback("hop1_", reason)
        return loco_reference.hop1_(grad, world_size, local_size, error, beta, bits, group_size, out_data, out_scale,
                                    hadamard=hadamard)
    values, scale, error_bits = _error_args(error)
    load().hop1(grad.contiguous(), world_size, local_size, values, scale, error_bits, float(beta), bits, group_size,
                out_data, out_scale, bool(hadamard))


def hop2_(recv_data: torch.Tensor, recv_scale: torch.Tensor, local_size: int, in_bits: int,
          error: Optional[ErrorBuffer], beta: float, bits: int, group_size: int, out_data: torch.Tensor,
          out_scale: torch.Tensor) -> None:
    """See :func:`deepspeed_loco.ops.loco_reference.hop2_`: ``recv_data`` uint8 ``(L*M, P'*in_bits/8)`` and
    ``recv_scale`` fp32 ``(L*M, P'/S)`` to ``out_data`` ``(M, P'*bits/8)`` / ``out_scale`` ``(M, P'/S)``."""
    tensors = [recv_data, recv_scale, out_data, out_scale] + _error_tensors(error)
    reason = _unsupported(tensors, (in_bits, bits), group_size, error)
    if reason is not None:
        _fallback("hop2_", reason)
        return loco_reference.hop2_(recv_data, recv_scale, local_size, in_bits, error, beta, bits, group_size,
                                    out_data, out_scale)
    values, scale, error_bits = _error_args(error)
    load().hop2(recv_data, recv_scale, local_size, in_bits, values, scale, error_bits, float(beta), bits, group_size,
                out_data, out_scale)


def final_mean(recv_data: torch.Tensor, recv_scale: torch.Tensor, bits: int, group_size: int, world_size: int,
               numel: int, rank: int, out_dtype: torch.dtype, hadamard: bool = False) -> torch.Tensor:
    """See :func:`deepspeed_loco.ops.loco_reference.final_mean`: ``(P,)`` in ``out_dtype``, the mean over ``W``."""
    reason = _unsupported([recv_data, recv_scale], (bits,), group_size, None, out_dtype)
    if reason is not None:
        _fallback("final_mean", reason)
        return loco_reference.final_mean(recv_data, recv_scale, bits, group_size, world_size, numel, rank, out_dtype,
                                         hadamard=hadamard)
    return load().final_mean(recv_data, recv_scale, bits, group_size, world_size, numel, rank,
                             _DTYPE_CODES[out_dtype], bool(hadamard))


# ------------------------------------------------------------------------------------------------ bucket entry points
def _grid_unsupported(function: str, args: HopArgs) -> bool:
    """True (and logged once) when ``args`` asks for a grid the CUDA kernels do not implement."""
    if args.grid == "symmetric":
        return False
    _fallback(function, f"quant_grid {args.grid!r} (the CUDA kernels implement the symmetric grid)")
    return True


def quantize_bucket_(grads: Sequence[torch.Tensor], errors: Sequence[Optional[ErrorBuffer]], args: HopArgs,
                     wire: WireLayout, send: torch.Tensor) -> None:
    """See :func:`deepspeed_loco.ops.loco_reference.quantize_bucket_`."""
    if _grid_unsupported("quantize_bucket_", args):
        return loco_reference.quantize_bucket_(grads, errors, args, wire, send)
    for i, (grad, error, offset) in enumerate(zip(grads, errors, wire.offsets())):
        hop1_(grad, args.world_size, args.local_size, error, args.err_beta, args.bits, args.group_size,
              *wire.views(send, i, offset), hadamard=args.hadamard)


def requantize_bucket_(recv: torch.Tensor, in_wire: WireLayout, errors: Sequence[Optional[ErrorBuffer]],
                       args: HopArgs, wire: WireLayout, send: torch.Tensor) -> None:
    """See :func:`deepspeed_loco.ops.loco_reference.requantize_bucket_`."""
    if _grid_unsupported("requantize_bucket_", args):
        return loco_reference.requantize_bucket_(recv, in_wire, errors, args, wire, send)
    for i, (error, offset) in enumerate(zip(errors, wire.offsets())):
        hop2_(*in_wire.views(recv, i, offset), args.in_blocks, args.in_bits, error, args.err_beta, args.bits,
              args.group_size, *wire.views(send, i, offset))


def final_mean_bucket(recv: torch.Tensor, wire: WireLayout, args: HopArgs, numels: Sequence[int], rank: int,
                      out_dtype: torch.dtype) -> List[torch.Tensor]:
    """See :func:`deepspeed_loco.ops.loco_reference.final_mean_bucket`."""
    if _grid_unsupported("final_mean_bucket", args):
        return loco_reference.final_mean_bucket(recv, wire, args, numels, rank, out_dtype)
    return [
        final_mean(*wire.views(recv, i, offset), args.bits, args.group_size, args.world_size, numel, rank, out_dtype,
                   hadamard=args.hadamard) for i, (numel, offset) in enumerate(zip(numels, wire.offsets()))
    ]
