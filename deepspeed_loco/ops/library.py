"""LoCo's kernels as ``torch.library`` ops in the namespace ``deepspeed_loco``, the bucket entry points that call
them, and :func:`kernels_for`, the reducer's one dispatch point.

Each op is written once below: its schema (a definition string; the mutated tensors marked ``!``), its PyTorch
reference beside it (the op on every device but CUDA), and its fake
(shapes only, so ``torch.compile`` traces the ops as single nodes). No argument has a default: the dispatcher then
passes every one. The CUDA implementations are the fused kernels of ``deepspeed_loco/csrc/quantization``: loading
the extension (:func:`deepspeed_loco.ops.loco_cuda.load`) registers them for the CUDA dispatch key
(``TORCH_LIBRARY_IMPL`` in ``loco_binding.cpp``), and the dispatcher checks their C++ signatures against these
schemas. Their outputs are bit-identical to the reference run on the CPU. A CUDA call the kernels cannot run
(a tensor off that device, another dtype, a row without unit stride, a size above ``loco_limits.h``) fails with a
RuntimeError naming the input and what it must be: the kernels never hand a call to the reference.

``deepspeed_loco::quantize_bucket``
    The first hop of a bucket (``intra_node``, or ``inter_node`` when ``L == 1``): partition, swizzle, [rotate,]
    compensate, quantize, update the errors, pack into ``send`` uint8 ``(world_size, row_bytes)``.
``deepspeed_loco::requantize_bucket``
    A later hop: dequantize and sum the ``in_blocks`` received blocks of ``recv`` (``in_bits`` bits), compensate,
    quantize to ``bits``, update the errors, pack into ``send``.
``deepspeed_loco::final_mean_bucket``
    The last hop's received rows to this rank's mean partitions, concatenated: ``out_dtype`` ``(sum of
    ceil(numel / world_size),)``.
``deepspeed_loco::gather_sample``
    The live rho's shared sample of many tensors, one fp32 value per coordinate (indices on the host).

The ops' arguments: error lists ``error_values`` empty (no error feedback) or one tensor per parameter, int8
``(rows, P')`` with ``error_scales`` fp32 ``(rows, P' / group_size)``, or fp32 ``(rows, P')`` with ``error_scales``
empty (``deepspeed_loco.layout.ErrorStorage``); wire buffers uint8 ``(rows, row_bytes)`` of a
``deepspeed_loco.layout.WireLayout`` whose widths are the padded partitions of the gradients (``numels``; hop 2 takes
them as ``widths``); ``grid`` a name of ``deepspeed_loco.layout.GRIDS``; ``stats`` None, or the float64 noise
statistics the op adds to (``(2,)`` for the quantizing ops, ``(1,)`` for the final mean;
:mod:`deepspeed_loco.ops.loco_reference`'s docstring), which the live rho passes on measured steps only; ``own`` /
``in_own`` this rank's peer index in this hop / the previous one whose block is kept exact (-1: off), with ``own_out``
/ ``own_in`` the bucket's fp32 own buffers (None when off; ``loco_reference``'s docstring, "Exact own block"):
``own_out`` ``(kept rows, sum of P')``, ``own_in`` ``(the previous hop's kept rows, sum of P')``, ``(1, sum of P')``
for the final mean; with ``own >= 0`` the error lists have ``rows - kept rows`` rows.

The entry points (:class:`OpEntryPoints`) keep the signatures of :mod:`deepspeed_loco.ops.loco_reference`'s bucket
entry points (``HopArgs``, ``WireLayout``, ``ErrorBuffer``), check the bucket's sizes against the kernels' limits
(``deepspeed_loco.layout.limits.check_launch``) and call the ops; a bucket mixing parameters with and without error
buffers is refused (ValueError), never computed another way.

:func:`kernels_for` returns the :class:`Kernels` for tensors on a device: :data:`CUDA` (the ops' entry points, which
run the fused kernels when the ``loco_ops`` extension builds and loads: tried once per process) or :data:`REFERENCE`
(``loco_reference``'s own entry points: every device but CUDA, and CUDA with the reference chosen). The choice,
``zeropp_loco_param.kernels`` (the ``mode`` argument; ``docs/config.md``): ``auto`` (default) the CUDA kernels when
they load, else the reference, saying why; ``reference`` always the PyTorch reference (A/B checks, debugging);
``cuda`` the CUDA kernels for CUDA tensors, failing to build or load them an error. ``DS_LOCO_KERNELS``, when set to
one of those, overrides the key. The choice is logged once per device type (logger ``deepspeed_loco``, INFO), with
the reason, on rank 0 (a CUDA extension that failed to build or load: on each rank where it failed, naming it). This
is the one place that decides what computes a call: the reference runs on CUDA tensors only where ``reference`` was
chosen, or with ``auto`` where the extension failed to build or load (decided once per process, at the first call,
and logged), never per bucket.
"""
import os
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from deepspeed_loco.config import KERNEL_CHOICES
from deepspeed_loco.layout import ErrorStorage, HopArgs, MeanArgs, WireLayout, limits, padded_widths
from deepspeed_loco.ops import loco_cuda, loco_reference
from deepspeed_loco.ops.error_buffer import ErrorBuffer
from deepspeed_loco.utils.logging import log_rank0, logger

