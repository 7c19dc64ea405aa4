import math

import pytest
import torch

from deepspeed_loco.ops.hadamard import hadamard_signs, rotate, unrotate


def _sylvester(size):
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < size:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@pytest.mark.parametrize("group_size", [32, 256, 4096])
def test_rotation_is_the_signed_orthonormal_hadamard_transform(group_size):
    x = torch.randn(3, 2 * group_size)
    expected = (x.double().view(3, 2, group_size) * hadamard_signs(group_size).double()) @ _sylvester(group_size).T
    expected = (expected / math.sqrt(group_size)).view(3, -1)
    torch.testing.assert_close(rotate(x, group_size).double(), expected, rtol=0, atol=1e-5 * math.log2(group_size))


@pytest.mark.parametrize("group_size", [32, 1024])
def test_unrotate_inverts_rotate_and_energy_is_kept(group_size):
    x = torch.randn(4, 3 * group_size)
    y = rotate(x, group_size)
    torch.testing.assert_close(unrotate(y, group_size), x, rtol=0, atol=1e-5)
    torch.testing.assert_close(y.view(4, 3, -1).norm(dim=-1), x.view(4, 3, -1).norm(dim=-1), rtol=1e-5, atol=0)


def test_signs_are_fixed_balanced_and_not_periodic():
    signs = hadamard_signs(4096)
    assert torch.equal(signs, hadamard_signs(4096)) and set(signs.tolist()) == {-1.0, 1.0}
    assert abs(float(signs.mean())) < 0.05
    assert not torch.equal(signs[:2048], signs[2048:])
    assert torch.equal(hadamard_signs(32), signs[:32])  # a smaller group uses a prefix of the same sequence


def test_rotation_spreads_an_outlier():
    x = torch.zeros(1, 256)
    x[0, 17] = 16.0
    y = rotate(x, 256)
    assert torch.allclose(y.abs(), torch.full_like(y, 1.0))
