"""The fused CUDA kernels (``deepspeed_loco.ops.loco_cuda``) against the reference (``loco_reference``).

The reference runs on CPU copies of the inputs: that is the contract (IEEE fp32 in a fixed order). On CUDA tensors
PyTorch computes ``tensor / python_scalar`` as a multiplication by the reciprocal, so the reference evaluated on the
GPU can differ from itself on the CPU by one ulp in a scale; the kernels follow the CPU. Integer outputs (packed
data, int8 error) and fp32 scales / fp32 error must be bit-identical; final outputs too, except that NaN payloads
of fp16/bf16 outputs are compared as "is NaN".

Every test draws fresh random inputs (the seed is in each failure message) and poisons every output first.
Skipped without a CUDA device; with one, the op must build (a build failure fails the tests). The binding's argument,
tensor and size checks run in a subprocess (``binding_checks.py``): a check that killed the process would fail
that test, not end the run.
"""
import itertools
import json
import os
import re
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deepspeed_loco.config import LocoConfig
from deepspeed_loco.layout import GRID_NAMES, HopArgs, MeanArgs, WireLayout, plan_hops
from deepspeed_loco.ops import loco_reference as ref
from deepspeed_loco.ops.error_buffer import ErrorBuffer
from tests.unit.ops import binding_checks
from tests.unit.ops.adversarial import adversarial_groups

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
LAYOUTS = [(4, 2), (6, 2), (4, 4), (4, 1)]  # (W, L)
BITS = [2, 3, 4, 8]
GROUPS = [32, 256, 4096]
SHAPES = [(7,), (33, 5), (1000, 3)]
ERRORS = [(None, 0.8), (8, 0.0), (8, 0.8), (32, 0.0), (32, 0.8), (4, 0.0), (4, 0.8)]  # (error_bits, beta)
HADAMARD_GROUPS = [32, 256, 512, 1024, 4096]  # teams of 2, 16, 32 (one warp), 64 and 256 threads
GRIDS = list(GRID_NAMES)


@pytest.fixture(scope="module")
def cuda():
    """The ops' bucket entry points (``deepspeed_loco.ops.library.CUDA``) with the CUDA extension loaded (built the
    first time): on CUDA tensors they run the fused kernels."""
    from deepspeed_loco.ops import library, loco_cuda
    loco_cuda.load()
    return library.CUDA


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


def _widths(numels, world, group_size):
    return tuple(ref.padded_partition_size(n, world, group_size) for n in numels)


def _run_hop1(cuda, grads, args, errors, seed):
    """quantize_bucket_ of the kernels (on GPU) and of the reference (on CPU) into poisoned copies of one wire
    buffer: the whole buffer (every byte, inside and outside the parameters' columns) and every error must match."""
    wire = WireLayout(_widths([g.numel() for g in grads], args.world_size, args.group_size), args.bits,
                      args.group_size)
    expected = _poison((args.world_size, wire.row_bytes), torch.uint8, "cpu")
    actual = expected.cuda()
    gpu_errors = [_to_cuda(e) for e in errors]
    cuda.quantize_bucket_([g.cuda() for g in grads], gpu_errors, args, wire, actual)
    ref.quantize_bucket_(grads, errors, args, wire, expected)
    assert torch.equal(actual.cpu(), expected), f"hop-1 wire buffer differs (seed {seed})"
    for gpu, cpu in zip(gpu_errors, errors):
        _check_error(gpu, cpu, seed)


