"""The fused CUDA kernels (``deepspeed_loco.ops.loco_cuda``) against the reference (``loco_reference``).

The reference runs on CPU copies of the inputs: that is the contract (IEEE fp32 in a fixed order). On CUDA tensors
PyTorch computes ``tensor / python_scalar`` as a multiplication by the reciprocal, so the reference evaluated on the
GPU can differ from itself on the CPU by one ulp in a scale; the kernels follow the CPU. Integer outputs (packed
data, int8 error) and fp32 scales / fp32 error must be bit-identical; final outputs too, except that NaN payloads
of fp16/bf16 outputs are compared as "is NaN".

Every test draws fresh random inputs (the seed is in each failure message) and poisons every output first.
Skipped without a CUDA device; with one, the op must build (a build failure fails the tests).
"""
import itertools
import secrets

import pytest
import torch

from deepspeed_loco.ops import loco_reference as ref
from deepspeed_loco.ops.error_buffer import ErrorBuffer
from deepspeed_loco.layout.wire import WireLayout

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (fused LoCo kernels)")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
LAYOUTS = [(4, 2), (6, 2), (4, 4), (4, 1)]  # (W, L)
BITS = [2, 3, 4, 8]
GROUPS = [32, 256, 4096]
SHAPES = [(7,), (33, 5), (1000, 3)]
ERRORS = [(None, 0.8), (8, 0.0), (8, 0.8), (32, 0.0), (32, 0.8)]  # (error_bits, beta)
HADAMARD_GROUPS = [32, 256, 512, 1024, 4096]  # teams of 2, 16, 32 (one warp), 64 and 256 threads


@pytest.fixture(scope="module")
def cuda():
    """The loco_cuda module with its op loaded (builds it the first time)."""
    from deepspeed_loco.ops import loco_cuda
    loco_cuda.load()
    return loco_cuda


def _generator():
    seed = secrets.randbits(48)
    return torch.Generator().manual_seed(seed), seed


