"""fp32 inputs that probe every boundary of the quantizer, shared by the host and the CUDA kernel tests."""
import torch

from deepspeed_loco.layout import grid_named
from deepspeed_loco.ops.quantizer import grid_levels


def adversarial_groups(group_size, bits, gen, grid="symmetric"):
    """fp32 groups: lognormal magnitudes, exact and near rounding boundaries (ratios c * fl(1 / scale) half a step
    from the codes' cell centres: half-integers for the symmetric grid, integers for mid-rise), denormal, huge, zero,
    underflowing, non-finite."""
    divisor, low, high = grid_levels(bits, grid)
    qmax, step = (1 << (bits - 1)) - 1, 2.0 ** -5
    groups = [torch.randn(64, group_size, generator=gen) * 10.0 ** (torch.rand(64, 1, generator=gen) * 8 - 4)]
    ties = torch.zeros(group_size)
    count = min(high - low, group_size - 1)
    offset = 0.5 - grid_named(grid).rounding.cell_centre  # ratios on the boundaries of the grid's rounding
    ties[:count] = ((torch.arange(count, dtype=torch.float64) + low + offset) * step).float()
    ties[-1] = divisor * step  # absmax: scale = step exactly
    for direction in (0.0, 1e9, -1e9):
        moved = ties if direction == 0 else torch.nextafter(ties, torch.full_like(ties, direction))
        moved[-1] = divisor * step
        groups.append(moved.unsqueeze(0))
    groups.append(torch.randn(2, group_size, generator=gen) * 1e-40)  # subnormal scale: the lifted product
    groups.append(torch.randn(2, group_size, generator=gen).clamp(-3, 3) * 1e38)  # at 2 bits 1 / scale is subnormal
    groups.append(torch.zeros(1, group_size))
    underflow = torch.zeros(1, group_size)
    underflow[0, 3] = 1e-45  # absmax / qmax underflows to 0: q = 0, scale 0
    groups.append(underflow)
    bad = torch.randn(3, group_size, generator=gen)
    bad[0, 1], bad[1, 2], bad[2, 0] = float("inf"), float("nan"), -float("inf")
    groups.append(bad)
    # rounding boundaries at scales that are not powers of two (the reciprocal is inexact), 24 normal scales and 12
    # subnormal ones (below 2^-126: the lifted product): each group's values lie within 3 ulps of (k + offset) * scale,
    # its last value is the absmax that makes that scale
    exponents = torch.cat([torch.randint(-90, 90, (24, 1), generator=gen), torch.randint(-142, -128, (12, 1),
                                                                                         generator=gen)])
    absmax = (divisor * 2.0 ** exponents.double() * (1 + torch.rand(36, 1, generator=gen, dtype=torch.float64))).float()
    scale = absmax / divisor  # fp32, as the quantizer computes it
    codes = torch.randint(low, high + (1 if offset == 0.0 else 0), (36, group_size), generator=gen)
    near = ((codes.double() + offset) * scale.double()).float()
    for _ in range(3):
        step_dir = torch.randint(-1, 2, near.shape, generator=gen).float() * 1e38
        near = torch.where(step_dir != 0, torch.nextafter(near, step_dir), near)
    near = torch.where(near.abs() > absmax, near.sign() * absmax, near)
    near[:, :8] = -torch.arange(1, 9, dtype=torch.float64) * 2.0 ** -149  # tiny negative ratios: -0 or subnormal
    near[:, -1] = absmax[:, 0]
    groups.append(near)
    # boundaries times 2^-3 with the absmax one ulp below divisor * 2^-3: fl(1 / scale) is inexact, so c * inv lands
    # beside the ties or, rounded, on them (and on the other side of some from c / scale)
    edge = torch.zeros(group_size)
    edge[:count] = ((torch.arange(count, dtype=torch.float64) + low + offset) * 0.125).float()
    edge[-1] = torch.nextafter(torch.tensor(divisor * 0.125), torch.tensor(0.0))
    groups.append(edge.unsqueeze(0))
    # random multiples of a power-of-two scale: many exact ratios, some exact ties
    multiples = torch.randint(-4 * qmax, 4 * qmax + 1, (8, group_size), generator=gen).float() * 0.25 * step
    multiples[:, -1] = divisor * step
    groups.append(multiples)
    return torch.cat(groups).reshape(-1)
