"""The CUDA implementations of the ``deepspeed_loco`` ops (:mod:`deepspeed_loco.ops.library` registers them for the
CUDA dispatch key): one fused kernel launch per op call.

``quantize_bucket``, ``requantize_bucket`` and ``final_mean_bucket`` take the ops' schema arguments (tensors, lists
of tensors, scalars; see :mod:`deepspeed_loco.ops.reference_impl` for their contract) and each run ONE kernel from
``deepspeed_loco/csrc/quantization/loco_kernels.cu`` (built by :class:`deepspeed_loco.ops.op_builder.LocoBuilder`)
over every parameter of the bucket, on the current CUDA stream: the binding writes a table of the parameters
(pointers, offsets, sizes) to the device and one grid covers all groups of all parameters. The kernels write the
wire buffer and update the error buffers in place with no other temporary in device memory. Outputs are
bit-identical to the reference evaluated on the CPU, on both quantization grids.

The scalars are validated by the config and again at the binding against ``loco_limits.h`` (``RuntimeError``
naming the argument). Calls the kernels cannot take run the reference instead, and each distinct reason is logged
once (WARNING, logger ``deepspeed_loco``): a tensor off CUDA or on different devices, a gradient or output dtype
other than float32/float16/bfloat16, or an error tensor without unit stride along its rows (checked in the binding:
a bucket holds hundreds of tensors). A wire buffer without contiguous rows is taken by neither implementation: the
reference raises a ValueError naming it.
"""
from typing import Any, List, Mapping, Optional, Sequence

import torch

from deepspeed_loco.ops import loco_reference, reference_impl
from deepspeed_loco.utils.logging import logger

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_op = None
_reported = set()


def load():
    """Builds (first time, with ninja) and loads the ``loco_ops`` extension; raises if that fails."""
    global _op
    if _op is None:
        from deepspeed_loco.ops.op_builder import LocoBuilder
        _op = LocoBuilder().load(verbose=False)
    return _op


def _unsupported(tensors: Sequence[torch.Tensor], dtypes: Sequence[torch.dtype], rows: bool = True) -> Optional[str]:
    """Why the kernels cannot run this call (device, dtype or stride), or None. The per-tensor checks (device, row
    stride) run in the binding, once the first tensor shows that CUDA is there; ``rows=False`` skips them (a call
    whose binding copies any strides to contiguous tensors and checks the devices itself)."""
    if not tensors[0].is_cuda:
        return "a tensor is not on a CUDA device"
    if len(set(dtypes)) > 1:
        return f"dtypes {sorted(map(str, set(dtypes)))} in one bucket (kernels take one)"
    if dtypes and dtypes[0] not in _DTYPES:
        return f"dtype {dtypes[0]} (kernels take float32, float16, bfloat16)"
    return (load().unsupported(list(tensors)) or None) if rows else None


def _fallback(function: str, reason: str) -> None:
    if (function, reason) not in _reported:
        _reported.add((function, reason))
        logger.warning("deepspeed_loco: %s runs the PyTorch reference for this call (and others like it): %s",
                       function, reason)


def _error_bits(error_values: Sequence[torch.Tensor]) -> int:
    """0 without error buffers, 8 for int8 ones, 32 for fp32 ones (the binding checks every tensor's dtype)."""
    if not error_values:
        return 0
    return 8 if error_values[0].dtype == torch.int8 else 32


def binding_arguments(values: Mapping[str, Any]) -> List[Any]:
    """The binding's arguments (``loco_binding.cpp``) for an op's arguments ``values`` (by name, in schema order):
    the same values, with ``error_bits`` (:func:`_error_bits`) after ``error_scales``."""
    out = []
    for name, value in values.items():
        out.append(value)
        if name == "error_scales":
            out.append(_error_bits(values["error_values"]))
    return out


def _run(function: str, values: Mapping[str, Any], tensors: Sequence[torch.Tensor], dtypes: Sequence[torch.dtype]):
    """``function`` of the binding on the op's arguments ``values``, or, when it cannot take ``tensors`` of
    ``dtypes``, of :mod:`reference_impl` (logged once per reason)."""
    reason = _unsupported(tensors, dtypes)
    if reason is not None:
        _fallback(function, reason)
        return getattr(reference_impl, function)(**values)
    return getattr(load(), function)(*binding_arguments(values))


# The ops' CUDA implementations: reference_impl's signatures (tests/unit/ops/test_op_signatures.py checks them).
def quantize_bucket(grads: List[torch.Tensor], error_values: List[torch.Tensor], error_scales: List[torch.Tensor],
                    send: torch.Tensor, world_size: int, local_size: int, bits: int, group_size: int,
                    err_beta: float, hadamard: bool, grid: str, stats: Optional[torch.Tensor]) -> None:
    """``deepspeed_loco::quantize_bucket`` on CUDA; see :func:`reference_impl.quantize_bucket`."""
    _run("quantize_bucket", dict(locals()), grads + [send] + error_values + error_scales, [g.dtype for g in grads])


def requantize_bucket(recv: torch.Tensor, error_values: List[torch.Tensor], error_scales: List[torch.Tensor],
                      send: torch.Tensor, widths: List[int], world_size: int, local_size: int, bits: int,
                      in_bits: int, in_blocks: int, group_size: int, err_beta: float, grid: str,
                      stats: Optional[torch.Tensor]) -> None:
    """``deepspeed_loco::requantize_bucket`` on CUDA; see :func:`reference_impl.requantize_bucket`."""
    _run("requantize_bucket", dict(locals()), [recv, send] + error_values + error_scales, [])


def final_mean_bucket(recv: torch.Tensor, numels: List[int], world_size: int, bits: int, group_size: int,
                      hadamard: bool, grid: str, rank: int, out_dtype: torch.dtype,
                      stats: Optional[torch.Tensor]) -> torch.Tensor:
    """``deepspeed_loco::final_mean_bucket`` on CUDA; see :func:`reference_impl.final_mean_bucket`."""
    return _run("final_mean_bucket", dict(locals()), [recv], [out_dtype])


def gather_sample(tensors: List[torch.Tensor], owners: torch.Tensor, coords: torch.Tensor,
                  scales: torch.Tensor) -> torch.Tensor:
    """The live rho's shared sample in one launch; see :func:`loco_reference.gather_sample` (which runs, logged
    once, for tensors the kernel cannot take)."""
    reason = _unsupported(tensors, [t.dtype for t in tensors], rows=False)
    if reason is not None:
        _fallback("gather_sample", reason)
        return loco_reference.gather_sample(tensors, owners, coords, scales)
    return load().gather_sample(list(tensors), owners, coords, scales)
