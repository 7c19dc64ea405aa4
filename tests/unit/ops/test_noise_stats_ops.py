"""The ops' optional noise-statistics output (``stats``, the live rho's per-rank sums).

* opcheck of every op with ``stats`` (schema, fake implementation, the declared mutation);
* the sums (float64, as the ops take them) equal a direct fp64 computation from the op's own inputs and outputs:
  ``||x||^2`` of the hop's input, ``||c - deq||^2`` with ``c`` the compensated (rotated) values and ``deq`` the wire's
  dequantized values, and ``||mean||^2`` of the final mean; the ops' other outputs are the same bits with and without
  ``stats``; they build up in float64;
* on CUDA (skipped here; run on the device machine) the fused kernels' sums against the CPU reference's.
"""
import pytest
import torch

from deepspeed_loco.layout import WireLayout, padded_partition_size, slot_to_row
from deepspeed_loco.ops import loco_reference as ref
from deepspeed_loco.ops.error_buffer import ErrorBuffer
from deepspeed_loco.ops.hadamard import rotate
from deepspeed_loco.ops.quantizer import dequantize_groups, unpack

NUMELS = (300, 17, 64, 1000)
GROUP = 32
WORLD, LOCAL = 4, 2
CUDA = pytest.mark.gpu  # the fused LoCo kernels
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


@pytest.fixture(params=DEVICES)
def device(request):
    if request.param == "cuda":
        from deepspeed_loco.ops import loco_cuda
        loco_cuda.load()
    return request.param


def _widths():
    return tuple(padded_partition_size(n, WORLD, GROUP) for n in NUMELS)


def _errors(rows, error_bits, gen):
    """CPU error lists ``(values, scales)`` holding non-zero remembered errors (empty for ``error_bits`` 0)."""
    if error_bits == 0:
        return [], []
    buffers = [ErrorBuffer.zeros(rows, w, GROUP, error_bits, "cpu") for w in _widths()]
    for b in buffers:
        b.store_(torch.randn(rows, b.values.shape[1], generator=gen) * 0.1)
    return [b.values for b in buffers], [b.scale for b in buffers if b.scale is not None]


def _old_errors(values, scales, rows):
    """The remembered errors as fp32 ``(rows, P')`` per parameter (zeros without error feedback)."""
    if not values:
        return [torch.zeros(rows, w, dtype=torch.float64) for w in _widths()]
    scales = scales or [None] * len(values)
    return [ErrorBuffer(v.cpu(), s if s is None else s.cpu(), GROUP).dequantize().double() for v, s in
            zip(values, scales)]


def _wire_values(buffer, wire, grid):
    """fp64 ``(rows, P')`` per parameter: the dequantized values on the wire."""
    out = []
    for i, offset in enumerate(wire.offsets()):
        data, scale = wire.views(buffer.cpu(), i, offset)
        out.append(dequantize_groups(unpack(data, wire.bits), scale, GROUP, grid).double())
    return out


def _on(device, tensors):
    """Copies of ``tensors`` on ``device`` (the ops update error buffers in place; the test keeps the originals)."""
    return [t.to(device, copy=True) for t in tensors]


def _hop1(device, error_bits, hadamard, grid, stats, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(n, generator=gen).to(dtype) for n in NUMELS]
    values, scales = _errors(WORLD, error_bits, gen)
    wire = WireLayout(_widths(), 4, GROUP)
    send = wire.empty(WORLD, device).zero_()
    dv, ds = _on(device, values), _on(device, scales)
    torch.ops.deepspeed_loco.quantize_bucket(_on(device, grads), dv, ds, send, WORLD, LOCAL, 4, GROUP, 0.8, hadamard,
                                             grid, stats, -1, None)
    return grads, (values, scales), (dv, ds), send, wire


@pytest.mark.parametrize("error_bits", [0, 8, 32])
@pytest.mark.parametrize("hadamard,grid", [(False, "symmetric"), (True, "midrise"), (False, "midrise")])
def test_hop1_stats_are_the_input_power_and_the_quantizers_error_power(device, error_bits, hadamard, grid):
    stats = torch.full((2, ), 0.25, dtype=torch.float64, device=device)  # the op adds to what is there
    grads, (values, scales), _, send, wire = _hop1(device, error_bits, hadamard, grid, stats)
    old = _old_errors(values, scales, WORLD)
    rows = [ref.partition_rows(g, WORLD, GROUP)[slot_to_row(WORLD, LOCAL)] for g in grads]
    compensated = [(rotate(r, GROUP) if hadamard else r).double() + e for r, e in zip(rows, old)]
    error = sum(float((c - d).pow(2).sum()) for c, d in zip(compensated, _wire_values(send, wire, grid)))
    got = stats.cpu().tolist()
    assert got[0] - 0.25 == pytest.approx(sum(float(g.double().pow(2).sum()) for g in grads), rel=1e-5)
    assert got[1] - 0.25 == pytest.approx(error, rel=1e-4)


@pytest.mark.parametrize("error_bits", [0, 8])
def test_stats_change_no_other_output(device, error_bits):
    with_stats = _hop1(device, error_bits, True, "midrise", torch.zeros(2, dtype=torch.float64, device=device))
    without = _hop1(device, error_bits, True, "midrise", None)
    assert torch.equal(with_stats[3], without[3])
    assert all(torch.equal(a, b) for a, b in zip(with_stats[2][0] + with_stats[2][1], without[2][0] + without[2][1]))


