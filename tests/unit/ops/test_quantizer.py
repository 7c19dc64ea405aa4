import pytest
import torch

from deepspeed_loco.ops.quantizer import dequantize_groups, pack, qmax, quantize_groups, unpack

BITS = (2, 3, 4, 8)


@pytest.mark.parametrize("bits", BITS)
def test_pack_unpack_round_trip(bits):
    q = torch.randint(-qmax(bits), qmax(bits) + 1, (5, 128), dtype=torch.int8)
    packed = pack(q, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 128 * bits // 8)
    assert torch.equal(unpack(packed, bits), q)


def test_four_bit_packing_puts_even_element_in_low_nibble():
    q = torch.tensor([1, -2, 3, -7, 7, 0, -1, 5], dtype=torch.int8)
    assert pack(q, 4).tolist() == [0xE1, 0x93, 0x07, 0x5F]


def test_three_bit_packing_is_a_little_endian_bit_stream():
    q = torch.tensor([1, 2, 3, -1, -2, -3, 0, 1], dtype=torch.int8)
    word = sum((int(v) & 7) << (3 * j) for j, v in enumerate(q.tolist()))
    assert pack(q, 3).tolist() == [(word >> (8 * k)) & 0xFF for k in range(3)]


@pytest.mark.parametrize("bits", BITS)
def test_error_is_at_most_half_a_step(bits):
    half = 1 << (bits - 1)
    c = torch.randn(16, 1024, generator=torch.Generator().manual_seed(bits)) * torch.logspace(-3, 3, 16).unsqueeze(1)
    q, scale = quantize_groups(c, bits, 256)
    assert q.abs().max() <= qmax(bits)
    expected_scale = c.view(16, 4, 256).abs().amax(-1) / qmax(bits)
    assert torch.equal(scale, expected_scale)
    err = (dequantize_groups(q, scale, 256) - c).view(16, 4, 256).abs()
    # half a step, plus fp32's rounding of values up to ``half`` steps from zero (c / scale, then code * scale)
    assert torch.all(err <= scale.unsqueeze(-1) * (0.5 + half * 2.0**-22))


def test_rounding_is_half_to_even_and_symmetric():
    # scale = 7 / 7 = 1: values are exact halves.
    c = torch.tensor([[0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 7.0, -7.0] + [0.0] * 24])
    q, scale = quantize_groups(c, 4, 32)
    assert scale.item() == 1.0
    assert q[0, :8].tolist() == [0, 2, 2, 0, -2, -2, 7, -7]


def test_all_zero_group_has_zero_scale_and_values():
    q, scale = quantize_groups(torch.zeros(2, 64), 4, 32)
    assert torch.equal(scale, torch.zeros(2, 2)) and torch.equal(q, torch.zeros_like(q))


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_group_is_flagged_by_a_nan_scale(bad):
    c = torch.randn(1, 64)
    c[0, 3] = bad
    q, scale = quantize_groups(c, 4, 32)
    assert torch.isnan(scale[0, 0]) and torch.isfinite(scale[0, 1])
    assert torch.equal(q[0, :32], torch.zeros(32, dtype=torch.int8))
    assert torch.isnan(dequantize_groups(q, scale, 32)[0, :32]).all()


@pytest.mark.parametrize("bits", BITS)
def test_midrise_grid_uses_every_code_and_errs_at_most_half_a_step(bits):
    half = 1 << (bits - 1)
    c = torch.randn(16, 1024, generator=torch.Generator().manual_seed(bits)) * torch.logspace(-3, 3, 16).unsqueeze(1)
    q, scale = quantize_groups(c, bits, 256, "midrise")
    assert torch.equal(scale, c.view(16, 4, 256).abs().amax(-1) / torch.tensor(half - 0.5))
    ramp, _ = quantize_groups(torch.linspace(-1, 1, 256).repeat(2, 1), bits, 256, "midrise")
    assert set(ramp.unique().tolist()) == set(range(-half, half))  # all 2^bits codes occur
    deq = dequantize_groups(q, scale, 256, "midrise")
    err = (deq - c).view(16, 4, 256).abs()
    # half a step, plus fp32's rounding of values up to ``half`` steps from zero (c / scale, then code * scale)
    assert torch.all(err <= scale.unsqueeze(-1) * (0.5 + half * 2.0**-22))
    # the group's extremes land on the outermost levels exactly (up to one rounding of the scale)
    extremes = c.view(16, 4, 256).abs().amax(-1)
    assert torch.allclose(deq.view(16, 4, 256).abs().amax(-1), extremes, rtol=1e-6)
    assert torch.equal(unpack(pack(q, bits), bits), q)


def test_midrise_two_bit_levels_and_zero_group():
    c = torch.tensor([[1.5, 0.7, 0.2, -0.1, -0.6, -1.5, 0.0, 1.0] + [0.0] * 24])
    q, scale = quantize_groups(c, 2, 32, "midrise")
    assert scale.item() == 1.0  # absmax 1.5 / (2 - 0.5)
    assert q[0, :8].tolist() == [1, 0, 0, -1, -1, -2, 0, 1]  # levels -1.5, -0.5, 0.5, 1.5
    assert dequantize_groups(q, scale, 32, "midrise")[0, :8].tolist() == [1.5, 0.5, 0.5, -0.5, -0.5, -1.5, 0.5, 1.5]
    q, scale = quantize_groups(torch.zeros(1, 32), 2, 32, "midrise")
    assert scale.item() == 0 and not dequantize_groups(q, scale, 32, "midrise").any()
    with pytest.raises(ValueError, match="'symmetric' or 'midrise'"):
        quantize_groups(c, 2, 32, "uniform")
