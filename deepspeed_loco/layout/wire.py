"""Byte layout of one bucket on the wire: per row, the packed data of all parameters, then their fp32 scales; and
what one gradient element costs on a hop's wire."""
from dataclasses import dataclass
from typing import Sequence, Tuple

import torch

from deepspeed_loco.layout.partition import SCALE_BYTES, packed_bytes


@dataclass(frozen=True)
class WireLayout:
    """Parameter ``i`` occupies columns ``[offsets[i], offsets[i] + widths[i])`` (all multiples of the group size).

    A row of ``row_bytes`` bytes holds ``columns * bits // 8`` bytes of packed values, then ``columns //
    group_size`` fp32 scales: one buffer, so one collective carries values and scales together.
    """
    widths: Tuple[int, ...]
    bits: int
    group_size: int

    @property
    def columns(self) -> int:
        return sum(self.widths)

    @property
    def data_bytes(self) -> int:
        return packed_bytes(self.columns, self.bits)

    @property
    def row_bytes(self) -> int:
        return self.data_bytes + self.columns // self.group_size * SCALE_BYTES

    def offsets(self) -> Sequence[int]:
        out, total = [], 0
        for width in self.widths:
            out.append(total)
            total += width
        return out

    def empty(self, rows: int, device: torch.device) -> torch.Tensor:
        return torch.empty(rows, self.row_bytes, dtype=torch.uint8, device=device)

    def check_buffer(self, buffer: torch.Tensor, name: str = "") -> None:
        """ValueError naming ``name`` unless ``buffer`` is 2-D with rows of contiguous bytes (the scales are viewed
        in place as fp32): what every implementation of the ops requires of a wire buffer."""
        if buffer.dim() != 2 or (buffer.shape[1] > 1 and buffer.stride(1) != 1):
            raise ValueError(f"wire buffer{' ' + name if name else ''}: expected rows of contiguous bytes (uint8, "
                             f"shape (rows, {self.row_bytes}), unit stride along a row), got shape "
                             f"{tuple(buffer.shape)} strides {buffer.stride()}")

    def views(self, buffer: torch.Tensor, index: int, offset: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Parameter ``index``'s ``(data uint8 (rows, width*bits//8), scale fp32 (rows, width//group_size))``;
        ValueError for a ``buffer`` :meth:`check_buffer` refuses."""
        self.check_buffer(buffer)
        width = self.widths[index]
        data = buffer[:, packed_bytes(offset, self.bits):packed_bytes(offset + width, self.bits)]
        scales = buffer[:, self.data_bytes:].view(torch.float32)
        first = offset // self.group_size
        return data, scales[:, first:first + width // self.group_size]


def wire_bytes_per_element(bits: int, group_size: int) -> float:
    """Bytes one gradient element costs on a hop's wire: ``bits / 8`` of packed value plus its share of the group's
    fp32 scale, ``4 / group_size``. Exact for whole groups, which is all a hop ever sends."""
    return bits / 8 + SCALE_BYTES / group_size


def describe_hop_cost(bits: int, group_size: int) -> str:
    """A hop's cost for the start-up line, e.g. ``"0.516 B (4-bit + fp32 scale/256)"``."""
    return f"{wire_bytes_per_element(bits, group_size):.3f} B ({bits}-bit + fp32 scale/{group_size})"