NAMESPACE = "deepspeed_loco"


# ------------------------------------------------------------------------------------------------------------ the ops
@dataclass(frozen=True)
class Op:
    """One op: its name, its schema (arguments and returns), its reference and its fake, all of the same arguments."""
    name: str
    schema: str
    reference: Callable
    fake: Callable


OPS: List[Op] = []  # in definition order


def _op(schema: str, fake: Callable):
    """Makes the decorated function the reference of the op of its name, with ``schema`` and ``fake``."""
    def define(reference: Callable) -> Callable:
        OPS.append(Op(reference.__name__, schema, reference, fake))
        return reference
    return define


def _returns_nothing(*args) -> None:
    """The fake of an op that only writes its mutated arguments."""


def _error_buffers(error_values: Sequence[torch.Tensor], error_scales: Sequence[torch.Tensor], rows: int,
                   group_size: int) -> List[Optional[ErrorBuffer]]:
    """The reference's error buffers of the ops' error lists, for a bucket of ``rows`` parameters (all None when
    ``error_values`` is empty); they share the tensors, so updating them updates the lists' tensors."""
    if not error_values:
        return [None] * rows
    if len(error_values) != rows or (error_scales and len(error_scales) != rows):
        raise ValueError(f"LoCo ops: {len(error_values)} error values and {len(error_scales)} error scales for a "
                         f"bucket of {rows} parameters")
    storage = ErrorStorage.of_values(error_values[0].dtype)
    if storage.scaled != bool(error_scales):
        raise ValueError(f"LoCo ops: {storage.label} error values take "
                         f"{'their fp32 scales' if storage.scaled else 'no scales'} (error_scales)")
    scales = list(error_scales) if storage.scaled else [None] * rows
    return [ErrorBuffer(v, s, group_size) for v, s in zip(error_values, scales)]


def _check_stats(stats: Optional[torch.Tensor], size: int) -> None:
    """RuntimeError unless ``stats`` is None or float64 ``(size,)`` (the ops' noise statistics, as the kernels
    take them)."""
    if stats is not None and (stats.dtype != torch.float64 or tuple(stats.shape) != (size, )):
        raise RuntimeError(f"LoCo ops: stats must be float64 ({size},), got {stats.dtype} {tuple(stats.shape)}")


@_op("(Tensor[] grads, Tensor(a!)[] error_values, Tensor(b!)[] error_scales, Tensor(c!) send, int world_size, "
     "int local_size, int bits, int group_size, float err_beta, bool hadamard, str grid, Tensor(d!)? stats, int own, "
     "Tensor(e!)? own_out) -> ()", fake=_returns_nothing)
def quantize_bucket(grads, error_values, error_scales, send, world_size, local_size, bits, group_size, err_beta,
                    hadamard, grid, stats, own, own_out):
    """The first hop (``loco_reference.quantize_bucket_``) into ``send`` uint8 ``(world_size, row_bytes)`` (and
    ``own_out`` with ``own >= 0``)."""
    _check_stats(stats, 2)
    args = HopArgs(world_size, local_size, bits, group_size, err_beta, hadamard, grid, own=own)
    wire = WireLayout(padded_widths([g.numel() for g in grads], world_size, group_size), bits, group_size)
    errors = _error_buffers(error_values, error_scales, len(grads), group_size)
    loco_reference.quantize_bucket_(grads, errors, args, wire, send, stats, own_out)


@_op("(Tensor recv, Tensor(a!)[] error_values, Tensor(b!)[] error_scales, Tensor(c!) send, int[] widths, "
     "int world_size, int local_size, int bits, int in_bits, int in_blocks, int group_size, float err_beta, str grid, "
     "Tensor(d!)? stats, Tensor? own_in, int in_own, int own, Tensor(e!)? own_out) -> ()", fake=_returns_nothing)
