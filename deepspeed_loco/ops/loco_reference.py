"""Pure-PyTorch reference of every kernel of the LoCo reduce, one parameter at a time.

Device-agnostic (CPU and CUDA tensors). Each per-parameter function takes the hop's ``HopArgs``
(``deepspeed_loco.layout``); the bucket entry points at the bottom (one call per hop per bucket) are the reference
of the ``deepspeed_loco`` ops (``deepspeed_loco.ops.library`` defines each op with its reference, which calls them),
and the CUDA kernels (``deepspeed_loco/csrc/quantization``) implement the same ops, one launch each, with identical
integer outputs (packed data, int8 error) and identical fp32 scales. This module fixes the order of every fp32
operation to make that possible:

* compensation ``c = x + e``; residual ``r = c - deq(q)`` with ``deq(q) = q * scale`` (symmetric grid) or
  ``(q + 0.5) * scale`` (mid-rise: the sum exact, one rounding in the product); update
  ``e' = beta * e + (1 - beta) * r`` with ``beta`` and ``1 - beta`` rounded to fp32 first; sums over received
  blocks in block order (each block dequantized as above), then ``/ W`` (IEEE division).

Layout (``deepspeed_loco.layout``, ``docs/design.md``): a gradient of ``N`` elements is split into ``W`` partitions of
``P = ceil(N / W)`` elements, each zero-padded to ``P' = roundup(P, group_size)``; partition (row) ``r = n*L + d``
is sent from slot ``d*M + n`` so that the ``M`` rows for local peer ``d`` are contiguous.
Outputs are written into views of the bucket's wire buffers: ``data`` uint8 ``(rows, P' * bits // 8)`` and
``scale`` fp32 ``(rows, P' // group_size)``, both with arbitrary row strides.

Exact own block (``HopArgs.own`` / ``in_own``, ``MeanArgs.in_own``; -1: off, every block quantized as above): a
quantizing hop with ``own >= 0`` copies the rows of its own block, ``[own * k, (own + 1) * k)`` with ``k =
args.kept_rows``, exactly (rotated with ``hadamard``) into ``own_out`` fp32 ``(k, P')``, compensates, quantizes and
updates the error of the other rows only, in order with the own rows left out (its error buffer has ``rows - k``
rows: error row ``s`` is slot ``s`` before the own block, ``s + k`` after it), and writes zeros (data bytes and
scales) in the own rows of the wire. A hop or final mean with ``in_own >= 0`` does not read received block
``in_own``: it sums the other blocks in block order (the first as is, then one fp32 add each), then adds ``own_in``
fp32 (the previous hop's ``own_out``) with one fp32 add, last. The bucket entry points take these buffers for the
whole bucket, ``(k, sum of P')``, parameter ``i`` in columns ``[offset_i, offset_i + P'_i)`` as on the wire.

Noise statistics (the live rho, :mod:`deepspeed_loco.runtime.comm.noise_stats`): every hop function and bucket
entry point takes an optional ``stats``, float64 (the ops take no other; the sums over buckets and micro-steps build
up there), to which it adds fp32 sums of squares. A quantizing hop's ``stats``
has 2 elements: ``stats[0] += ||x||^2`` of the values it was given (the first hop: the gradient; a later hop: the
fp32 sum of the received blocks), before rotation and compensation; ``stats[1] += ||c - deq(quant(c))||^2``, the
error its quantizer made on the compensated values ``c`` (``c = x`` without error feedback; in the rotated basis with
``hadamard``, which is orthonormal). The final mean's ``stats`` has 1 element: ``+= ||mean||^2`` of the fp32 mean
partitions, before the cast to the output dtype. A group holding a non-finite value makes the sums non-finite.
With an exact own block ``stats[0]`` still covers every row (the own block's included, a later hop's exact
``own_in`` too) and ``stats[1]`` the quantized rows only: the own block carries no quantization error.
"""
from typing import List, Optional, Sequence, Tuple

import torch

from deepspeed_loco.layout import HopArgs, MeanArgs, WireLayout, padded_partition_size, partition_size, slot_to_row
from deepspeed_loco.ops.error_buffer import ErrorBuffer
from deepspeed_loco.ops.hadamard import rotate, unrotate
from deepspeed_loco.ops.quantizer import dequantize_groups, pack, quantize_groups, unpack


