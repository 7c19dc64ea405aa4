"""Randomized block Hadamard rotation of quantization groups (pure-PyTorch reference).

Each group of ``S`` elements (``S`` a power of two) is rotated as ``y = H (d * x) * s`` and restored as
``x = d * (H y) * s``, with ``H`` the Sylvester Hadamard matrix in natural order, ``s = fp32(1 / sqrt(S))`` and
``d`` fixed signs, the same on every rank: ``d[i] = 1 - 2 * bit31(fmix32(i))``, with MurmurHash3's 32-bit
finalizer ``fmix32`` (h ^= h >> 16; h *= 0x85EBCA6B; h ^= h >> 13; h *= 0xC2B2AE35; h ^= h >> 16, mod 2**32). The rotation is
orthonormal, so it spreads an outlier over the group and lowers the group's absmax relative to its energy.
``H`` is applied as the in-place butterfly (``a, b -> a + b, a - b`` at strides 1, 2, 4, ..., S/2), the order a
kernel must follow to match bit for bit.
"""
import math

import torch


def hadamard_signs(group_size: int, device=None) -> torch.Tensor:
    """fp32 ``(group_size,)`` of +-1: the fixed sign flips ``d``."""
    mask = 0xFFFFFFFF
    h = torch.arange(group_size, dtype=torch.int64, device=device)
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & mask
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & mask
    h = h ^ (h >> 16)
    return (1 - 2 * ((h >> 31) & 1)).to(torch.float32)


def hadamard_scale(group_size: int) -> float:
    """``1 / sqrt(S)`` rounded to fp32 (as a Python float holding that fp32 value)."""
    return float(torch.tensor(1.0 / math.sqrt(group_size), dtype=torch.float32))


def _butterfly(groups: torch.Tensor) -> torch.Tensor:
    size = groups.shape[-1]
    out = groups
    half = 1
    while half < size:
        view = out.reshape(*out.shape[:-1], size // (2 * half), 2, half)
        a, b = view[..., 0, :], view[..., 1, :]
        out = torch.stack((a + b, a - b), dim=-2).reshape(groups.shape)
        half *= 2
    return out


def rotate(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """fp32 ``(..., n)`` with ``n % group_size == 0``: every group rotated, ``H (d * x) * s``."""
    groups = x.reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)
    out = _butterfly(groups * hadamard_signs(group_size, x.device)) * hadamard_scale(group_size)
    return out.reshape(x.shape)


def unrotate(y: torch.Tensor, group_size: int) -> torch.Tensor:
    """Inverse of :func:`rotate`: ``d * (H y) * s`` per group."""
    groups = y.reshape(*y.shape[:-1], y.shape[-1] // group_size, group_size)
    out = (_butterfly(groups) * hadamard_scale(group_size)) * hadamard_signs(group_size, y.device)
    return out.reshape(y.shape)
