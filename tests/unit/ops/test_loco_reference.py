import pytest
import torch

from deepspeed_loco.layout import HopArgs, MeanArgs
from deepspeed_loco.ops import loco_reference as ref
from deepspeed_loco.ops.error_buffer import ErrorBuffer
from deepspeed_loco.ops.quantizer import dequantize_groups, pack, quantize_groups, unpack

S = 32


def test_slot_order_puts_each_local_peers_rows_together_in_node_order():
    # W = 6, L = 2, M = 3: slot d*M + n carries row n*L + d.
    assert ref.slot_to_row(6, 2).tolist() == [0, 2, 4, 1, 3, 5]
    assert ref.slot_to_row(4, 1).tolist() == [0, 1, 2, 3]
    assert ref.slot_to_row(4, 4).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("numel,world", [(1, 4), (7, 4), (165, 6), (4096, 4)])
def test_partition_rows_are_zero3_partitions_padded_to_whole_groups(numel, world):
    grad = torch.arange(1, numel + 1, dtype=torch.float32)
    rows = ref.partition_rows(grad, world, S)
    part = ref.partition_size(numel, world)
    assert rows.shape == (world, ref.padded_partition_size(numel, world, S)) and rows.shape[1] % S == 0
    flat = torch.cat([grad, torch.zeros(world * part - numel)])
    assert torch.equal(rows[:, :part].reshape(-1), flat)
    assert not rows[:, part:].any()


def _identity_bound(c, q, scale, bits, grid="symmetric", error_bits=8):
    """b-bit storage of e = c - deq(q) (b = ``error_bits``, qmax = 2^(b-1) - 1): |stored - e| <= absmax_group(e) /
    (2 qmax), plus fp32 slack (the roundings of c - deq and of deq + stored, a few ulps of |c|)."""
    e = c - dequantize_groups(q, scale, S, grid)
    groups = e.view(e.shape[0], -1, S)
    steps = 2 * ((1 << (error_bits - 1)) - 1)
    bound = (groups.abs().amax(-1, keepdim=True) / steps * (1 + 1e-5) + 1e-12).expand_as(groups).reshape(e.shape)
    return bound + c.abs() * 2.0 ** -22