def _hop1_cases():
    """Unrotated: dtype x (W, L) x bits x error x group size, the shape and grid cycling. Rotated (Hadamard): dtype x
    bits x error x group size of every team width (2 .. 256 threads), layouts, shapes and grids cycling."""
    cases = []
    for i, (dtype, (world, local), bits, (error_bits, beta), group_size) in enumerate(
            itertools.product(DTYPES, LAYOUTS, BITS, ERRORS, GROUPS)):
        cases.append((dtype, world, local, bits, error_bits, beta, group_size, SHAPES[(i + i // 3) % len(SHAPES)],
                      False, GRIDS[i // 5 % 2]))
    for i, (dtype, bits, (error_bits, beta), group_size) in enumerate(
            itertools.product(DTYPES, BITS, ERRORS, HADAMARD_GROUPS)):
        world, local = LAYOUTS[i % len(LAYOUTS)]
        cases.append((dtype, world, local, bits, error_bits, beta, group_size, SHAPES[(i + i // 4) % len(SHAPES)],
                      True, GRIDS[i // 5 % 2]))
    return cases


@pytest.mark.parametrize("dtype,world,local,bits,error_bits,beta,group_size,shape,hadamard,grid", _hop1_cases())
def test_hop1_matches_reference(cuda, dtype, world, local, bits, error_bits, beta, group_size, shape, hadamard, grid):
    """Packed data, scales and error (in the rotated basis with Hadamard) identical to the reference."""
    gen, seed = _generator()
    numel = torch.Size(shape).numel()
    grad = _values(numel, gen).view(shape).to(dtype)
    cols = ref.padded_partition_size(numel, world, group_size)
    error = _error_buffer(world, cols, group_size, error_bits, gen)
    _run_hop1(cuda, [grad], HopArgs(world, local, bits, group_size, beta, hadamard, grid), [error], seed)


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4099, 37), (1, 1 << 17)])
@pytest.mark.parametrize("hadamard,group_size", [(False, 256), (True, 256), (True, 2048)])
def test_hop1_larger_tensors_match_reference(cuda, dtype, shape, hadamard, group_size, grid):
    """Many groups per row, vector loads on aligned rows ((1, 2^17): P divisible by 8) and scalar tails."""
    gen, seed = _generator()
    grad = _values(torch.Size(shape).numel(), gen).view(shape).to(dtype)
    cols = ref.padded_partition_size(grad.numel(), 8, group_size)
    _run_hop1(cuda, [grad], HopArgs(8, 4, 4, group_size, 0.8, hadamard, grid),
              [_error_buffer(8, cols, group_size, 8, gen)], seed)


def _recv(rows, cols, bits, group_size, gen):
    data = torch.randint(0, 256, (rows, cols * bits // 8), dtype=torch.uint8, generator=gen)
    scale = torch.rand(rows, cols // group_size, generator=gen) * 10.0 ** (torch.rand(rows, 1, generator=gen) * 4 - 2)
    scale[torch.rand(scale.shape, generator=gen) < 0.1] = 0
    return data, scale


def _wire_buffer(data, scale, bits, group_size):
    """A one-parameter wire buffer (rows, row_bytes) holding ``data`` and ``scale``, and its layout."""
    wire = WireLayout((data.shape[1] * 8 // bits,), bits, group_size)
    buffer = wire.empty(data.shape[0], "cpu")
    buffer[:, :wire.data_bytes] = data
    buffer[:, wire.data_bytes:].view(torch.float32).copy_(scale)
    return buffer, wire


def _run_hop2(cuda, recv_data, recv_scale, error, args, seed):
    """requantize_bucket_ of one parameter: the whole send buffer and the error must match the reference."""
    recv, in_wire = _wire_buffer(recv_data, recv_scale, args.in_bits, args.group_size)
    wire = WireLayout(in_wire.widths, args.bits, args.group_size)
    nodes = args.world_size // args.local_size
    expected = _poison((nodes, wire.row_bytes), torch.uint8, "cpu")
    actual = expected.cuda()
    gpu_error = _to_cuda(error)
    cuda.requantize_bucket_(recv.cuda(), in_wire, [gpu_error], args, wire, actual)
    ref.requantize_bucket_(recv, in_wire, [error], args, wire, expected)
    assert torch.equal(actual.cpu(), expected), f"hop-2 wire buffer differs (seed {seed})"
    _check_error(gpu_error, error, seed)


def _hop2_args(world, local, in_bits, bits, group_size, beta, grid):
    return HopArgs(world, local, bits, group_size, beta, grid=grid, in_bits=in_bits, in_blocks=local)


@pytest.mark.parametrize("world,local,in_bits,bits,error_bits,beta,group_size,grid", [
    (world, local, in_bits, bits, error_bits, beta, GROUPS[i % len(GROUPS)], GRIDS[i // 3 % 2])
    for i, ((world, local), in_bits, bits, (error_bits, beta))
    in enumerate(itertools.product(LAYOUTS, BITS, BITS, ERRORS))
])
def test_hop2_matches_reference(cuda, world, local, in_bits, bits, error_bits, beta, group_size, grid):
    gen, seed = _generator()
    nodes = world // local
    cols = group_size * int(torch.randint(1, 4, (1,), generator=gen))
    recv_data, recv_scale = _recv(local * nodes, cols, in_bits, group_size, gen)
    error = _error_buffer(nodes, cols, group_size, error_bits, gen)
    _run_hop2(cuda, recv_data, recv_scale, error, _hop2_args(world, local, in_bits, bits, group_size, beta, grid), seed)


def _run_final(cuda, recv_data, recv_scale, args, numel, rank, dtype, seed):
    recv, wire = _wire_buffer(recv_data, recv_scale, args.bits, args.group_size)
    [out] = cuda.final_mean_bucket(recv.cuda(), wire, args, [numel], rank, dtype)
    [expected] = ref.final_mean_bucket(recv, wire, args, [numel], rank, dtype)
    assert out.dtype == dtype and out.shape == expected.shape and out.is_cuda
    assert _bits_equal(out, expected, nan_payload=False), f"final mean differs (seed {seed})"
    return out


FINAL_SIZES = [(7, 4, 0), (7, 4, 1), (7, 4, 3), (165, 6, 5), (3000, 6, 2), (1 << 16, 4, 3), (100003, 8, 7)]


@pytest.mark.parametrize("dtype,group_size,bits,numel,world,rank,rows,grid", [
    (dtype, group_size, bits, numel, world, rank, 1 + i % 4, GRIDS[i // 7 % 2])
    for i, (dtype, group_size, bits, (numel, world, rank)) in enumerate(itertools.product(DTYPES, GROUPS, BITS,
                                                                                           FINAL_SIZES))
])
def test_final_mean_matches_reference(cuda, dtype, group_size, bits, rows, numel, world, rank, grid):
    gen, seed = _generator()
    cols = ref.padded_partition_size(numel, world, group_size)
    recv_data, recv_scale = _recv(rows, cols, bits, group_size, gen)
    _run_final(cuda, recv_data, recv_scale, MeanArgs(world, bits, group_size, grid=grid), numel, rank, dtype,
               seed)


@pytest.mark.parametrize("dtype,group_size,bits,numel,world,rank,rows,grid", [
    (dtype, group_size, bits, numel, world, rank, 1 + i % 4, GRIDS[i // 2 % 2])
    for i, (dtype, group_size, bits) in enumerate(itertools.product(DTYPES, HADAMARD_GROUPS, BITS))
    for numel, world, rank in [FINAL_SIZES[i % len(FINAL_SIZES)]]
])
def test_final_mean_with_hadamard_matches_reference(cuda, dtype, group_size, bits, rows, numel, world, rank, grid):
    """The inverse rotation fused into the final kernel: same output as the reference."""
    gen, seed = _generator()
    cols = ref.padded_partition_size(numel, world, group_size)
    recv_data, recv_scale = _recv(rows, cols, bits, group_size, gen)
    _run_final(cuda, recv_data, recv_scale, MeanArgs(world, bits, group_size, True, grid), numel, rank, dtype,
               seed)


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("hadamard", [False, True])
@pytest.mark.parametrize("error_bits", [None, 4, 8, 32])
@pytest.mark.parametrize("dtype", DTYPES)
def test_non_finite_inputs_match_reference(cuda, dtype, error_bits, hadamard, grid):
    """inf / NaN gradients: NaN scale and q = 0 for their groups, their error groups stored as zero (with
    Hadamard, the rotation spreads them over their whole group first)."""
    gen, seed = _generator()
    grad = _values(4096 + 77, gen)
    grad[5] = float("inf")
    grad[700] = float("nan")
    grad[1500] = -float("inf")
    grad = grad.to(dtype)
    cols = ref.padded_partition_size(grad.numel(), 4, 32)
    _run_hop1(cuda, [grad], HopArgs(4, 2, 4, 32, 0.8, hadamard, grid), [_error_buffer(4, cols, 32, error_bits, gen)],
              seed)
    recv_data, recv_scale = _recv(4, 256, 4, 32, gen)
    recv_scale[1, 3] = float("nan")
    recv_scale[2, 5] = float("inf")
    _run_hop2(cuda, recv_data, recv_scale, _error_buffer(2, 256, 32, error_bits, gen),
              _hop2_args(4, 2, 4, 4, 32, 0.8, grid), seed)
    out = _run_final(cuda, recv_data, recv_scale, MeanArgs(4, 4, 32, hadamard, grid), 1000, 1, dtype, seed)
    assert out.isnan().any()


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("bits", BITS)
def test_ties_denormals_and_huge_groups_match_reference(cuda, bits, grid):
    """The host test's adversarial groups (tests/unit/ops/adversarial.py: quotients at and a few ulps around both
    grids' rounding boundaries at power-of-two and other scales, subnormal negative quotients, denormal and huge
    scales, non-finite values) as an fp32 gradient whose two partition rows keep the groups whole; without error and
    with int8 error storage."""
    gen, seed = _generator()
    group_size = 256
    groups = torch.cat([adversarial_groups(group_size, bits, gen, g) for g in GRIDS])
    if groups.numel() // group_size % 2:
        groups = torch.cat([groups, torch.zeros(group_size)])
    grad = torch.cat([groups, _values(group_size + 77, gen)])
    cols = ref.padded_partition_size(grad.numel(), 2, group_size)
    _run_hop1(cuda, [grad], HopArgs(2, 2, bits, group_size, 0.0, grid=grid), [None], seed)
    _run_hop1(cuda, [grad], HopArgs(2, 2, bits, group_size, 0.0, grid=grid),
              [_error_buffer(2, cols, group_size, 8, gen)], seed)


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("bits,in_bits,hadamard,error_bits", [(4, 4, False, 8), (3, 2, False, 32), (2, 8, True, 8),
                                                              (8, 3, True, None), (2, 2, False, 4), (2, 8, True, 4)])
def test_bucket_of_many_parameters_in_one_launch_per_hop(cuda, bits, in_bits, hadamard, error_bits, grid):
    """A bucket of parameters of mixed sizes (one group, many groups, ragged tails, 33 small ones) through hop 1,
    hop 2 and the final mean, one kernel call each: every wire byte, error and mean identical to the reference."""
    gen, seed = _generator()
    world, local, group_size = 6, 2, 32
    nodes = world // local
    numels = [100, 1000, 37, 1, 5000] + [4096] * 33 + [123457]
    grads = [_values(n, gen).to(torch.bfloat16) for n in numels]
    widths = _widths(numels, world, group_size)
    args1 = HopArgs(world, local, in_bits, group_size, 0.8, hadamard, grid)
    errors1 = [_error_buffer(world, w, group_size, error_bits, gen) for w in widths]
    _run_hop1(cuda, grads, args1, errors1, seed)

    in_wire, wire = WireLayout(widths, in_bits, group_size), WireLayout(widths, bits, group_size)
    recv = in_wire.empty(world, "cpu")
    recv.copy_(torch.randint(0, 256, recv.shape, dtype=torch.uint8, generator=gen))
    for i, offset in enumerate(in_wire.offsets()):  # finite scales
        in_wire.views(recv, i, offset)[1].copy_(torch.rand(world, widths[i] // group_size, generator=gen))
    args2 = HopArgs(world, local, bits, group_size, 0.8, hadamard, grid, in_bits=in_bits, in_blocks=local)
    errors2 = [_error_buffer(nodes, w, group_size, error_bits, gen) for w in widths]
    expected = _poison((nodes, wire.row_bytes), torch.uint8, "cpu")
    actual, gpu_errors = expected.cuda(), [_to_cuda(e) for e in errors2]
    cuda.requantize_bucket_(recv.cuda(), in_wire, gpu_errors, args2, wire, actual)
    ref.requantize_bucket_(recv, in_wire, errors2, args2, wire, expected)
    assert torch.equal(actual.cpu(), expected), f"hop-2 wire buffer differs (seed {seed})"
    for gpu, cpu in zip(gpu_errors, errors2):
        _check_error(gpu, cpu, seed)

    outs = cuda.final_mean_bucket(actual, wire, args2.mean(), numels, 4, torch.bfloat16)
    wants = ref.final_mean_bucket(expected, wire, args2.mean(), numels, 4, torch.bfloat16)
    assert len(outs) == len(numels)
    for i, (out, want) in enumerate(zip(outs, wants)):
        assert out.shape == want.shape and _bits_equal(out, want, nan_payload=False), (i, seed)


def test_dispatcher_picks_the_cuda_kernels_and_logs_one_line(cuda, caplog, monkeypatch):
    from deepspeed_loco import ops
    from deepspeed_loco.ops import library
    monkeypatch.delenv("DS_LOCO_KERNELS", raising=False)
    library._reset()
    with caplog.at_level("INFO", logger="deepspeed_loco"):
        assert ops.kernels_for(torch.device("cuda")) is ops.CUDA
        assert ops.kernels_for(torch.device("cuda", 0)).name == "loco_cuda"
    lines = [r.getMessage() for r in caplog.records if r.name == "deepspeed_loco"]
    assert len(lines) == 1 and "fused CUDA kernels" in lines[0], lines
    library._reset()
    monkeypatch.setenv("DS_LOCO_KERNELS", "reference")
    assert ops.kernels_for(torch.device("cuda")) is ops.REFERENCE
    library._reset()


def test_a_wire_buffer_without_contiguous_rows_is_refused_naming_it(cuda):
    """Neither implementation takes a wire buffer without unit stride along its rows: the entry point raises."""
    gen, _ = _generator()
    grads = [_values(300, gen).cuda(), _values(70, gen).cuda()]
    wire = WireLayout(_widths([g.numel() for g in grads], 4, 32), 4, 32)
    errors = [_to_cuda(_error_buffer(4, w, 32, 8, gen)) for w in wire.widths]
    with pytest.raises(ValueError, match="wire buffer send: expected rows of contiguous bytes"):
        strided = wire.empty(4, "cuda").repeat(1, 2)[:, ::2]
        cuda.quantize_bucket_(grads, errors, HopArgs(4, 2, 4, 32, 0.8), wire, strided)


def test_the_binding_checks_raise_in_a_process_of_their_own(cuda):
    """Every argument, tensor and size check of the binding (``binding_checks.CASES``: bits, group size, err_beta,
    grid, layout, shapes, error storage, stats, rank, the 32-bit sizes of loco_limits.h, the sample's indices, and
    tensors the kernels cannot take: on the host, of another dtype, without unit stride along a row) raises a
    RuntimeError with its message, in a subprocess: a check that ended the process fails here, naming the case. No
    call is handed to the reference."""
    root = Path(__file__).resolve().parents[3]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, "-m", "tests.unit.ops.binding_checks"], cwd=root, env=env, text=True,
                         capture_output=True, timeout=600)
    lines = run.stdout.splitlines()
    started = [line.split(" ", 1)[1] for line in lines if line.startswith("start ")]
    assert run.returncode == 0 and lines[-1:] == ["done"], (
        f"the binding's checks ended the process (exit code {run.returncode}) in case "
        f"{started[-1] if started else None!r}:\n{run.stderr[-4000:]}")
    results = {r["case"]: r for r in (json.loads(line) for line in lines if line.startswith("{"))}
    for name, (_, pattern) in binding_checks.CASES.items():
        result = results[name]
        assert result["raised"] == "RuntimeError" and re.search(pattern, result["message"]), result


@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_sample_matches_reference_in_one_launch(cuda, dtype):
    """The live rho's sample gather: bit-identical to the reference on CPU copies, for many tensors (2-D,
    non-contiguous, a non-finite value) in one call, coordinates -1 giving 0; an empty sample gives an empty
    tensor."""
    gen, seed = _generator()
    host = [_values(n, gen).to(dtype) for n in (7, 300, 4099, 123_457)] + [_values(60, gen).to(dtype).view(12, 5).t()]
    host[1][3] = float("inf")
    counts = [min(t.numel(), 256) for t in host]
    owners = torch.arange(len(host), dtype=torch.int32).repeat_interleave(torch.tensor(counts))
    coords = torch.cat([torch.randint(0, t.numel(), (c,), generator=gen) for t, c in zip(host, counts)])
    coords[torch.rand(coords.numel(), generator=gen) < 0.3] = -1
    scales = torch.rand(len(host), generator=gen) * 10
    want = ref.gather_sample(host, owners, coords, scales)
    got = cuda.gather_sample([t.cuda() for t in host], owners, coords, scales)
    assert got.is_cuda and torch.equal(got.cpu(), want), seed
    assert cuda.gather_sample([host[0].cuda()], owners[:0], coords[:0], scales[:1]).shape == (0,)


OWN_LAYOUTS = [(4, 2, 3), (6, 2, 2), (6, 2, 5), (4, 4, 1), (4, 1, 2), (16, 8, 13), (16, 2, 0)]  # (W, L, rank)


def _own_cases():
    """Every layout (two hops, one node, one rank per node) x error storage, with bits, Hadamard (and its group
    sizes) and the grid cycling."""
    cases = []
    for i, ((world, local, rank), error_bits) in enumerate(itertools.product(OWN_LAYOUTS, [None, 4, 8, 32])):
        hadamard = i % 3 == 1
        cases.append((world, local, rank, (BITS[i % 4], BITS[(i + 1) % 4]), error_bits, hadamard,
                      HADAMARD_GROUPS[i % 5] if hadamard else GROUPS[i % 2], GRIDS[i // 2 % 2]))
    return cases


def _scramble_block(buffer, block, rows, gen):
    """Random bytes (NaN and huge scales among them) in rows ``[block * rows, (block + 1) * rows)`` of a wire
    buffer: the received copy of the rank's own block, which an exact own block must never read."""
    buffer[block * rows:(block + 1) * rows] = torch.randint(0, 256, (rows, buffer.shape[1]), dtype=torch.uint8,
                                                            generator=gen)


def _assert_stats_close(actual, expected, seed):
    torch.testing.assert_close(actual.cpu(), expected, rtol=1e-5, atol=0, msg=f"stats differ (seed {seed})")


@pytest.mark.parametrize("world,local,rank,bits,error_bits,hadamard,group_size,grid", _own_cases())
def test_exact_own_block_through_every_kernel_matches_reference(cuda, world, local, rank, bits, error_bits, hadamard,
                                                                group_size, grid):
    """``exact_own_block``: a bucket through every hop of the plan and the final mean, one launch each, the received
    own block scrambled: every wire byte (the own rows' zeros included), own buffer, error and mean bit-identical to
    the reference, and the measured sums within fp32 rounding."""
    gen, seed = _generator()
    config = LocoConfig(intra_node_bits=bits[0], inter_node_bits=bits[1], group_size=group_size, hadamard=hadamard,
                        quant_grid=grid, error_bits=error_bits or 8, exact_own_block=True)
    plan = plan_hops(world, local, config)
    numels = [100, 1000, 37, 5000]
    grads = [_values(n, gen).to(torch.bfloat16) for n in numels]
    widths = plan.widths(numels)
    recv = own_in = in_wire = None
    for index, hop in enumerate(plan.hops):
        args = plan.args(index, 0.8, rank)
        wire = hop.wire(widths, group_size)
        errors = [_error_buffer(plan.error_rows()[hop.name], w, group_size, error_bits, gen) for w in widths]
        gpu_errors = [_to_cuda(e) for e in errors]
        expected = _poison((hop.rows, wire.row_bytes), torch.uint8, "cpu")
        own_out = _poison((args.kept_rows, wire.columns), torch.float32, "cpu")
        actual, gpu_own_out = expected.cuda(), own_out.cuda()
        stats, gpu_stats = torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64, device="cuda")
        if index == 0:
            cuda.quantize_bucket_([g.cuda() for g in grads], gpu_errors, args, wire, actual, gpu_stats, gpu_own_out)
            ref.quantize_bucket_(grads, errors, args, wire, expected, stats, own_out)
        else:
            cuda.requantize_bucket_(recv.cuda(), in_wire, gpu_errors, args, wire, actual, gpu_stats, own_in.cuda(),
                                    gpu_own_out)
            ref.requantize_bucket_(recv, in_wire, errors, args, wire, expected, stats, own_in, own_out)
        assert torch.equal(actual.cpu(), expected), f"{hop.name} wire buffer differs (seed {seed})"
        assert _bits_equal(gpu_own_out, own_out), f"{hop.name} own block differs (seed {seed})"
        for gpu, cpu in zip(gpu_errors, errors):
            _check_error(gpu, cpu, seed)
        _assert_stats_close(gpu_stats, stats, seed)
        # what the rank would receive: this send buffer as every peer's block, its own block scrambled
        recv, own_in, in_wire = expected.clone(), own_out, wire
        _scramble_block(recv, args.own, args.kept_rows, gen)
    mean_args = plan.args(len(plan.hops) - 1, 0.8, rank).mean()
    stats, gpu_stats = torch.zeros(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64, device="cuda")
    outs = cuda.final_mean_bucket(recv.cuda(), in_wire, mean_args, numels, rank, torch.bfloat16, gpu_stats,
                                  own_in.cuda())
    wants = ref.final_mean_bucket(recv, in_wire, mean_args, numels, rank, torch.bfloat16, stats, own_in)
    for i, (out, want) in enumerate(zip(outs, wants)):
        assert out.shape == want.shape and _bits_equal(out, want, nan_payload=False), (i, seed)
    _assert_stats_close(gpu_stats, stats, seed)


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
    args = HopArgs(1, 1, bits, group_size, 0.8)
    wire = WireLayout((cols,), bits, group_size)
    send = wire.empty(1, "cuda")
    cuda.quantize_bucket_([grad], [error], args, wire, send)
    data, scale = wire.views(send, 0, 0)
    [out] = cuda.final_mean_bucket(send, wire, args.mean(), [numel], 0, torch.bfloat16)
    assert out.shape == (numel,)
    for (a, b), (values, scales) in zip(windows, before):
        lo, hi = a * group_size, min(b * group_size, numel)
        window_error = ErrorBuffer(values.clone(), scales.clone(), group_size)
        want_data = torch.empty(1, (b - a) * group_size * bits // 8, dtype=torch.uint8)
        want_scale = torch.empty(1, b - a)
        ref.quantize_(grad[lo:hi].cpu(), window_error, args, want_data, want_scale)
        assert torch.equal(data[:, lo * bits // 8:b * group_size * bits // 8].cpu(), want_data), (a, seed)
        assert _bits_equal(scale[:, a:b], want_scale), (a, seed)
        assert torch.equal(error.values[:, lo:b * group_size].cpu(), window_error.values), (a, seed)
        assert _bits_equal(error.scale[:, a:b], window_error.scale), (a, seed)
        want_out = ref.final_mean(want_data, want_scale, args.mean(), hi - lo, 0, torch.bfloat16)
        assert _bits_equal(out[lo:hi], want_out, nan_payload=False), (a, seed)