def partition_rows(grad: torch.Tensor, world_size: int, group_size: int) -> torch.Tensor:
    """fp32 ``(W, P')``: row ``r`` holds flat elements ``[r*P, (r+1)*P)`` of ``grad``, zero past ``N`` and ``P``."""
    numel = grad.numel()
    part = partition_size(numel, world_size)
    rows = torch.zeros(world_size, padded_partition_size(numel, world_size, group_size),
                       dtype=torch.float32, device=grad.device)
    flat = torch.zeros(world_size * part, dtype=torch.float32, device=grad.device)
    flat[:numel] = grad.reshape(-1)
    rows[:, :part] = flat.view(world_size, part)
    return rows


def compensate_and_quantize(c: torch.Tensor, error: Optional[ErrorBuffer], beta: float, bits: int,
                            group_size: int, grid: str = "symmetric", stats: Optional[torch.Tensor] = None):
    """One LoCo step on fp32 ``c`` ``(rows, n)``: ``c += e``; quantize on ``grid``;
    ``e <- beta*e + (1-beta)*(c - deq)``.

    Returns ``(q int8 (rows, n), scale fp32 (rows, n // group_size))`` and updates ``error`` in place
    (``error is None``: plain quantization). ``stats``: None, or float64 ``(2,)`` whose ``[1]`` gains the quantization
    error power ``||c - deq||^2`` (fp32 sum).
    """
    if error is None:
        q, scale = quantize_groups(c, bits, group_size, grid)
        if stats is not None:
            stats[1] += (c - dequantize_groups(q, scale, group_size, grid)).pow(2).sum()
        return q, scale
    old = error.dequantize()
    c = c + old
    q, scale = quantize_groups(c, bits, group_size, grid)
    residual = c - dequantize_groups(q, scale, group_size, grid)
    if stats is not None:
        stats[1] += residual.pow(2).sum()
    beta32 = torch.tensor(beta, dtype=torch.float32, device=c.device)
    error.store_(old * beta32 + residual * (1 - beta32))
    return q, scale


def quantize_(grad: torch.Tensor, error: Optional[ErrorBuffer], args: HopArgs, out_data: torch.Tensor,
          out_scale: torch.Tensor, stats: Optional[torch.Tensor] = None,
          own_out: Optional[torch.Tensor] = None) -> None:
    """The first hop's fused step on one gradient: partition, swizzle, [rotate,] compensate, quantize, update the
    error, pack.

    ``grad``: any shape, fp32/fp16/bf16, ``N`` elements, partitioned over ``W = args.world_size`` ranks
    (``L = args.local_size`` per node). ``error``: ``(W, P')`` in slot order, or None.
    Writes ``out_data`` uint8 ``(W, P' * args.bits // 8)`` and ``out_scale`` fp32 ``(W, P' // args.group_size)`` in
    slot order. The first hop is ``intra_node`` when ``L > 1``, else ``inter_node`` (``deepspeed_loco.layout``).
    ``args.hadamard``: each group is rotated (``ops.hadamard.rotate``) first; everything downstream, the error
    buffers included, then lives in the rotated basis until :func:`final_mean` rotates back. ``args.grid``: the
    quantization grid of the wire values (``ops.quantizer.grid_levels``), the same on every hop. ``stats``: None or
    float64 ``(2,)``, gains ``[||grad||^2, quantization error power]`` (module docstring). ``args.own >= 0``: slots
    ``[own * k, (own + 1) * k)`` (``k = args.kept_rows``) go exactly to ``own_out`` fp32 ``(k, P')`` and ``error``
    has ``W - k`` rows (module docstring).
    """
    world, group_size = args.world_size, args.group_size
    rows = partition_rows(grad, world, group_size)[slot_to_row(world, args.local_size).to(grad.device)]
    if stats is not None:
        stats[0] += rows.pow(2).sum()
    if args.hadamard:
        rows = rotate(rows, group_size)
    _quantize_rows(rows, error, args, out_data, out_scale, stats, own_out)