@pytest.mark.parametrize("error_bits", [0, 8, 32])
@pytest.mark.parametrize("grid", ["symmetric", "midrise"])
def test_requantize_stats_are_the_summed_input_power_and_the_error_power(device, error_bits, grid):
    gen = torch.Generator().manual_seed(5)
    nodes = WORLD // LOCAL
    in_wire, wire = WireLayout(_widths(), 4, GROUP), WireLayout(_widths(), 2, GROUP)
    recv = torch.randint(0, 256, (LOCAL * nodes, in_wire.row_bytes), dtype=torch.uint8, generator=gen)
    recv[:, in_wire.data_bytes:].view(torch.float32).copy_(torch.rand(LOCAL * nodes, in_wire.columns // GROUP,
                                                                      generator=gen) * 0.01 + 1e-3)
    values, scales = _errors(nodes, error_bits, gen)
    old = _old_errors(values, scales, nodes)
    send, stats = wire.empty(nodes, device).zero_(), torch.zeros(2, dtype=torch.float64, device=device)
    torch.ops.deepspeed_loco.requantize_bucket(recv.to(device), _on(device, values), _on(device, scales), send,
                                               list(_widths()), WORLD, LOCAL, 2, 4, LOCAL, GROUP, 0.5, grid, stats,
                                               None, -1, -1, None)
    sums = [v.view(LOCAL, nodes, -1).sum(0) for v in _wire_values(recv, in_wire, grid)]
    error = sum(float((s + e - d).pow(2).sum()) for s, e, d in zip(sums, old, _wire_values(send, wire, grid)))
    got = stats.cpu().tolist()
    assert got[0] == pytest.approx(sum(float(s.pow(2).sum()) for s in sums), rel=1e-5)
    assert got[1] == pytest.approx(error, rel=1e-4)


@pytest.mark.parametrize("hadamard,grid", [(False, "symmetric"), (True, "midrise")])
def test_final_mean_stats_are_the_power_of_the_returned_mean(device, hadamard, grid):
    gen = torch.Generator().manual_seed(9)
    wire = WireLayout(_widths(), 8, GROUP)
    recv = torch.randint(0, 256, (WORLD, wire.row_bytes), dtype=torch.uint8, generator=gen)
    recv[:, wire.data_bytes:].view(torch.float32).copy_(torch.rand(WORLD, wire.columns // GROUP, generator=gen))
    stats = torch.zeros(1, dtype=torch.float64, device=device)
    mean = torch.ops.deepspeed_loco.final_mean_bucket(recv.to(device), list(NUMELS), WORLD, 8, GROUP, hadamard, grid,
                                                      3, torch.float32, stats, None, -1)
    assert stats.item() == pytest.approx(float(mean.double().pow(2).sum()), rel=1e-5)


def test_stats_build_up_in_float64(device):
    """Added to 2^27, the sums come out as the same op's sums from zero, bit for bit: the op adds in float64 (its fp32
    partial sums of a few hundred are exact there; in fp32 the sums would lose their last 16 bits)."""
    start = float(2 ** 27)
    big = torch.full((2, ), start, dtype=torch.float64, device=device)
    small = torch.zeros(2, dtype=torch.float64, device=device)
    _hop1(device, 8, False, "symmetric", big)
    _hop1(device, 8, False, "symmetric", small)
    assert small.min() > 1 and torch.equal(big - start, small)


def test_stats_of_another_dtype_or_shape_are_refused(device):
    for stats in (torch.zeros(2, device=device), torch.zeros(3, dtype=torch.float64, device=device)):
        with pytest.raises(RuntimeError, match=r"stats must be float64 \(2,\)"):
            _hop1(device, 0, False, "symmetric", stats)


def test_opcheck_with_stats(device):
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(n, generator=gen).to(device) for n in NUMELS]
    values, scales = _errors(WORLD, 8, gen)
    wire = WireLayout(_widths(), 4, GROUP)
    torch.library.opcheck(torch.ops.deepspeed_loco.quantize_bucket.default,
                          (grads, _on(device, values), _on(device, scales), wire.empty(WORLD, device).zero_(), WORLD,
                           LOCAL, 4, GROUP, 0.8, False, "symmetric",
                           torch.zeros(2, dtype=torch.float64, device=device), -1, None))
    recv = wire.empty(WORLD, device).zero_()
    torch.library.opcheck(torch.ops.deepspeed_loco.final_mean_bucket.default,
                          (recv, list(NUMELS), WORLD, 4, GROUP, False, "symmetric", 1, torch.float32,
                           torch.zeros(1, dtype=torch.float64, device=device), None, -1))
    nodes = WORLD // LOCAL
    values, scales = _errors(nodes, 32, gen)
    torch.library.opcheck(torch.ops.deepspeed_loco.requantize_bucket.default,
                          (wire.empty(WORLD, device).zero_(), _on(device, values), [],
                           WireLayout(_widths(), 2, GROUP).empty(nodes, device).zero_(), list(_widths()), WORLD, LOCAL,
                           2, 4, LOCAL, GROUP, 0.5, "midrise",
                           torch.zeros(2, dtype=torch.float64, device=device), None, -1, -1, None))


@CUDA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("error_bits,hadamard,grid", [(0, False, "symmetric"), (8, True, "midrise"),
                                                      (32, False, "midrise")])
def test_cuda_stats_match_the_cpu_reference(dtype, error_bits, hadamard, grid):
    from deepspeed_loco.ops import loco_cuda
    loco_cuda.load()
    sums = {}
    for device in ("cpu", "cuda"):
        stats = torch.zeros(2, dtype=torch.float64, device=device)
        _hop1(device, error_bits, hadamard, grid, stats, seed=3, dtype=dtype)
        sums[device] = stats.cpu()
    torch.testing.assert_close(sums["cuda"], sums["cpu"], rtol=1e-5, atol=0)