@pytest.mark.parametrize("grid", ["symmetric", "midrise"])
@pytest.mark.parametrize("error_bits", [4, 8, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_hop1_with_beta_zero_keeps_dequant_plus_error_equal_to_compensated_input(error_bits, dtype, grid):
    world, local, bits = 6, 2, 4
    grad = (torch.randn(165, 7) * 3).to(dtype)
    width = ref.padded_partition_size(grad.numel(), world, S)
    error = ErrorBuffer.zeros(world, width, S, error_bits, "cpu")
    error.store_(torch.randn(world, width) * 0.1 * (torch.arange(width) < 160))
    data = torch.empty(world, width * bits // 8, dtype=torch.uint8)
    scale = torch.empty(world, width // S)
    old = error.dequantize().clone()
    ref.quantize_(grad, error, HopArgs(world, local, bits, S, 0.0, grid=grid), data, scale)
    c = ref.partition_rows(grad, world, S)[ref.slot_to_row(world, local)] + old
    q = unpack(data, bits)
    sent = dequantize_groups(q, scale, S, grid)
    gap = (sent + error.dequantize() - c).abs()
    if error_bits == 32 and grid == "symmetric":
        assert torch.equal(sent + error.dequantize(), c)
    elif error_bits == 32:  # (k + 0.5) * s is not always exactly subtracted back: one rounding of c - deq
        torch.testing.assert_close(sent + error.dequantize(), c, rtol=2 ** -23, atol=1e-7)
    else:
        assert torch.all(gap <= _identity_bound(c, q, scale, bits, grid, error_bits))
    q_expected, scale_expected = quantize_groups(c, bits, S, grid)
    assert torch.equal(q, q_expected) and torch.equal(scale, scale_expected)


def test_hop2_sums_blocks_then_compensates_with_beta_zero_identity():
    local, nodes, bits_in, bits = 3, 2, 4, 2
    width = 64
    values = torch.randn(local * nodes, width)
    q_in, s_in = quantize_groups(values, bits_in, S)
    recv_data, recv_scale = pack(q_in, bits_in), s_in
    error = ErrorBuffer.zeros(nodes, width, S, 8, "cpu")
    error.store_(torch.randn(nodes, width) * 0.05)
    old = error.dequantize().clone()
    out_data = torch.empty(nodes, width * bits // 8, dtype=torch.uint8)
    out_scale = torch.empty(nodes, width // S)
    args = HopArgs(local * nodes, local, bits, S, 0.0, in_bits=bits_in, in_blocks=local)
    ref.requantize_(recv_data, recv_scale, error, args, out_data, out_scale)
    deq_in = dequantize_groups(q_in, s_in, S).view(local, nodes, width)
    c = deq_in[0] + deq_in[1] + deq_in[2] + old
    q = unpack(out_data, bits)
    gap = (dequantize_groups(q, out_scale, S) + error.dequantize() - c).abs()
    assert torch.all(gap <= _identity_bound(c, q, out_scale, bits))


def test_error_update_is_the_moving_average():
    beta = 0.8
    c = torch.randn(2, 64)
    error = ErrorBuffer.zeros(2, 64, S, 32, "cpu")
    error.values.copy_(torch.randn(2, 64))
    old = error.values.clone()
    q, scale = ref.compensate_and_quantize(c, error, beta, 4, S)
    residual = (c + old) - dequantize_groups(q, scale, S)
    torch.testing.assert_close(error.values, beta * old + (1 - beta) * residual, rtol=0, atol=1e-6)


def test_non_finite_input_leaves_finite_error_and_poisons_only_its_group():
    c = torch.randn(1, 64)
    c[0, 5] = float("nan")
    error = ErrorBuffer.zeros(1, 64, S, 8, "cpu")
    q, scale = ref.compensate_and_quantize(c, error, 0.8, 4, S)
    assert torch.isnan(scale[0, 0]) and torch.isfinite(scale[0, 1])
    assert torch.isfinite(error.dequantize()).all() and not error.dequantize()[0, :S].any()


def test_final_mean_divides_by_world_and_zeroes_past_numel():
    world, numel, rank = 4, 10, 3  # P = 3: rank 3 owns element 9 only
    rows = torch.zeros(2, S)
    rows[:, :3] = torch.tensor([8.0, 4.0, 4.0])
    q, scale = quantize_groups(rows, 8, S)
    out = ref.final_mean(pack(q, 8), scale, MeanArgs(world, 8, S), numel, rank, torch.float32)
    assert out.tolist() == [4.0, 0.0, 0.0]


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_midrise_grid_with_beta_zero_keeps_dequant_plus_error_equal_to_the_input(bits):
    """Classic error feedback on the mid-rise grid: what was sent plus the fp32 error is what was to be sent."""
    c = torch.randn(4, 8 * S) * 2
    error = ErrorBuffer.zeros(4, 8 * S, S, 32, "cpu")
    q, scale = ref.compensate_and_quantize(c.clone(), error, 0.0, bits, S, "midrise")
    assert int(q.min()) >= -(1 << (bits - 1)) and int(q.max()) <= (1 << (bits - 1)) - 1
    sent = dequantize_groups(q, scale, S, "midrise")
    assert torch.allclose(sent + error.values, c, rtol=0, atol=1e-6)
    assert not torch.equal(sent, dequantize_groups(q, scale, S))  # the grid changes what the codes mean


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gather_sample_is_each_picked_value_times_its_tensors_scale_and_zero_where_not_owned(dtype):
    """``gather_sample`` element by element: ``scales[owner] * float(value)`` in one fp32 multiplication, 0 for
    coordinate -1, whatever the tensors' shapes (2-D and non-contiguous ones read in flat row-major order)."""
    gen = torch.Generator().manual_seed(5)
    tensors = [torch.randn(7, generator=gen).to(dtype), torch.randn(12, 5, generator=gen).to(dtype).t(),
               torch.randn(300, generator=gen).to(dtype)]
    owners = torch.tensor([0, 2, 1, 1, 2, 0, 1], dtype=torch.int32)
    coords = torch.tensor([6, 299, 0, -1, 17, -1, 59], dtype=torch.int64)
    scales = torch.tensor([1.0, 3.7, 0.3], dtype=torch.float32)
    out = ref.gather_sample(tensors, owners, coords, scales)
    assert out.dtype == torch.float32 and out.shape == (7,)
    for i, (owner, at) in enumerate(zip(owners.tolist(), coords.tolist())):
        want = torch.zeros((), dtype=torch.float32) if at < 0 else (
            tensors[owner].reshape(-1)[at].float() * scales[owner])
        assert torch.equal(out[i], want), i
    assert ref.gather_sample(tensors, owners[:0], coords[:0], scales).shape == (0,)



@pytest.mark.parametrize("error_bits", [4, 8])
def test_a_scaled_error_buffer_stores_within_half_a_step_of_its_grid(error_bits):
    """``store_`` then ``dequantize``: every value within ``absmax / (2 qmax)`` of the error it was given (qmax 7 for
    int4, 127 for int8); int4 holds two codes a byte, the even column in the low nibble, half the bytes of int8."""
    rows, cols = 3, 4 * S
    error = torch.randn(rows, cols) * torch.logspace(-3, 2, rows).unsqueeze(1)
    buffer = ErrorBuffer.zeros(rows, cols, S, error_bits, "cpu")
    buffer.store_(error)
    qmax = (1 << (error_bits - 1)) - 1
    absmax = error.view(rows, -1, S).abs().amax(-1, keepdim=True)
    gap = (buffer.dequantize() - error).view(rows, -1, S).abs()
    assert torch.all(gap <= absmax / (2 * qmax) * (1 + 1e-5))
    assert buffer.shape == (rows, cols) and buffer.codes.abs().max() <= qmax
    if error_bits == 4:
        assert buffer.values.dtype == torch.uint8 and tuple(buffer.values.shape) == (rows, cols // 2)
        low = (buffer.values & 0xF).to(torch.int8)
        assert torch.equal(torch.where(low > 7, low - 16, low), buffer.codes[:, 0::2])
    assert buffer.nbytes() == rows * (cols * error_bits // 8 + cols // S * 4)


def test_an_int4_buffer_zeroes_a_non_finite_group_and_rescales_through_its_scale():
    buffer = ErrorBuffer.zeros(1, 2 * S, S, 4, "cpu")
    error = torch.randn(1, 2 * S)
    error[0, 3] = float("nan")
    buffer.store_(error)
    assert torch.equal(buffer.dequantize()[0, :S], torch.zeros(S)) and bool(buffer.dequantize()[0, S:].abs().sum() > 0)
    before = buffer.dequantize()
    buffer.rescale_(0.5)
    assert torch.equal(buffer.dequantize(), before * 0.5)