def _quantize_rows(rows: torch.Tensor, error: Optional[ErrorBuffer], args: HopArgs, out_data: torch.Tensor,
                   out_scale: torch.Tensor, stats: Optional[torch.Tensor], own_out: Optional[torch.Tensor]) -> None:
    """The end of every quantizing hop on fp32 ``rows``: with ``args.own >= 0`` the own block's rows to ``own_out``
    exactly and zeros on the wire in their place; :func:`compensate_and_quantize` of the other rows (all of them
    without an own block), packed into ``out_data`` and ``out_scale``."""
    if args.own < 0:
        q, scale = compensate_and_quantize(rows, error, args.err_beta, args.bits, args.group_size, args.grid, stats)
        out_data.copy_(pack(q, args.bits))
        out_scale.copy_(scale)
        return
    lo, hi = args.own * args.kept_rows, (args.own + 1) * args.kept_rows
    own_out.copy_(rows[lo:hi])
    others = torch.cat([rows[:lo], rows[hi:]])
    q, scale = compensate_and_quantize(others, error, args.err_beta, args.bits, args.group_size, args.grid, stats)
    data = pack(q, args.bits)
    for out, sent in ((out_data, data), (out_scale, scale)):
        out[:lo] = sent[:lo]
        out[lo:hi] = 0
        out[hi:] = sent[lo:]


