"""LoCo's kernels as ``torch.library`` ops in the namespace ``deepspeed_loco``, and the bucket entry points that
call them.

Ops (schemas of tensors, lists of tensors and scalars only, the mutated tensors declared; each schema is derived from
:mod:`deepspeed_loco.ops.reference_impl`'s annotated signature by :func:`schema_of`, and the fakes and entry points
below take the arguments by name; ``tests/unit/ops/test_op_signatures.py`` checks the copies that must remain, the
CUDA implementations' Python signatures and the C++ binding's parameters, against the schemas):

``deepspeed_loco::quantize_bucket``
    The first hop of a bucket (``intra_node``, or ``inter_node`` when ``L == 1``): partition, swizzle, [rotate,]
    compensate, quantize, update the errors, pack. Mutates
    ``error_values``, ``error_scales`` and ``send`` uint8 ``(world_size, row_bytes)``; returns nothing.
``deepspeed_loco::requantize_bucket``
    A later hop: dequantize and sum the ``in_blocks`` received blocks of ``recv`` (``in_bits`` bits), compensate,
    quantize to ``bits``, update the errors. Mutates ``error_values``, ``error_scales`` and ``send``.
``deepspeed_loco::final_mean_bucket``
    The last hop's received rows to this rank's mean partitions, concatenated: returns ``out_dtype``
    ``(sum of ceil(numel / world_size),)``.

Every op takes, last, an optional fp32 ``stats`` (None: nothing computed; no default, every call passes it) that
it adds its noise statistics to, mutated in place: ``(2,)`` for the quantizing ops (``||input||^2``, quantization
error power), ``(1,)`` for the final mean (``||mean||^2``); :mod:`deepspeed_loco.ops.loco_reference` defines them.
The live rho (:mod:`deepspeed_loco.runtime.comm.noise_stats`) passes it on measured steps only.

The arguments' names, order, types and contract (shapes, dtypes, the error lists) are
:mod:`deepspeed_loco.ops.reference_impl`'s.
Implementations: CUDA tensors run the fused kernels (:mod:`deepspeed_loco.ops.loco_cuda`); every other device runs
the PyTorch reference (:mod:`deepspeed_loco.ops.reference_impl`); fake tensors (``torch.compile``, meta) get the
output's shape from the fake implementations below, so a compiled reduce step traces the ops without a graph break.

The entry points :func:`quantize_bucket_`, :func:`requantize_bucket_` and :func:`final_mean_bucket` keep the
signatures of :mod:`deepspeed_loco.ops.loco_reference`'s bucket entry points (``HopArgs``, ``WireLayout``,
``ErrorBuffer``) and turn them into the ops' arguments; ``deepspeed_loco.ops.kernels_for`` hands them to the reducer.
"""
import dataclasses
import inspect
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import torch

from deepspeed_loco.layout import HopArgs, MeanArgs, WireLayout
from deepspeed_loco.ops import loco_cuda, loco_reference, reference_impl
from deepspeed_loco.ops.error_buffer import ErrorBuffer

NAMESPACE = "deepspeed_loco"
MUTATED = ("error_values", "error_scales", "send", "stats")  # the tensors an op may write, wherever it takes them


def _mutated(impl: Callable) -> Tuple[str, ...]:
    return tuple(name for name in MUTATED if name in inspect.signature(impl).parameters)


def schema_of(impl: Callable) -> str:
    """The op schema of ``impl``'s annotated signature (:mod:`deepspeed_loco.ops.reference_impl`, the one place
    the ops' arguments are written): ``torch.library.infer_schema`` with the :data:`MUTATED` arguments it takes
    marked, and ``int`` for its ``SymInt`` (the binding takes ``int64_t``; the ops take no symbolic sizes). The
    signatures give no argument a default, so neither does the schema: the dispatcher leaves out of a Python kernel's
    arguments every trailing one equal to its default, and torch 2.11's version bump of the mutated arguments then
    indexes past their end (``IndexError`` on ``stats=None``); :func:`_call` always passes every argument."""
    return torch.library.infer_schema(impl, mutates_args=_mutated(impl)).replace("SymInt", "int")


def _define(impl: Callable, cuda_impl: Callable):
    """``deepspeed_loco::<impl's name>``: its schema from ``impl``, which runs on every device but CUDA;
    ``cuda_impl`` (of the same signature) on CUDA."""
    op = torch.library.custom_op(f"{NAMESPACE}::{impl.__name__}", impl, schema=schema_of(impl),
                                 mutates_args=_mutated(impl))
    op.register_kernel("cuda")(cuda_impl)
    return op


quantize_bucket_op = _define(reference_impl.quantize_bucket, loco_cuda.quantize_bucket)
requantize_bucket_op = _define(reference_impl.requantize_bucket, loco_cuda.requantize_bucket)
final_mean_bucket_op = _define(reference_impl.final_mean_bucket, loco_cuda.final_mean_bucket)
_FINAL_MEAN = inspect.signature(reference_impl.final_mean_bucket)


@quantize_bucket_op.register_fake
@requantize_bucket_op.register_fake
def _mutating_fake(*args, **kwargs) -> None:
    """The quantizing ops return nothing (they write their mutated arguments)."""
    return None


@final_mean_bucket_op.register_fake
def _final_mean_bucket_fake(*args, **kwargs) -> torch.Tensor:
    a = _FINAL_MEAN.bind(*args, **kwargs).arguments
    return a["recv"].new_empty(sum(-(-n // a["world_size"]) for n in a["numels"]), dtype=a["out_dtype"])


_ARGUMENTS = {op: tuple(a.name for a in op._opoverload._schema.arguments)
              for op in (quantize_bucket_op, requantize_bucket_op, final_mean_bucket_op)}


_SCALARS = {kind: tuple(f.name for f in dataclasses.fields(kind)) for kind in (HopArgs, MeanArgs)}


def _call(op, args: Union[HopArgs, MeanArgs], **tensors) -> Any:
    """Runs ``op`` on its arguments by name: the hop's scalars (``args``' fields) and ``tensors`` (the rest). The
    fields are read by name, not through ``vars(args)``, which torch.compile cannot trace in torch 2.11."""
    values = {name: getattr(args, name) for name in _SCALARS[type(args)]}
    values.update(tensors)
    return op(*[values[name] for name in _ARGUMENTS[op]])


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
    _call(quantize_bucket_op, args, grads=list(grads), error_values=lists[0],
          error_scales=lists[1], send=send, stats=stats)


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
    _call(requantize_bucket_op, args, recv=recv, error_values=lists[0],
          error_scales=lists[1], send=send, widths=list(wire.widths), stats=stats)


def final_mean_bucket(recv: torch.Tensor, wire: WireLayout, args: MeanArgs, numels: Sequence[int], rank: int,
                      out_dtype: torch.dtype, stats: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
    """See :func:`deepspeed_loco.ops.loco_reference.final_mean_bucket`; runs ``deepspeed_loco::final_mean_bucket``.
    The partitions returned are views of one flat tensor (in parameter order)."""
    _check_wire(wire, args, args.bits, "wire")
    flat = _call(final_mean_bucket_op, args, recv=recv, numels=list(numels), rank=rank,
                 out_dtype=out_dtype, stats=stats)
    return list(flat.split([-(-n // args.world_size) for n in numels]))
