"""How one gradient is cut into ZeRO-3 partitions, padded to whole quantization groups and ordered for hop 1.

A gradient of ``N`` elements on ``W = M * L`` ranks has partitions of ``P = ceil(N / W)`` elements (rank ``r`` owns
flat elements ``[r*P, (r+1)*P)``, zero past ``N``), each padded to ``P' = roundup(P, group_size)`` so that groups
never straddle a partition or a parameter. Partition row ``n*L + d`` is sent from slot ``d*M + n``.
"""
from typing import Sequence, Tuple

import torch

SCALE_BYTES = 4  # one fp32 scale per quantization group


def partition_size(numel: int, world_size: int) -> int:
    """ZeRO-3's partition size ``P = ceil(N / W)``."""
    return -(-numel // world_size)


def padded_partition_size(numel: int, world_size: int, group_size: int) -> int:
    """``P' = roundup(ceil(N / W), group_size)``: groups never straddle partitions or parameters."""
    return -(-partition_size(numel, world_size) // group_size) * group_size


def padded_widths(numels: Sequence[int], world_size: int, group_size: int) -> Tuple[int, ...]:
    """The padded partition widths ``P'`` of a bucket of gradients of ``numels`` elements: its wire layout's widths."""
    return tuple(padded_partition_size(n, world_size, group_size) for n in numels)


def slot_to_row(world_size: int, local_size: int) -> torch.Tensor:
    """int64 ``(W,)``: entry ``d*M + n`` is the partition row ``n*L + d`` sent from that slot."""
    nodes = world_size // local_size
    slots = torch.arange(world_size)
    return (slots % nodes) * local_size + slots // nodes


def packed_bytes(num_elements: int, bits: int) -> int:
    """Bytes that ``num_elements`` (a multiple of 8) values of ``bits`` bits take when packed."""
    assert num_elements % 8 == 0, num_elements
    return num_elements * bits // 8
