"""The fused CUDA implementation of the bucket entry points of ``loco_reference`` (same signatures).

``quantize_bucket_``, ``requantize_bucket_`` and ``final_mean_bucket`` each run ONE kernel from
``deepspeed_loco/csrc/quantization/loco_kernels.cu`` (built by :class:`deepspeed_loco.ops.op_builder.LocoBuilder`)
over every parameter of the bucket, on the current CUDA stream: the binding writes a table of the parameters
(pointers, offsets, sizes) to the device and one grid covers all groups of all parameters. The kernels write the
wire buffer and update the error buffers in place with no other temporary in device memory. Outputs are
bit-identical to the reference evaluated on the CPU, on both quantization grids (``args.grid``).

The hop's arguments (bits, group size, beta, grid) are validated by the config and again at the binding
(``RuntimeError`` naming the argument). Calls the kernels cannot take run the reference instead, and each distinct
reason is logged once (WARNING, logger ``deepspeed_loco``): tensors off CUDA or on different devices, a gradient
or output dtype other than float32/float16/bfloat16, a bucket mixing parameters with and without error buffers,
or an error tensor without unit stride along its rows (checked in the binding: a bucket holds hundreds of tensors). A
wire buffer without contiguous rows is taken by neither implementation: the reference raises a ValueError naming it.
"""
from typing import List, Optional, Sequence

import torch

from deepspeed_loco.layout import HopArgs, WireLayout
from deepspeed_loco.ops import loco_reference
from deepspeed_loco.ops.error_buffer import ErrorBuffer
from deepspeed_loco.utils.logging import logger

_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_op = None
_reported = set()


def load():
    """Builds (first time, with ninja) and loads the ``loco_ops`` extension; raises if that fails."""
    global _op
    if _op is None:
        from deepspeed_loco.ops.op_builder import LocoBuilder
        _op = LocoBuilder().load(verbose=False)
    return _op


def _unsupported(tensors: Sequence[torch.Tensor], errors: Sequence[Optional[ErrorBuffer]],
                 dtype: Optional[torch.dtype]) -> Optional[str]:
    """Why the kernels cannot run this call (device, dtype or stride), or None. The per-tensor checks (device, row
    stride) run in the binding, once the first tensor shows that CUDA is there."""
    if not tensors[0].is_cuda:
        return "a tensor is not on a CUDA device"
    if dtype is not None and dtype not in _DTYPE_CODES:
        return f"dtype {dtype} (kernels take float32, float16, bfloat16)"
    if len({e is None for e in errors}) > 1:
        return "a bucket mixing parameters with and without error buffers"
    return load().unsupported(list(tensors)) or None


def _fallback(function: str, reason: str) -> None:
    if (function, reason) not in _reported:
        _reported.add((function, reason))
        logger.warning("deepspeed_loco: %s runs the PyTorch reference for this call (and others like it): %s",
                       function, reason)


def _error_lists(errors: Sequence[Optional[ErrorBuffer]]):
    """``(values, scales, error_bits)`` for the op: empty lists and 0 without error feedback."""
    if not errors or errors[0] is None:
        return [], [], 0
    return [e.values for e in errors], [e.scale for e in errors if e.scale is not None], errors[0].error_bits


def _error_tensors(errors: Sequence[Optional[ErrorBuffer]]) -> List[torch.Tensor]:
    return [t for e in errors if e is not None for t in (e.values, e.scale) if t is not None]


def quantize_bucket_(grads: Sequence[torch.Tensor], errors: Sequence[Optional[ErrorBuffer]], args: HopArgs,
                     wire: WireLayout, send: torch.Tensor) -> None:
    """See :func:`deepspeed_loco.ops.loco_reference.quantize_bucket_` (gradients of one dtype)."""
    grads = list(grads)
    dtypes = {g.dtype for g in grads}
    reason = _unsupported(grads + [send] + _error_tensors(errors), errors,
                          grads[0].dtype if len(dtypes) == 1 else torch.float64)
    if reason is not None:
        _fallback("quantize_bucket_", reason)
        return loco_reference.quantize_bucket_(grads, errors, args, wire, send)
    load().quantize_bucket(grads, *_error_lists(errors), args, wire, send)


def requantize_bucket_(recv: torch.Tensor, in_wire: WireLayout, errors: Sequence[Optional[ErrorBuffer]],
                       args: HopArgs, wire: WireLayout, send: torch.Tensor) -> None:
    """See :func:`deepspeed_loco.ops.loco_reference.requantize_bucket_`."""
    reason = _unsupported([recv, send] + _error_tensors(errors), errors, None)
    if reason is not None:
        _fallback("requantize_bucket_", reason)
        return loco_reference.requantize_bucket_(recv, in_wire, errors, args, wire, send)
    load().requantize_bucket(recv, in_wire, *_error_lists(errors), args, wire, send)


def final_mean_bucket(recv: torch.Tensor, wire: WireLayout, args: HopArgs, numels: Sequence[int], rank: int,
                      out_dtype: torch.dtype) -> List[torch.Tensor]:
    """See :func:`deepspeed_loco.ops.loco_reference.final_mean_bucket`. The partitions returned are views of one
    flat tensor (in parameter order)."""
    reason = _unsupported([recv], [], out_dtype)
    if reason is not None:
        _fallback("final_mean_bucket", reason)
        return loco_reference.final_mean_bucket(recv, wire, args, numels, rank, out_dtype)
    return list(load().final_mean_bucket(recv, wire, args, list(numels), rank, _DTYPE_CODES[out_dtype]))