def _values(numel, gen, block=32):
    """fp32 values with magnitudes spread over 1e-3 .. 1e3 per block of ``block``, and a zeroed stretch."""
    x = torch.randn(numel, generator=gen)
    mags = 10.0 ** (torch.rand(-(-numel // block), generator=gen) * 6 - 3)
    x *= mags.repeat_interleave(block)[:numel]
    if numel > 64:
        start = int(torch.randint(0, numel - 64, (1,), generator=gen))
        x[start:start + 64] = 0
    return x


def _error_buffer(rows, cols, group_size, error_bits, gen):
    """A CPU error buffer holding a random, stored (so representable) error; None for ``error_bits`` None."""
    if error_bits is None:
        return None
    buffer = ErrorBuffer.zeros(rows, cols, group_size, error_bits, "cpu")
    buffer.store_(_values(rows * cols, gen).view(rows, cols) * 0.1)
    return buffer


def _to_cuda(buffer):
    if buffer is None:
        return None
    scale = None if buffer.scale is None else buffer.scale.cuda()
    return ErrorBuffer(buffer.values.cuda(), scale, buffer.group_size)


def _poison(shape, dtype, device):
    raw = torch.randint(0, 256, (torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size(),),
                        dtype=torch.uint8)
    return raw.view(dtype).view(shape).to(device)


def _bits_equal(actual, expected, nan_payload=True):
    """Bitwise equality; ``nan_payload=False`` (final outputs) only asks NaN where the reference has NaN: a NaN
    made by arithmetic (NaN scale times a value) has no specified payload, and fp16/bf16 conversions differ."""
    actual = actual.cpu()
    if actual.dtype == torch.float32 and nan_payload:
        return torch.equal(actual.view(torch.int32), expected.view(torch.int32))
    if actual.dtype in (torch.float32, torch.float16, torch.bfloat16):
        ints = torch.int32 if actual.dtype == torch.float32 else torch.int16
        nan_a, nan_e = actual.isnan(), expected.isnan()
        same = actual.view(ints) == expected.view(ints)
        return torch.equal(nan_a, nan_e) and bool((same | nan_a).all())
    return torch.equal(actual, expected)


def _check_error(actual, expected, seed):
    if expected is None:
        return
    assert _bits_equal(actual.values, expected.values), f"error values differ (seed {seed})"
    if expected.scale is not None:
        assert _bits_equal(actual.scale, expected.scale), f"error scales differ (seed {seed})"


def _run_hop1(cuda, grad, world, local, error, beta, bits, group_size, seed, hadamard=False):
    """Runs kernel (on GPU) and reference (on CPU) and compares every output."""
    cols = ref.padded_partition_size(grad.numel(), world, group_size)
    data = _poison((world, cols * bits // 8), torch.uint8, "cuda")
    scale = _poison((world, cols // group_size), torch.float32, "cuda")
    gpu_error = _to_cuda(error)
    cuda.hop1_(grad.cuda(), world, local, gpu_error, beta, bits, group_size, data, scale, hadamard=hadamard)
    ref_data = torch.empty(world, cols * bits // 8, dtype=torch.uint8)
    ref_scale = torch.empty(world, cols // group_size)
    ref.hop1_(grad, world, local, error, beta, bits, group_size, ref_data, ref_scale, hadamard=hadamard)
    assert _bits_equal(data, ref_data), f"packed data differ (seed {seed})"
    assert _bits_equal(scale, ref_scale), f"scales differ (seed {seed})"
    _check_error(gpu_error, error, seed)


def _hop1_cases():
    """Unrotated: dtype x (W, L) x bits x error x group size, the shape cycling. Rotated (Hadamard): dtype x bits x
    error x group size of every team width (2 .. 256 threads), layouts and shapes cycling."""
    cases = []
    for i, (dtype, (world, local), bits, (error_bits, beta), group_size) in enumerate(
            itertools.product(DTYPES, LAYOUTS, BITS, ERRORS, GROUPS)):
        cases.append((dtype, world, local, bits, error_bits, beta, group_size, SHAPES[(i + i // 3) % len(SHAPES)],
                      False))
    for i, (dtype, bits, (error_bits, beta), group_size) in enumerate(
            itertools.product(DTYPES, BITS, ERRORS, HADAMARD_GROUPS)):
        world, local = LAYOUTS[i % len(LAYOUTS)]
        cases.append((dtype, world, local, bits, error_bits, beta, group_size, SHAPES[(i + i // 4) % len(SHAPES)],
                      True))
    return cases


@pytest.mark.parametrize("dtype,world,local,bits,error_bits,beta,group_size,shape,hadamard", _hop1_cases())
def test_hop1_matches_reference(cuda, dtype, world, local, bits, error_bits, beta, group_size, shape, hadamard):
    """Packed data, scales and error (in the rotated basis with Hadamard) identical to the reference."""
    gen, seed = _generator()
    numel = torch.Size(shape).numel()
    grad = _values(numel, gen).view(shape).to(dtype)
    cols = ref.padded_partition_size(numel, world, group_size)
    error = _error_buffer(world, cols, group_size, error_bits, gen)
    _run_hop1(cuda, grad, world, local, error, beta, bits, group_size, seed, hadamard=hadamard)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4099, 37), (1, 1 << 17)])
@pytest.mark.parametrize("hadamard,group_size", [(False, 256), (True, 256), (True, 2048)])
def test_hop1_larger_tensors_match_reference(cuda, dtype, shape, hadamard, group_size):
    """Many groups per row, vector loads on aligned rows ((1, 2^17): P divisible by 8) and scalar tails."""
    gen, seed = _generator()
    grad = _values(torch.Size(shape).numel(), gen).view(shape).to(dtype)
    cols = ref.padded_partition_size(grad.numel(), 8, group_size)
    _run_hop1(cuda, grad, 8, 4, _error_buffer(8, cols, group_size, 8, gen), 0.8, 4, group_size, seed,
              hadamard=hadamard)


def _recv(rows, cols, bits, group_size, gen):
    data = torch.randint(0, 256, (rows, cols * bits // 8), dtype=torch.uint8, generator=gen)
    scale = torch.rand(rows, cols // group_size, generator=gen) * 10.0 ** (torch.rand(rows, 1, generator=gen) * 4 - 2)
    scale[torch.rand(scale.shape, generator=gen) < 0.1] = 0
    return data, scale


def _run_hop2(cuda, recv_data, recv_scale, local, in_bits, error, beta, bits, group_size, seed):
    rows, cols = recv_data.shape[0] // local, recv_data.shape[1] * 8 // in_bits
    data = _poison((rows, cols * bits // 8), torch.uint8, "cuda")
    scale = _poison((rows, cols // group_size), torch.float32, "cuda")
    gpu_error = _to_cuda(error)
    cuda.hop2_(recv_data.cuda(), recv_scale.cuda(), local, in_bits, gpu_error, beta, bits, group_size, data, scale)
    ref_data = torch.empty(rows, cols * bits // 8, dtype=torch.uint8)
    ref_scale = torch.empty(rows, cols // group_size)
    ref.hop2_(recv_data, recv_scale, local, in_bits, error, beta, bits, group_size, ref_data, ref_scale)
    assert _bits_equal(data, ref_data), f"packed data differ (seed {seed})"
    assert _bits_equal(scale, ref_scale), f"scales differ (seed {seed})"
    _check_error(gpu_error, error, seed)


@pytest.mark.parametrize("world,local,in_bits,bits,error_bits,beta,group_size", [
    (world, local, in_bits, bits, error_bits, beta, GROUPS[i % len(GROUPS)])
    for i, ((world, local), in_bits, bits, (error_bits, beta)) in enumerate(itertools.product(LAYOUTS, BITS, BITS, ERRORS))
])
def test_hop2_matches_reference(cuda, world, local, in_bits, bits, error_bits, beta, group_size):
    gen, seed = _generator()
    nodes = world // local
    cols = group_size * int(torch.randint(1, 4, (1,), generator=gen))
    recv_data, recv_scale = _recv(local * nodes, cols, in_bits, group_size, gen)
    error = _error_buffer(nodes, cols, group_size, error_bits, gen)
    _run_hop2(cuda, recv_data, recv_scale, local, in_bits, error, beta, bits, group_size, seed)


FINAL_SIZES = [(7, 4, 0), (7, 4, 1), (7, 4, 3), (165, 6, 5), (3000, 6, 2), (1 << 16, 4, 3), (100003, 8, 7)]


@pytest.mark.parametrize("dtype,group_size,bits,numel,world,rank,rows", [
    (dtype, group_size, bits, numel, world, rank, 1 + i % 4)
    for i, (dtype, group_size, bits, (numel, world, rank)) in enumerate(itertools.product(DTYPES, GROUPS, BITS,
                                                                                           FINAL_SIZES))
])
def test_final_mean_matches_reference(cuda, dtype, group_size, bits, rows, numel, world, rank):
    gen, seed = _generator()
    cols = ref.padded_partition_size(numel, world, group_size)
    recv_data, recv_scale = _recv(rows, cols, bits, group_size, gen)
    out = cuda.final_mean(recv_data.cuda(), recv_scale.cuda(), bits, group_size, world, numel, rank, dtype)
    expected = ref.final_mean(recv_data, recv_scale, bits, group_size, world, numel, rank, dtype)
    assert out.dtype == dtype and out.shape == expected.shape and out.is_cuda
    assert _bits_equal(out, expected, nan_payload=False), f"final mean differs (seed {seed})"


@pytest.mark.parametrize("dtype,group_size,bits,numel,world,rank,rows", [
    (dtype, group_size, bits, numel, world, rank, 1 + i % 4)
    for i, (dtype, group_size, bits) in enumerate(itertools.product(DTYPES, HADAMARD_GROUPS, BITS))
    for numel, world, rank in [FINAL_SIZES[i % len(FINAL_SIZES)]]
])
def test_final_mean_with_hadamard_matches_reference(cuda, dtype, group_size, bits, rows, numel, world, rank):
    """The inverse rotation fused into the final kernel (team layout): same output as the reference."""
    gen, seed = _generator()
    cols = ref.padded_partition_size(numel, world, group_size)
    recv_data, recv_scale = _recv(rows, cols, bits, group_size, gen)
    out = cuda.final_mean(recv_data.cuda(), recv_scale.cuda(), bits, group_size, world, numel, rank, dtype,
                          hadamard=True)
    expected = ref.final_mean(recv_data, recv_scale, bits, group_size, world, numel, rank, dtype, hadamard=True)
    assert out.dtype == dtype and out.shape == expected.shape and out.is_cuda
    assert _bits_equal(out, expected, nan_payload=False), f"rotated final mean differs (seed {seed})"


@pytest.mark.parametrize("hadamard", [False, True])
@pytest.mark.parametrize("error_bits", [None, 8, 32])
@pytest.mark.parametrize("dtype", DTYPES)
def test_non_finite_inputs_match_reference(cuda, dtype, error_bits, hadamard):
    """inf / NaN gradients: NaN scale and q = 0 for their groups, their error groups stored as zero (with
    Hadamard, the rotation spreads them over their whole group first)."""
    gen, seed = _generator()
    grad = _values(4096 + 77, gen)
    grad[5] = float("inf")
    grad[700] = float("nan")
    grad[1500] = -float("inf")
    grad = grad.to(dtype)
    cols = ref.padded_partition_size(grad.numel(), 4, 32)
    _run_hop1(cuda, grad, 4, 2, _error_buffer(4, cols, 32, error_bits, gen), 0.8, 4, 32, seed, hadamard=hadamard)
    recv_data, recv_scale = _recv(4, 256, 4, 32, gen)
    recv_scale[1, 3] = float("nan")
    recv_scale[2, 5] = float("inf")
    _run_hop2(cuda, recv_data, recv_scale, 2, 4, _error_buffer(2, 256, 32, error_bits, gen), 0.8, 4, 32, seed)
    out = cuda.final_mean(recv_data.cuda(), recv_scale.cuda(), 4, 32, 4, 1000, 1, dtype, hadamard=hadamard)
    expected = ref.final_mean(recv_data, recv_scale, 4, 32, 4, 1000, 1, dtype, hadamard=hadamard)
    assert out.isnan().any() and _bits_equal(out, expected, nan_payload=False), f"final mean differs (seed {seed})"


@pytest.mark.parametrize("bits", BITS)
def test_ties_denormals_and_huge_groups_match_reference(cuda, bits):
    """Quotients exactly at and one ulp around half-integers (the kernels' exact-division fallback), groups whose
    scale is denormal or above 2^125 (exact division throughout); without error and with int8 error storage."""
    gen, seed = _generator()
    group_size, qmax, step = 256, (1 << (bits - 1)) - 1, 2.0 ** -3
    halves = ((torch.arange(-qmax, qmax, dtype=torch.float64) + 0.5) * step).float()
    group = torch.zeros(group_size)
    group[:halves.numel()] = halves
    near = torch.stack([group, torch.nextafter(group, torch.full_like(group, 1e9)),
                        torch.nextafter(group, torch.full_like(group, -1e9))])
    near[:, -1] = qmax * step  # absmax qmax * step in every group: scale = step exactly, quotients c / step
    tiny = _values(2 * group_size, gen) * 1e-40
    huge = _values(2 * group_size, gen).clamp(-3, 3) * 1e38
    grad = torch.cat([near.reshape(-1), tiny, huge, _values(group_size + 77, gen)])
    cols = ref.padded_partition_size(grad.numel(), 2, group_size)
    _run_hop1(cuda, grad, 2, 2, None, 0.0, bits, group_size, seed)
    _run_hop1(cuda, grad, 2, 2, _error_buffer(2, cols, group_size, 8, gen), 0.0, bits, group_size, seed)


@pytest.mark.parametrize("bits,in_bits,hadamard", [(4, 4, False), (3, 2, False), (2, 8, True), (8, 3, True)])
def test_outputs_land_in_strided_wire_views_and_nothing_else_changes(cuda, bits, in_bits, hadamard):
    """Parameter 1 of a three-parameter bucket is written through WireLayout views of a poisoned buffer: the whole
    buffer must equal the reference applied to a CPU copy (so columns outside the views are untouched)."""
    gen, seed = _generator()
    world, local, group_size = 6, 2, 32
    grads = [_values(n, gen).to(torch.bfloat16) for n in (100, 1000, 37)]
    widths = tuple(ref.padded_partition_size(g.numel(), world, group_size) for g in grads)
    hop1 = WireLayout(widths, bits, group_size)
    offset = hop1.offsets()[1]
    buffer = _poison((world, hop1.row_bytes), torch.uint8, "cpu")
    expected = buffer.clone()
    actual = buffer.cuda()
    error = _error_buffer(world, widths[1], group_size, 8, gen)
    gpu_error = _to_cuda(error)
    cuda.hop1_(grads[1].cuda(), world, local, gpu_error, 0.8, bits, group_size, *hop1.views(actual, 1, offset),
               hadamard=hadamard)
    ref.hop1_(grads[1], world, local, error, 0.8, bits, group_size, *hop1.views(expected, 1, offset),
              hadamard=hadamard)
    assert torch.equal(actual.cpu(), expected), f"hop-1 wire buffer differs (seed {seed})"
    _check_error(gpu_error, error, seed)

    nodes = world // local
    hop2_in = WireLayout(widths, in_bits, group_size)
    hop2_out = WireLayout(widths, bits, group_size)
    received = _poison((world, hop2_in.row_bytes), torch.uint8, "cpu")
    for row in range(world):  # finite scales for the parameter read (others stay poison)
        received_scales = hop2_in.views(received, 1, offset)[1]
        received_scales[row] = torch.rand(received_scales.shape[1], generator=gen)
    send = _poison((nodes, hop2_out.row_bytes), torch.uint8, "cpu")
    expected, actual = send.clone(), send.cuda()
    received_gpu = received.cuda()
    error = _error_buffer(nodes, widths[1], group_size, 32, gen)
    gpu_error = _to_cuda(error)
    cuda.hop2_(*hop2_in.views(received_gpu, 1, offset), local, in_bits, gpu_error, 0.8, bits, group_size,
               *hop2_out.views(actual, 1, offset))
    ref.hop2_(*hop2_in.views(received, 1, offset), local, in_bits, error, 0.8, bits, group_size,
              *hop2_out.views(expected, 1, offset))
    assert torch.equal(actual.cpu(), expected), f"hop-2 wire buffer differs (seed {seed})"
    _check_error(gpu_error, error, seed)

    out = cuda.final_mean(*hop2_out.views(actual, 1, offset), bits, group_size, world, 1000, 4, torch.bfloat16,
                          hadamard=hadamard)
    want = ref.final_mean(*hop2_out.views(expected, 1, offset), bits, group_size, world, 1000, 4, torch.bfloat16,
                          hadamard=hadamard)
    assert _bits_equal(out, want, nan_payload=False), f"final mean from wire views differs (seed {seed})"


def test_dispatcher_picks_the_cuda_kernels_and_logs_one_line(cuda, caplog, monkeypatch):
    from deepspeed_loco import ops
    monkeypatch.delenv("DS_LOCO_KERNELS", raising=False)
    ops._reset()
    with caplog.at_level("INFO", logger="deepspeed_loco"):
        assert ops.kernels_for(torch.device("cuda")) is cuda
        assert ops.kernels_for(torch.device("cuda", 0)) is cuda
    lines = [r.getMessage() for r in caplog.records if r.name == "deepspeed_loco"]
    assert len(lines) == 1 and "fused CUDA kernels" in lines[0], lines
    ops._reset()
    monkeypatch.setenv("DS_LOCO_KERNELS", "reference")
    assert ops.kernels_for(torch.device("cuda")) is ref
    ops._reset()


def test_unsupported_group_size_falls_back_to_the_reference_with_a_warning(cuda, caplog):
    gen, seed = _generator()
    grad = _values(500, gen).cuda()
    data = torch.empty(2, 288 * 4 // 8, dtype=torch.uint8, device="cuda")  # P = 250, P' = 288 = 6 groups of 48
    scale = torch.empty(2, 6, device="cuda")
    with caplog.at_level("WARNING", logger="deepspeed_loco"):
        cuda.hop1_(grad, 2, 2, None, 0.8, 4, 48, data, scale)
    assert any("group_size 48" in r.getMessage() for r in caplog.records)
    expected = torch.empty_like(data), torch.empty_like(scale)
    ref.hop1_(grad, 2, 2, None, 0.8, 4, 48, *expected)  # the fallback is the reference on the same device
    assert torch.equal(data, expected[0]) and _bits_equal(scale, expected[1].cpu()), seed


def _free_gpu_bytes():
    return torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 0


@pytest.mark.skipif(_free_gpu_bytes() < 24 << 30, reason="needs 24 GiB of free GPU memory (2^31+ elements)")
def test_more_than_2_31_elements(cuda):
    """bf16 gradient of 2^31 + 4173 elements, one row (W = L = 1): hop 1 and the final mean at groups before,
    across and after element 2^31 (64-bit offsets) against the reference on those groups."""
    gen, seed = _generator()
    numel, group_size, bits = (1 << 31) + 4173, 256, 4
    torch.manual_seed(seed)
    grad = torch.randn(numel, device="cuda", dtype=torch.bfloat16)
    cols = ref.padded_partition_size(numel, 1, group_size)
    groups = cols // group_size
    error = ErrorBuffer.zeros(1, cols, group_size, 8, "cuda")
    error.values.random_(-127, 128)
    error.scale.uniform_(0, 0.01)
    windows = [(0, 2), ((1 << 31) // group_size - 1, (1 << 31) // group_size + 1), (groups - 3, groups)]
    before = [(error.values[:, a * group_size:b * group_size].cpu(), error.scale[:, a:b].cpu()) for a, b in windows]
    data = torch.empty(1, cols * bits // 8, dtype=torch.uint8, device="cuda")
    scale = torch.empty(1, groups, device="cuda")
    cuda.hop1_(grad, 1, 1, error, 0.8, bits, group_size, data, scale)
    out = cuda.final_mean(data, scale, bits, group_size, 1, numel, 0, torch.bfloat16)
    assert out.shape == (numel,)
    for (a, b), (values, scales) in zip(windows, before):
        lo, hi = a * group_size, min(b * group_size, numel)
        window_error = ErrorBuffer(values.clone(), scales.clone(), group_size)
        want_data = torch.empty(1, (b - a) * group_size * bits // 8, dtype=torch.uint8)
        want_scale = torch.empty(1, b - a)
        ref.hop1_(grad[lo:hi].cpu(), 1, 1, window_error, 0.8, bits, group_size, want_data, want_scale)
        assert torch.equal(data[:, lo * bits // 8:b * group_size * bits // 8].cpu(), want_data), (a, seed)
        assert _bits_equal(scale[:, a:b], want_scale), (a, seed)
        assert torch.equal(error.values[:, lo:b * group_size].cpu(), window_error.values), (a, seed)
        assert _bits_equal(error.scale[:, a:b], window_error.scale), (a, seed)
        want_out = ref.final_mean(want_data, want_scale, bits, group_size, 1, hi - lo, 0, torch.bfloat16)
        assert _bits_equal(out[lo:hi], want_out, nan_payload=False), (a, seed)
