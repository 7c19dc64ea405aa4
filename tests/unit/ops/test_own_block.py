"""The exact own block in the reference and the ops (``loco_reference``'s docstring, "Exact own block").

* Hop 1 with ``own``: the other slots' bytes and error rows are the ones the hop makes without an own block (their
  quantization is row by row), the own slots are zeros on the wire and exact (rotated with ``hadamard``) in
  ``own_out``, and the error buffer has those rows less.
* Hop 2 and the final mean with ``in_own``: the received own block is not read; the other blocks are summed in block
  order and ``own_in`` is added last; hop 2's ``own`` row goes exactly to ``own_out``.
* The statistics: the input's power over every row, the quantizer's error power over the quantized rows only.
* The entry points (the reference's and the ops') refuse own buffers that do not fit, naming them and the shape.
* ``torch.library.opcheck`` of the ops with the own arguments, and the ops' bytes equal to the reference's.
"""
import pytest
import torch

from deepspeed_loco.layout import HopArgs, MeanArgs, WireLayout, padded_partition_size, slot_to_row
from deepspeed_loco.ops import library
from deepspeed_loco.ops import loco_reference as ref
from deepspeed_loco.ops.error_buffer import ErrorBuffer
from deepspeed_loco.ops.hadamard import rotate, unrotate
from deepspeed_loco.ops.quantizer import dequantize_groups, pack, unpack

NUMELS = (300, 17, 64)
GROUP = 32
OPS = library.CUDA  # the ops' entry points (on CPU tensors the ops run the reference)


def _widths(world):
    return tuple(padded_partition_size(n, world, GROUP) for n in NUMELS)


def _grads(seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen) for n in NUMELS]


def _errors(rows, widths, error_bits, seed):
    """Error buffers with non-zero remembered errors (None per parameter without error feedback)."""
    if not error_bits:
        return [None] * len(widths)
    gen = torch.Generator().manual_seed(seed)
    buffers = [ErrorBuffer.zeros(rows, w, GROUP, error_bits, "cpu") for w in widths]
    for b in buffers:
        b.store_(torch.randn(rows, b.values.shape[1], generator=gen) * 0.1)
    return buffers


def _rows(buffers, keep):
    """Copies of ``buffers`` holding only the rows ``keep`` (the error rows of the same slots)."""
    return [b and ErrorBuffer(b.values[keep].clone(), None if b.scale is None else b.scale[keep].clone(), GROUP)
            for b in buffers]