def requantize_bucket(recv, error_values, error_scales, send, widths, world_size, local_size, bits, in_bits,
                      in_blocks, group_size, err_beta, grid, stats, own_in, in_own, own, own_out):
    """A later hop (``loco_reference.requantize_bucket_``): ``recv`` uint8 ``(in_blocks * rows, in_row_bytes)`` on
    the wire of ``in_bits`` bits (and ``own_in`` with ``in_own >= 0``) into ``send`` uint8 ``(rows, row_bytes)`` on
    ``bits`` bits, both of ``widths`` (and ``own_out`` with ``own >= 0``)."""
    _check_stats(stats, 2)
    args = HopArgs(world_size, local_size, bits, group_size, err_beta, False, grid, in_bits, in_blocks, own, in_own)
    in_wire, wire = WireLayout(tuple(widths), in_bits, group_size), WireLayout(tuple(widths), bits, group_size)
    errors = _error_buffers(error_values, error_scales, len(widths), group_size)
    loco_reference.requantize_bucket_(recv, in_wire, errors, args, wire, send, stats, own_in, own_out)


def _final_mean_bucket_fake(recv, numels, world_size, bits, group_size, hadamard, grid, rank, out_dtype, stats,
                            own_in, in_own):
    return recv.new_empty(sum(-(-n // world_size) for n in numels), dtype=out_dtype)


@_op("(Tensor recv, int[] numels, int world_size, int bits, int group_size, bool hadamard, str grid, int rank, "
     "ScalarType out_dtype, Tensor(a!)? stats, Tensor? own_in, int in_own) -> Tensor", fake=_final_mean_bucket_fake)
def final_mean_bucket(recv, numels, world_size, bits, group_size, hadamard, grid, rank, out_dtype, stats, own_in,
                      in_own):
    """The final mean (``loco_reference.final_mean_bucket``): this rank's mean partitions, concatenated,
    ``out_dtype`` ``(sum of ceil(numel / world_size),)`` (``own_in`` in place of received row ``in_own`` when it
    is not -1)."""
    _check_stats(stats, 1)
    args = MeanArgs(world_size, bits, group_size, hadamard, grid, in_own)
    wire = WireLayout(padded_widths(numels, world_size, group_size), bits, group_size)
    parts = loco_reference.final_mean_bucket(recv, wire, args, numels, rank, out_dtype, stats, own_in)
    return torch.cat(parts) if parts else recv.new_empty(0, dtype=out_dtype)


def _gather_sample_fake(tensors, owners, coords, scales):
    return tensors[0].new_empty(coords.numel(), dtype=torch.float32)


@_op("(Tensor[] tensors, Tensor owners, Tensor coords, Tensor scales) -> Tensor", fake=_gather_sample_fake)
def gather_sample(tensors, owners, coords, scales):
    """``loco_reference.gather_sample``: fp32 ``(n,)`` on the tensors' device, ``owners`` int32 ``(n,)``, ``coords``
    int64 ``(n,)`` and ``scales`` fp32 ``(len(tensors),)`` on the CPU."""
    return loco_reference.gather_sample(tensors, owners, coords, scales)


def define_ops(namespace: str) -> torch.library.Library:
    """Defines every op of :data:`OPS` in ``namespace`` (its schema, its reference for every dispatch key but those a
    kernel is registered for, its fake); the returned library keeps them registered. Done for :data:`NAMESPACE` at
    import; a further build of the kernels registers under a namespace of its own (``benchmarks/kernels.py``)."""
    library = torch.library.Library(namespace, "DEF")
    for op in OPS:
        library.define(op.name + op.schema)
        library.impl(op.name, op.reference, "CompositeExplicitAutograd")
        torch.library.register_fake(f"{namespace}::{op.name}", op.fake, lib=library)
    return library


_LIBRARY = define_ops(NAMESPACE)


# ------------------------------------------------------------------------------------------------ bucket entry points
def _error_lists(errors: Sequence[Optional[ErrorBuffer]]) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """``(values, scales)`` as the ops take them (empty lists without error feedback). ValueError for a bucket
    mixing parameters with and without error buffers: the error-feedback state gives every parameter of a hop its
    buffers or none, so such a bucket is a caller's bug."""
    if all(e is None for e in errors):
        return [], []
    missing = [i for i, e in enumerate(errors) if e is None]
    if missing:
        raise ValueError(f"LoCo ops: a bucket mixes parameters with and without error buffers (none for parameters "
                         f"{missing} of {len(errors)}); a hop's error buffers must be given for every parameter or "
                         f"for none")
    return [e.values for e in errors], [e.scale for e in errors if e.scale is not None]


def _check_wire(wire: WireLayout, args: Union[HopArgs, MeanArgs], bits: int, what: str) -> None:
    if wire.bits != bits or wire.group_size != args.group_size:
        raise ValueError(f"LoCo ops: {what} has {wire.bits} bits and group size {wire.group_size}, the hop "
                         f"{bits} bits and group size {args.group_size}")


class OpEntryPoints:
    """The bucket entry points on the ops of ``namespace``, with the signatures of ``loco_reference``'s (see there
    for each one's contract): on CUDA tensors they run the kernels registered there."""

    def __init__(self, namespace: str = NAMESPACE):
        self.ops = getattr(torch.ops, namespace)

    def quantize_bucket_(self, grads: Sequence[torch.Tensor], errors: Sequence[Optional[ErrorBuffer]],
                         args: HopArgs, wire: WireLayout, send: torch.Tensor, stats: Optional[torch.Tensor] = None,
                         own_out: Optional[torch.Tensor] = None) -> None:
        """``wire``'s widths are the gradients' padded partitions (``HopPlan.widths``); runs ``quantize_bucket``."""
        lists = _error_lists(errors)
        _check_wire(wire, args, args.bits, "wire")
        wire.check_buffer(send, "send")
        loco_reference.check_hop_own(args, wire, send.device, errors, own_out=own_out)
        limits.check_launch(wire.widths, args.world_size, args.group_size, "grads")
        self.ops.quantize_bucket(list(grads), lists[0], lists[1], send, args.world_size, args.local_size, args.bits,
                                 args.group_size, args.err_beta, args.hadamard, args.grid, stats, args.own, own_out)

    def requantize_bucket_(self, recv: torch.Tensor, in_wire: WireLayout, errors: Sequence[Optional[ErrorBuffer]],
                           args: HopArgs, wire: WireLayout, send: torch.Tensor, stats: Optional[torch.Tensor] = None,
                           own_in: Optional[torch.Tensor] = None, own_out: Optional[torch.Tensor] = None) -> None:
        """``in_wire`` and ``wire`` of the same widths; runs ``requantize_bucket``."""
        lists = _error_lists(errors)
        _check_wire(wire, args, args.bits, "wire")
        _check_wire(in_wire, args, args.in_bits, "in_wire")
        if in_wire.widths != wire.widths:
            raise ValueError("LoCo ops: in_wire and wire must have the same parameter widths")
        in_wire.check_buffer(recv, "recv")
        wire.check_buffer(send, "send")
        loco_reference.check_hop_own(args, wire, recv.device, errors, own_in, own_out)
        limits.check_launch(wire.widths, args.world_size // args.local_size, args.group_size, "widths")
        self.ops.requantize_bucket(recv, lists[0], lists[1], send, list(wire.widths), args.world_size,
                                   args.local_size, args.bits, args.in_bits, args.in_blocks, args.group_size,
                                   args.err_beta, args.grid, stats, own_in, args.in_own, args.own, own_out)

    def final_mean_bucket(self, recv: torch.Tensor, wire: WireLayout, args: MeanArgs, numels: Sequence[int],
                          rank: int, out_dtype: torch.dtype, stats: Optional[torch.Tensor] = None,
                          own_in: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
        """Runs ``final_mean_bucket``; the partitions returned are views of one flat tensor (in parameter order)."""
        _check_wire(wire, args, args.bits, "wire")
        wire.check_buffer(recv, "recv")
        loco_reference.check_mean_own(args, wire, recv, own_in)
        limits.check_launch(wire.widths, 1, args.group_size, "numels")
        flat = self.ops.final_mean_bucket(recv, list(numels), args.world_size, args.bits, args.group_size,
                                          args.hadamard, args.grid, rank, out_dtype, stats, own_in, args.in_own)
        return list(flat.split([-(-n // args.world_size) for n in numels]))

    def gather_sample(self, tensors: Sequence[torch.Tensor], owners: torch.Tensor, coords: torch.Tensor,
                      scales: torch.Tensor) -> torch.Tensor:
        """Runs ``gather_sample`` (on CUDA tensors: one launch)."""
        return self.ops.gather_sample(list(tensors), owners, coords, scales)


# ----------------------------------------------------------------------------------------------------- dispatch
ENV_VAR = "DS_LOCO_KERNELS"
CONFIG_KEY = "zeropp_loco_param.kernels"


@dataclass(frozen=True)
class Kernels:
    """The bucket entry points the reducer calls (``loco_reference``'s signatures), and ``gather_sample``, the
    live rho's sample gather (:func:`loco_reference.gather_sample`). ``name``: what computes,
    ``"loco_reference"`` or ``"loco_cuda"`` (the start-up line and the benchmarks report it)."""
    name: str
    quantize_bucket_: Callable[..., None]
    requantize_bucket_: Callable[..., None]
    final_mean_bucket: Callable[..., List[torch.Tensor]]
    gather_sample: Callable[..., torch.Tensor]

    @classmethod
    def of_ops(cls, name: str, entry_points: OpEntryPoints) -> "Kernels":
        return cls(name, entry_points.quantize_bucket_, entry_points.requantize_bucket_,
                   entry_points.final_mean_bucket, entry_points.gather_sample)


REFERENCE = Kernels("loco_reference", loco_reference.quantize_bucket_, loco_reference.requantize_bucket_,
                    loco_reference.final_mean_bucket, loco_reference.gather_sample)  # the one route to the reference
CUDA = Kernels.of_ops("loco_cuda", OpEntryPoints())  # the ops, on CUDA tensors: the fused kernels

_load_error: Optional[Tuple[Optional[BaseException]]] = None  # (None,) loaded; (exception,) failed; None: not tried
_logged: Dict[str, str] = {}


def kernels_for(device: torch.device, mode: str = "auto") -> Kernels:
    """The bucket entry points for tensors on ``device``; ``mode``: ``zeropp_loco_param.kernels`` (``ENV_VAR``
    overrides it when set). ValueError for an invalid mode; RuntimeError for ``cuda`` without the CUDA kernels."""
    device = torch.device(device)
    mode, source = _mode(mode)
    if device.type != "cuda":
        _log_once(device.type, f"deepspeed_loco: PyTorch reference kernels for {device.type} tensors "
                  f"(the fused op is CUDA-only)")
        return REFERENCE
    if mode == "reference":
        _log_once("cuda", f"deepspeed_loco: PyTorch reference kernels for CUDA tensors ({source}=reference)")
        return REFERENCE
    error = _cuda_load_error()
    if error is None:
        _log_once("cuda", "deepspeed_loco: fused CUDA kernels (loco_ops) for CUDA tensors")
        return CUDA
    if mode == "cuda":
        raise RuntimeError(f"{source}=cuda but the loco_ops CUDA extension did not build or load") from error
    _log_once("cuda", f"deepspeed_loco: PyTorch reference kernels for CUDA tensors: the loco_ops CUDA extension did "
              f"not build or load ({type(error).__name__}: {error})", every_rank=True)
    return REFERENCE


def _mode(configured: str) -> Tuple[str, str]:
    """``(mode, where it came from)``: the environment variable when set, else the config key; validated."""
    override = os.environ.get(ENV_VAR, "").strip().lower()
    mode, source = (override, ENV_VAR) if override else (configured, CONFIG_KEY)
    if mode not in KERNEL_CHOICES:
        raise ValueError(f"{source}={mode!r} is invalid: it must be one of {KERNEL_CHOICES}")
    if override and override != configured:
        _log_once("override", f"deepspeed_loco: {ENV_VAR}={override} overrides {CONFIG_KEY}={configured!r}")
    return mode, source


def _cuda_load_error() -> Optional[BaseException]:
    """None when the ``loco_ops`` extension loads, else why not; tried once per process."""
    global _load_error
    if _load_error is None:
        try:
            loco_cuda.load()
            _load_error = (None, )
        except Exception as exc:  # a failed build or load of the optional op: the caller says why
            _load_error = (exc, )
    return _load_error[0]


def _log_once(key: str, message: str, every_rank: bool = False) -> None:
    """Logs ``message`` once per process for ``key`` (again only if it changes): on rank 0 only, as the choice is
    the job's; with ``every_rank``, on each rank, named (a build or load that failed is the rank's own)."""
    if _logged.get(key) == message:
        return
    _logged[key] = message
    if every_rank and torch.distributed.is_initialized():
        logger.info(f"rank {torch.distributed.get_rank()}: {message}")
    else:
        log_rank0(message)


def _reset() -> None:
    """Forgets the load attempt and what was logged (tests)."""
    global _load_error
    _load_error = None
    _logged.clear()