def dequantize_sum(data: torch.Tensor, scale: torch.Tensor, blocks: int, bits: int, group_size: int,
                   grid: str = "symmetric", own: int = -1, own_in: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Sum of ``blocks`` dequantized blocks: ``data`` ``(blocks*R, ...)`` to fp32 ``(R, n)``, in block order.
    ``own >= 0``: block ``own`` is left out (what it holds does not matter) and ``own_in`` fp32 ``(R, n)`` is added
    after the others (at least one; :func:`check_own_buffer`)."""
    values = dequantize_groups(unpack(data, bits), scale, group_size, grid)
    values = values.view(blocks, values.shape[0] // blocks, values.shape[1])
    summed = [block for block in range(blocks) if block != own]
    total = values[summed[0]].clone()
    for block in summed[1:]:
        total += values[block]
    if own >= 0:
        total += own_in
    return total


def requantize_(recv_data: torch.Tensor, recv_scale: torch.Tensor, error: Optional[ErrorBuffer], args: HopArgs,
          out_data: torch.Tensor, out_scale: torch.Tensor, stats: Optional[torch.Tensor] = None,
          own_in: Optional[torch.Tensor] = None, own_out: Optional[torch.Tensor] = None) -> None:
    """A later hop's fused step on one parameter (the ``inter_node`` hop after ``intra_node``): dequantize and
    fp32-sum the ``B = args.in_blocks`` received blocks (``args.in_bits`` bits), compensate, quantize to
    ``args.bits``, update the error.

    ``recv_data`` uint8 ``(B*M, P' * in_bits // 8)``, ``recv_scale`` fp32 ``(B*M, P' // group_size)`` (block
    from local peer ``i`` = rows ``[i*M, (i+1)*M)``). ``error``: ``(M, P')`` or None.
    Writes ``out_data`` uint8 ``(M, P' * bits // 8)`` and ``out_scale`` fp32 ``(M, P' // group_size)``. ``stats``:
    None or float64 ``(2,)``, gains ``[||sum||^2, quantization error power]`` (module docstring).
    ``args.in_own >= 0``: ``own_in`` fp32 ``(M, P')`` replaces received block ``in_own``, added last.
    ``args.own >= 0``: row ``own`` of the sum goes exactly to ``own_out`` fp32 ``(1, P')`` and ``error`` has ``M - 1``
    rows (module docstring).
    """
    total = dequantize_sum(recv_data, recv_scale, args.in_blocks, args.in_bits, args.group_size, args.grid,
                           args.in_own, own_in)
    if stats is not None:
        stats[0] += total.pow(2).sum()
    _quantize_rows(total, error, args, out_data, out_scale, stats, own_out)


def final_mean(recv_data: torch.Tensor, recv_scale: torch.Tensor, args: MeanArgs, numel: int, rank: int,
               out_dtype: torch.dtype, stats: Optional[torch.Tensor] = None,
               own_in: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Dequantize, fp32-sum the received rows in order, [rotate back,] divide by ``W``: this rank's mean partition.

    ``recv_data`` uint8 ``(R, P' * args.bits // 8)``, ``recv_scale`` fp32 ``(R, P' // args.group_size)``.
    Returns ``(P,)`` in ``out_dtype``, ``P = ceil(numel / W)``, zero past ``numel`` (global index). ``stats``: None
    or float64 ``(1,)``, gains ``||mean||^2`` of the fp32 mean (module docstring). ``args.in_own >= 0``: ``own_in``
    fp32 ``(1, P')`` replaces received row ``in_own``, added last.
    """
    world = args.world_size
    total = dequantize_sum(recv_data, recv_scale, recv_data.shape[0], args.bits, args.group_size, args.grid,
                           args.in_own, own_in)[0]
    if args.hadamard:
        total = unrotate(total, args.group_size)
    part = partition_size(numel, world)
    mean = total[:part] / torch.full_like(total[:part], world)  # true division on CUDA too
    valid = max(0, min(part, numel - rank * part))
    mean[valid:] = 0
    if stats is not None:
        stats[0] += mean.pow(2).sum()
    return mean.to(out_dtype)


# ------------------------------------------------------------------------------------------------ bucket entry points
# The reducer calls these once per hop per bucket. ``wire.views(buffer, i, offset)`` is parameter ``i``'s slice of a
# bucket's wire buffer (``deepspeed_loco.layout.WireLayout``); ``args`` is the hop's ``HopArgs`` (the final mean's
# ``MeanArgs``).
# ``stats``: None, or the float64 sums of the module docstring over the whole bucket ((2,) for a quantizing hop, (1,)
# for the final mean), added parameter by parameter. ``own_out`` / ``own_in``: the bucket's own buffers (module
# docstring), None where ``args.own`` / ``args.in_own`` is -1; checked by :func:`check_hop_own` and
# :func:`check_mean_own` (ValueError naming the buffer and the shape it must have).
def check_own_buffer(name: str, buffer: Optional[torch.Tensor], index_name: str, index: int, blocks: int,
                     shape: Tuple[int, int], device: torch.device) -> None:
    """ValueError naming ``name`` unless ``buffer`` is what block index ``index`` (the argument ``index_name``)
    asks for: None when it is -1; for ``0 <= index < blocks``, a contiguous fp32 tensor of ``shape`` on ``device``,
    with at least one other block (as the kernels' binding asks)."""
    if index == -1:
        if buffer is not None:
            raise ValueError(f"LoCo ops: {name} must be None when {index_name} is -1 (no exact own block), got "
                             f"{tuple(buffer.shape)}")
        return
    if not 0 <= index < blocks:
        raise ValueError(f"LoCo ops: {index_name} = {index} must be -1 or a block index in [0, {blocks})")
    if blocks < 2:
        raise ValueError(f"LoCo ops: {index_name} = {index} needs at least 2 blocks, its own and another, got {blocks}")
    if buffer is None:
        raise ValueError(f"LoCo ops: {index_name} = {index} needs {name}, fp32 of shape {shape}; got None")
    if (buffer.dtype != torch.float32 or tuple(buffer.shape) != tuple(shape) or not buffer.is_contiguous()
            or buffer.device != torch.device(device)):
        raise ValueError(f"LoCo ops: {name} must be a contiguous fp32 tensor of shape {tuple(shape)} on {device} "
                         f"({index_name} = {index}), got {buffer.dtype} {tuple(buffer.shape)} on {buffer.device}"
                         f"{'' if buffer.is_contiguous() else ', not contiguous'}")


def check_hop_own(args: HopArgs, wire: WireLayout, device: torch.device, errors: Sequence[Optional[ErrorBuffer]],
                  own_in: Optional[torch.Tensor] = None, own_out: Optional[torch.Tensor] = None) -> None:
    """A quantizing hop's own buffers: ``own_out`` ``(args.kept_rows, wire.columns)`` for ``args.own``, ``own_in``
    ``(args.in_kept_rows, wire.columns)`` for ``args.in_own`` (none on the first hop); and its error buffers'
    ``args.error_rows`` rows (the own block's left out)."""
    check_own_buffer("own_out", own_out, "own", args.own, args.peers, (args.kept_rows, wire.columns), device)
    check_own_buffer("own_in", own_in, "in_own", args.in_own, args.in_blocks, (args.in_kept_rows, wire.columns),
                     device)
    rows = [error.values.shape[0] for error in errors if error is not None]
    if any(count != args.error_rows for count in rows):
        less = f", less the {args.kept_rows} of own block {args.own}" if args.own >= 0 else ""
        raise ValueError(f"LoCo ops: this hop's error buffers must have {args.error_rows} rows ({args.rows} partition "
                         f"rows{less}), got {rows}")


def check_mean_own(args: MeanArgs, wire: WireLayout, recv: torch.Tensor, own_in: Optional[torch.Tensor]) -> None:
    """The final mean's ``own_in``: ``(1, wire.columns)`` for ``args.in_own``, one of ``recv``'s rows."""
    check_own_buffer("own_in", own_in, "in_own", args.in_own, recv.shape[0], (1, wire.columns), recv.device)


def _own_columns(buffer: Optional[torch.Tensor], wire: WireLayout, index: int, offset: int) -> Optional[torch.Tensor]:
    """Parameter ``index``'s columns of a bucket's own buffer (None for None)."""
    return None if buffer is None else buffer[:, offset:offset + wire.widths[index]]


def quantize_bucket_(grads: Sequence[torch.Tensor], errors: Sequence[Optional[ErrorBuffer]], args: HopArgs,
                     wire: WireLayout, send: torch.Tensor, stats: Optional[torch.Tensor] = None,
                     own_out: Optional[torch.Tensor] = None) -> None:
    """The first hop of a bucket: :func:`quantize_` for every gradient, into ``send`` uint8 ``(W, wire.row_bytes)``
    (and ``own_out`` fp32 ``(args.kept_rows, wire.columns)`` with ``args.own >= 0``)."""
    check_hop_own(args, wire, send.device, errors, own_out=own_out)
    for i, (grad, error, offset) in enumerate(zip(grads, errors, wire.offsets())):
        quantize_(grad, error, args, *wire.views(send, i, offset), stats, _own_columns(own_out, wire, i, offset))


def requantize_bucket_(recv: torch.Tensor, in_wire: WireLayout, errors: Sequence[Optional[ErrorBuffer]],
                       args: HopArgs, wire: WireLayout, send: torch.Tensor, stats: Optional[torch.Tensor] = None,
                       own_in: Optional[torch.Tensor] = None, own_out: Optional[torch.Tensor] = None) -> None:
    """A later hop of a bucket: :func:`requantize_` for every parameter, from the previous hop's ``recv`` (and
    ``own_in`` fp32 ``(args.in_kept_rows, wire.columns)`` with ``args.in_own >= 0``) into ``send`` (and ``own_out``
    fp32 ``(1, wire.columns)`` with ``args.own >= 0``)."""
    check_hop_own(args, wire, recv.device, errors, own_in, own_out)
    for i, (error, offset) in enumerate(zip(errors, wire.offsets())):
        in_data, in_scale = in_wire.views(recv, i, offset)
        requantize_(in_data, in_scale, error, args, *wire.views(send, i, offset), stats,
                    _own_columns(own_in, wire, i, offset), _own_columns(own_out, wire, i, offset))


def final_mean_bucket(recv: torch.Tensor, wire: WireLayout, args: MeanArgs, numels: Sequence[int], rank: int,
                      out_dtype: torch.dtype, stats: Optional[torch.Tensor] = None,
                      own_in: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
    """The last hop's received rows to this rank's mean partitions: :func:`final_mean` per parameter (with
    ``args.in_own >= 0``, ``own_in`` fp32 ``(1, wire.columns)`` in place of received row ``in_own``)."""
    check_mean_own(args, wire, recv, own_in)
    return [
        final_mean(*wire.views(recv, i, offset), args, numel, rank, out_dtype, stats,
                   _own_columns(own_in, wire, i, offset))
        for i, (numel, offset) in enumerate(zip(numels, wire.offsets()))
    ]


def gather_sample(tensors: Sequence[torch.Tensor], owners: torch.Tensor, coords: torch.Tensor,
                  scales: torch.Tensor) -> torch.Tensor:
    """The live rho's shared sample of many tensors (one float dtype and device): fp32 ``(n,)`` on their device,
    ``out[i] = scales[owners[i]] * float(tensors[owners[i]].flatten()[coords[i]])``, 0 where ``coords[i]`` is -1.
    ``owners`` int32 ``(n,)``, ``coords`` int64 ``(n,)``, ``scales`` fp32 ``(len(tensors),)``, all on the CPU."""
    device = tensors[0].device
    out = torch.zeros(coords.numel(), dtype=torch.float32, device=device)
    kept = (coords >= 0).nonzero().squeeze(1)
    kept_owners = owners[kept]
    for k, tensor in enumerate(tensors):
        rows = kept[kept_owners == k]
        if rows.numel():
            out[rows.to(device)] = tensor.reshape(-1)[coords[rows].to(device)].float()
    return out * scales.to(device)[owners.long().to(device)]