def _recv(rows, wire, seed):
    """A received buffer of random codes with finite positive fp32 scales."""
    gen = torch.Generator().manual_seed(seed)
    recv = torch.randint(0, 256, (rows, wire.row_bytes), dtype=torch.uint8, generator=gen)
    recv[:, wire.data_bytes:].view(torch.float32).copy_(torch.rand(rows, wire.columns // GROUP, generator=gen) + 0.01)
    return recv


def _dequantized(recv, wire, grid):
    """Per parameter, the fp32 values of every received row (columns of the bucket in parameter order)."""
    out = []
    for i, offset in enumerate(wire.offsets()):
        data, scale = wire.views(recv, i, offset)
        out.append(dequantize_groups(unpack(data, wire.bits), scale, GROUP, grid))
    return torch.cat(out, dim=1)


def _sum_in_order(blocks, own_in):
    """The spec's order: the blocks (the own one left out) first as is, then one fp32 add each, then ``own_in``."""
    total = blocks[0].clone()
    for block in blocks[1:]:
        total += block
    total += own_in
    return total


@pytest.mark.parametrize("world,local", [(4, 2), (8, 4), (4, 1)])
@pytest.mark.parametrize("error_bits", [0, 8, 32])
@pytest.mark.parametrize("hadamard,grid", [(False, "symmetric"), (True, "midrise")])
def test_hop1_keeps_the_own_slots_exact_and_quantizes_the_others_as_without_them(world, local, error_bits, hadamard,
                                                                               grid):
    widths = _widths(world)
    wire = WireLayout(widths, 4, GROUP)
    plain = HopArgs(world, local, 4, GROUP, 0.8, hadamard, grid)
    kept, peers = plain.kept_rows, plain.peers
    assert (kept, peers) == ((world // local, local) if local > 1 else (1, world))
    grads = _grads(world + local)
    for own in range(peers):
        args = HopArgs(world, local, 4, GROUP, 0.8, hadamard, grid, own=own)
        own_slots = list(range(own * kept, (own + 1) * kept))
        others = [s for s in range(world) if s not in own_slots]
        full = _errors(world, widths, error_bits, seed=own)
        lean = _rows(full, others)
        send_full, send = wire.empty(world, "cpu"), wire.empty(world, "cpu").fill_(7)
        own_out = torch.full((kept, wire.columns), float("nan"))
        ref.quantize_bucket_(grads, full, plain, wire, send_full)
        ref.quantize_bucket_(grads, lean, args, wire, send, None, own_out)
        assert torch.equal(send[others], send_full[others])
        assert not send[own_slots].any()  # the own slots: zero bytes, zero scales
        for got, want in zip(lean, _rows(full, others)):
            assert got is None or (torch.equal(got.values, want.values)
                                   and (got.scale is None or torch.equal(got.scale, want.scale)))
        exact = []
        for grad in grads:
            rows = ref.partition_rows(grad, world, GROUP)[slot_to_row(world, local)]
            exact.append((rotate(rows, GROUP) if hadamard else rows)[own_slots])
        assert torch.equal(own_out, torch.cat(exact, dim=1))


@pytest.mark.parametrize("world,local", [(8, 4), (4, 2)])
@pytest.mark.parametrize("error_bits", [0, 8])
@pytest.mark.parametrize("grid", ["symmetric", "midrise"])
def test_hop2_adds_own_in_last_in_place_of_the_own_block_and_keeps_its_own_row_exact(world, local, error_bits, grid):
    nodes = world // local
    widths = _widths(world)
    in_wire, wire = WireLayout(widths, 4, GROUP), WireLayout(widths, 2, GROUP)
    gen = torch.Generator().manual_seed(1)
    for rank in range(world):
        d, n = rank % local, rank // local
        args = HopArgs(world, local, 2, GROUP, 0.5, False, grid, 4, local, own=n, in_own=d)
        assert (args.kept_rows, args.peers, args.in_kept_rows) == (1, nodes, nodes)
        recv = _recv(local * nodes, in_wire, seed=rank)
        own_in = torch.randn(nodes, wire.columns, generator=gen)
        errors = _errors(nodes - 1, widths, error_bits, seed=rank)
        initial = _rows(errors, list(range(nodes - 1)))
        send, own_out = wire.empty(nodes, "cpu"), torch.empty(1, wire.columns)
        ref.requantize_bucket_(recv, in_wire, errors, args, wire, send, None, own_in, own_out)

        values = _dequantized(recv, in_wire, grid).view(local, nodes, -1)
        total = _sum_in_order([values[j] for j in range(local) if j != d], own_in)
        assert torch.equal(own_out, total[n:n + 1])  # exact, bit for bit in the spec's order
        assert not send[n].any()
        # the other rows: compensated with their error rows (row m is error row m, or m - 1 after the own row),
        # quantized and packed as the hop does any row
        others = [m for m in range(nodes) if m != n]
        want, updated = wire.empty(nodes, "cpu").zero_(), _rows(initial, list(range(nodes - 1)))
        for i, offset in enumerate(wire.offsets()):
            q, scale = ref.compensate_and_quantize(total[others][:, offset:offset + widths[i]], updated[i], 0.5, 2,
                                                   GROUP, grid)
            data, scales = wire.views(want, i, offset)
            data[others], scales[others] = pack(q, 2), scale
        assert torch.equal(send, want)
        assert all(e is None or torch.equal(e.dequantize(), u.dequantize()) for e, u in zip(errors, updated))

        garbage = recv.clone()  # the own block's bytes are not read, whatever they hold
        garbage[d * nodes:(d + 1) * nodes] = 0xFF
        again, again_out = wire.empty(nodes, "cpu"), torch.empty(1, wire.columns)
        ref.requantize_bucket_(garbage, in_wire, _rows(initial, list(range(nodes - 1))), args, wire, again, None,
                               own_in, again_out)
        assert torch.equal(again, send) and torch.equal(again_out, own_out)


@pytest.mark.parametrize("hadamard,grid", [(False, "symmetric"), (True, "midrise")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_final_mean_adds_own_in_last_in_place_of_the_own_row(hadamard, grid, dtype):
    world, rows, rank = 8, 4, 5
    wire = WireLayout(_widths(world), 4, GROUP)
    recv = _recv(rows, wire, seed=3)
    own_in = torch.randn(1, wire.columns, generator=torch.Generator().manual_seed(4))
    for in_own in range(rows):
        args = MeanArgs(world, 4, GROUP, hadamard, grid, in_own=in_own)
        got = ref.final_mean_bucket(recv, wire, args, NUMELS, rank, dtype, None, own_in)
        values = _dequantized(recv, wire, grid)
        total = _sum_in_order([values[j] for j in range(rows) if j != in_own], own_in[0])
        garbage = recv.clone()
        garbage[in_own] = 0xFF  # NaN scales: not read
        assert all(torch.equal(a, b) for a, b in zip(
            got, ref.final_mean_bucket(garbage, wire, args, NUMELS, rank, dtype, None, own_in)))
        for i, (numel, offset) in enumerate(zip(NUMELS, wire.offsets())):
            part = total[offset:offset + wire.widths[i]]
            part = unrotate(part, GROUP) if hadamard else part
            size = -(-numel // world)
            want = part[:size] / torch.full((size, ), float(world))
            want[max(0, min(size, numel - rank * size)):] = 0
            assert torch.equal(got[i], want.to(dtype))


def test_a_final_mean_of_zero_other_rows_is_own_in_over_w_exactly():
    """Every other block zero (quantized zeros are exact zeros): the mean is the exact own row over ``W``."""
    world, rows = 4, 2
    wire = WireLayout(_widths(world), 2, GROUP)
    recv = wire.empty(rows, "cpu").zero_()
    own_in = torch.randn(1, wire.columns, generator=torch.Generator().manual_seed(5))
    means = ref.final_mean_bucket(recv, wire, MeanArgs(world, 2, GROUP, in_own=1), NUMELS, 0, torch.float32, None,
                                  own_in)
    for mean, offset, numel in zip(means, wire.offsets(), NUMELS):
        size = mean.numel()
        assert torch.equal(mean, own_in[0, offset:offset + size] / world)


@pytest.mark.parametrize("error_bits", [0, 8])
@pytest.mark.parametrize("hadamard", [False, True])
def test_stats_count_every_row_as_input_and_the_quantized_rows_only_as_error(error_bits, hadamard):
    world, local = 4, 2
    widths = _widths(world)
    wire = WireLayout(widths, 4, GROUP)
    grads = _grads(9)
    full = _errors(world, widths, error_bits, seed=2)
    own, kept = 1, world // local
    others = [s for s in range(world) if s // kept != own]
    plain_stats, own_stats = torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
    send_full = wire.empty(world, "cpu")
    old = [e and e.dequantize() for e in full]
    ref.quantize_bucket_(grads, _rows(full, list(range(world))), HopArgs(world, local, 4, GROUP, 0.8, hadamard), wire,
                         send_full, plain_stats)
    ref.quantize_bucket_(grads, _rows(full, others), HopArgs(world, local, 4, GROUP, 0.8, hadamard, own=own), wire,
                         wire.empty(world, "cpu"), own_stats, torch.empty(kept, wire.columns))
    assert own_stats[0] == plain_stats[0]  # the gradient's power, own rows included
    # the quantizer's error on the own slots, which the exact own block does not make
    values = _dequantized(send_full, wire, "symmetric")
    rows = torch.cat([ref.partition_rows(g, world, GROUP)[slot_to_row(world, local)] for g in grads], dim=1)
    rows = rotate(rows, GROUP) if hadamard else rows
    compensated = rows + (torch.cat(old, dim=1) if error_bits else 0)
    own_error = float((compensated - values)[own * kept:(own + 1) * kept].double().pow(2).sum())
    assert float(own_stats[1]) == pytest.approx(float(plain_stats[1]) - own_error, rel=1e-4)
    assert 0 < own_error < float(plain_stats[1])


# ----------------------------------------------------------------------------------------------- the entry points
def _hop1_call(entry, own, own_out):
    wire = WireLayout(_widths(4), 4, GROUP)
    entry.quantize_bucket_(_grads(0), [None] * 3, HopArgs(4, 2, 4, GROUP, 0.8, own=own), wire, wire.empty(4, "cpu"),
                           None, own_out)


def _hop2_call(entry, in_own, own_in, own=-1, own_out=None):
    world, local = 4, 2
    widths = _widths(world)
    in_wire, wire = WireLayout(widths, 4, GROUP), WireLayout(widths, 2, GROUP)
    entry.requantize_bucket_(_recv(4, in_wire, 0), in_wire, [None] * 3,
                             HopArgs(world, local, 2, GROUP, 0.8, in_bits=4, in_blocks=local, own=own, in_own=in_own),
                             wire, wire.empty(2, "cpu"), None, own_in, own_out)


def _final_call(entry, in_own, own_in, rows=2):
    wire = WireLayout(_widths(4), 2, GROUP)
    entry.final_mean_bucket(_recv(rows, wire, 0), wire, MeanArgs(4, 2, GROUP, in_own=in_own), NUMELS, 0,
                            torch.float32, None, own_in)


COLUMNS = sum(_widths(4))
BAD_OWN = [  # (the call, the message it must raise)
    (lambda e: _hop1_call(e, 1, None), rf"own = 1 needs own_out, fp32 of shape \(2, {COLUMNS}\); got None"),
    (lambda e: _hop1_call(e, 1, torch.zeros(1, COLUMNS)),
     rf"own_out must be a contiguous fp32 tensor of shape \(2, {COLUMNS}\) on cpu \(own = 1\), got torch.float32 "
     rf"\(1, {COLUMNS}\) on cpu"),
    (lambda e: _hop1_call(e, 0, torch.zeros(2, COLUMNS, dtype=torch.float64)),
     rf"own_out must be a contiguous fp32 tensor of shape \(2, {COLUMNS}\) on cpu \(own = 0\), got torch.float64"),
    (lambda e: _hop1_call(e, 0, torch.zeros(COLUMNS, 2).t()), r"own_out must be .*, not contiguous"),
    (lambda e: _hop1_call(e, -1, torch.zeros(2, COLUMNS)), r"own_out must be None when own is -1"),
    (lambda e: _hop1_call(e, 2, torch.zeros(2, COLUMNS)), r"own = 2 must be -1 or a block index in \[0, 2\)"),
    (lambda e: _hop2_call(e, 1, torch.zeros(1, COLUMNS)),
     rf"own_in must be a contiguous fp32 tensor of shape \(2, {COLUMNS}\) on cpu \(in_own = 1\)"),
    (lambda e: _hop2_call(e, 0, None), rf"in_own = 0 needs own_in, fp32 of shape \(2, {COLUMNS}\)"),
    (lambda e: _hop2_call(e, -1, torch.zeros(2, COLUMNS)), r"own_in must be None when in_own is -1"),
    (lambda e: _hop2_call(e, -1, None, own=0, own_out=torch.zeros(2, COLUMNS)),
     rf"own_out must be a contiguous fp32 tensor of shape \(1, {COLUMNS}\) on cpu \(own = 0\)"),
    (lambda e: _final_call(e, 1, torch.zeros(2, COLUMNS)),
     rf"own_in must be a contiguous fp32 tensor of shape \(1, {COLUMNS}\) on cpu \(in_own = 1\)"),
    (lambda e: _final_call(e, 2, torch.zeros(1, COLUMNS)), r"in_own = 2 must be -1 or a block index in \[0, 2\)"),
    (lambda e: _final_call(e, 0, torch.zeros(1, COLUMNS), rows=1),
     r"in_own = 0 needs at least 2 blocks, its own and another, got 1"),
]


def _errors_call(entry, own, rows):
    wire = WireLayout(_widths(4), 4, GROUP)
    entry.quantize_bucket_(_grads(0), _errors(rows, wire.widths, 8, 0), HopArgs(4, 2, 4, GROUP, 0.8, own=own), wire,
                           wire.empty(4, "cpu"), None, torch.zeros(2, COLUMNS) if own >= 0 else None)


BAD_OWN += [
    (lambda e: _errors_call(e, 1, 4), r"this hop's error buffers must have 2 rows \(4 partition rows, less the 2 of "
                                      r"own block 1\), got \[4, 4, 4\]"),
    (lambda e: _errors_call(e, -1, 2), r"this hop's error buffers must have 4 rows \(4 partition rows\), got "
                                       r"\[2, 2, 2\]"),
]


@pytest.mark.parametrize("entry", [ref, OPS], ids=["reference", "ops"])
@pytest.mark.parametrize("call,message", BAD_OWN)
def test_entry_points_refuse_own_buffers_that_do_not_fit_naming_them(entry, call, message):
    with pytest.raises(ValueError, match="LoCo ops: " + message):
        call(entry)


def test_own_buffers_of_the_right_shape_are_taken():
    for entry in (ref, OPS):
        _hop1_call(entry, 1, torch.zeros(2, COLUMNS))
        _hop2_call(entry, 1, torch.zeros(2, COLUMNS), own=1, own_out=torch.zeros(1, COLUMNS))
        _final_call(entry, 0, torch.zeros(1, COLUMNS))


def _opcheck_quantize_bucket():
    world, local, nodes = 4, 2, 2
    widths = _widths(world)
    wire = WireLayout(widths, 4, GROUP)
    values = [torch.zeros(world - nodes, w) for w in widths]  # fp32 errors, the own slots' rows left out
    return (torch.ops.deepspeed_loco.quantize_bucket.default,
            (_grads(1), values, [], wire.empty(world, "cpu").zero_(), world, local, 4, GROUP, 0.8, False, "symmetric",
             None, 1, torch.zeros(nodes, wire.columns)))


def _opcheck_requantize_bucket():
    world, local, nodes = 4, 2, 2
    widths = _widths(world)
    wire, wire2 = WireLayout(widths, 4, GROUP), WireLayout(widths, 2, GROUP)
    return (torch.ops.deepspeed_loco.requantize_bucket.default,
            (_recv(world, wire, 2), [torch.zeros(nodes - 1, w) for w in widths], [], wire2.empty(nodes, "cpu").zero_(),
             list(widths), world, local, 2, 4, local, GROUP, 0.5, "midrise", None, torch.randn(nodes, wire.columns), 0,
             1, torch.zeros(1, wire.columns)))


def _opcheck_final_mean_bucket():
    wire = WireLayout(_widths(4), 2, GROUP)
    return (torch.ops.deepspeed_loco.final_mean_bucket.default,
            (_recv(2, wire, 3), list(NUMELS), 4, 2, GROUP, True, "midrise", 3, torch.bfloat16, None,
             torch.randn(1, wire.columns), 1))


@pytest.mark.parametrize("case", [_opcheck_quantize_bucket, _opcheck_requantize_bucket, _opcheck_final_mean_bucket],
                         ids=["quantize_bucket", "requantize_bucket", "final_mean_bucket"])
def test_opcheck_of_the_ops_with_own_blocks(case):
    torch.library.opcheck(*case())


@pytest.mark.parametrize("error_bits", [0, 8])
def test_the_ops_give_the_reference_bytes_with_own_blocks(error_bits):
    """Hop 1, hop 2 and the final mean of rank 3 of 2 x 2 (exchanges replaced by the identity) through the ops'
    entry points and through the reference's: the same wire bytes, own buffers, error buffers and means."""
    world, local, nodes, rank = 4, 2, 2, 3
    widths = _widths(world)
    wire1, wire2 = WireLayout(widths, 4, GROUP), WireLayout(widths, 2, GROUP)
    args1 = HopArgs(world, local, 4, GROUP, 0.8, grid="midrise", own=rank % local)
    args2 = HopArgs(world, local, 2, GROUP, 0.8, grid="midrise", in_bits=4, in_blocks=local, own=rank // local,
                    in_own=rank % local)
    results = []
    for entry in (OPS, ref):
        errors1 = _errors(world - nodes, widths, error_bits, seed=1)
        errors2 = _errors(nodes - 1, widths, error_bits, seed=2)
        send1, send2 = wire1.empty(world, "cpu"), wire2.empty(nodes, "cpu")
        own1, own2 = torch.empty(nodes, wire1.columns), torch.empty(1, wire1.columns)
        entry.quantize_bucket_(_grads(7), errors1, args1, wire1, send1, None, own1)
        entry.requantize_bucket_(send1, wire1, errors2, args2, wire2, send2, None, own1, own2)
        means = entry.final_mean_bucket(send2, wire2, args2.mean(), NUMELS, rank, torch.float32, None, own2)
        errors = [t for e in errors1 + errors2 if e is not None for t in (e.values, e.scale) if t is not None]
        results.append([send1, own1, send2, own2] + list(means) + errors)
    assert args2.mean().in_own == rank // local
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
