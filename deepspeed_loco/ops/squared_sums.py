"""Sums of squares over many tensors in a few kernel launches: what the telemetry's error norm reads on a measured
step (every gradient and every error buffer of a bucket). The tensors are read in runs of at most
:data:`RUN_VALUES` values (slices of consecutive tensors, concatenated, or viewed as one where they lie back to back
in memory; a larger tensor is read in slices), so the number of launches follows the bytes read, not the number of
parameters; nothing synchronizes with the host.

A scaled error buffer (int8 or 4-bit codes with one fp32 scale per group) is never dequantized: its squared norm is
``sum_g scale_g^2 * sum_(i in g) code_i^2``, the codes' squares summed per group (a 4-bit byte's two through a
256-entry table), exact in fp64.
"""
from functools import lru_cache
from typing import Iterator, List, Sequence, Tuple

import torch

from deepspeed_loco.layout.formats import ErrorStorage
from deepspeed_loco.ops.error_buffer import ErrorBuffer
from deepspeed_loco.ops.quantizer import unpack

RUN_VALUES = 1 << 24  # values one run of launches reads at most


def runs(lengths: Sequence[int], limit: int, align: int = 1) -> Iterator[List[Tuple[int, int, int]]]:
    """Consecutive ranges ``(index, start, stop)`` of sequences of ``lengths`` (each a multiple of ``align``),
    grouped into runs of at most ``limit`` elements; every range starts and stops on a multiple of ``align``, and a
    sequence longer than a run is split over several. ValueError when ``limit < align``."""
    if align < 1 or limit < align:
        raise ValueError(f"runs: limit {limit} must be at least align {align} (>= 1)")
    room = limit // align * align
    run: List[Tuple[int, int, int]] = []
    size = 0
    for index, length in enumerate(lengths):
        start = 0
        while start < length:
            if size == room:
                yield run
                run, size = [], 0
            take = min(length - start, room - size)
            run.append((index, start, start + take))
            size += take
            start += take
    if run:
        yield run


def _back_to_back(pieces: Sequence[torch.Tensor]) -> bool:
    """Whether 1-D unit-stride ``pieces`` of one dtype lie back to back in one storage, so that one view spans them
    (a bucket's gradients in DeepSpeed's contiguous gradient buffer do)."""
    first = pieces[0]
    end = first.storage_offset()
    for piece in pieces:
        if (piece.dtype != first.dtype or piece.stride() != (1,) or piece.storage_offset() != end
                or piece.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()):
            return False
        end += piece.numel()
    return True


def _joined(flats: Sequence[torch.Tensor], ranges: Sequence[Tuple[int, int, int]], step: int = 1) -> torch.Tensor:
    """The slices ``flats[i][start // step:stop // step]`` of ``ranges`` as one 1-D tensor: a view where they lie
    back to back in memory (or are one), else their concatenation (a copy)."""
    pieces = [flats[index] if start == 0 and stop == len(flats[index]) * step else
              flats[index][start // step:stop // step] for index, start, stop in ranges]
    if len(pieces) == 1:
        return pieces[0]
    if _back_to_back(pieces):
        return pieces[0].as_strided((sum(piece.numel() for piece in pieces),), (1,))
    return torch.cat(pieces)


def squared_sum(tensors: Sequence[torch.Tensor], device, limit: int = RUN_VALUES) -> torch.Tensor:
    """``sum ||t||^2`` over floating ``tensors`` of one dtype, an fp64 scalar on ``device`` (zero for none): each
    run's norm in fp32, their squares summed in fp64. The tensors are read in memory order (the sum does not depend
    on it), so that views of one buffer in any order, like a bucket's gradients in DeepSpeed's contiguous gradient
    buffer, are read through one view, not copied."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    flats = sorted((t.reshape(-1) for t in tensors), key=lambda f: (f.untyped_storage().data_ptr(), f.storage_offset()))
    for run in runs([f.numel() for f in flats], limit):
        total += torch.linalg.vector_norm(_joined(flats, run), dtype=torch.float32).double().square()
    return total


@lru_cache(maxsize=None)
def _nibble_squares(device: str) -> torch.Tensor:
    """int16 ``(256,)``: for every byte of 4-bit storage, the sum of the squares of its two signed codes, decoded by
    the storage's own :func:`~deepspeed_loco.ops.quantizer.unpack` (each byte the first of a 4-byte word)."""
    words = torch.zeros(256, 4, dtype=torch.uint8)
    words[:, 0] = torch.arange(256, dtype=torch.uint8)
    return unpack(words, 4)[:, :2].to(torch.int16).square().sum(1, dtype=torch.int16).to(device)


def _code_squares(codes: torch.Tensor, storage: ErrorStorage) -> torch.Tensor:
    """int16, exact: the squared codes of 1-D stored ``codes`` per stored element (a 4-bit byte's two codes summed;
    at most 2 * 8^2 = 128, and 127^2 = 16129 for int8), two bytes a value where fp32 took four."""
    if storage is ErrorStorage.INT4:
        return _nibble_squares(str(codes.device)).index_select(0, codes.int())
    return codes.to(torch.int16).square()


def error_squared_sum(buffers: Sequence[ErrorBuffer], device, limit: int = RUN_VALUES) -> torch.Tensor:
    """``sum ||e||^2`` over the errors ``buffers`` hold (any storages, one group size), an fp64 scalar on
    ``device`` (zero for none), without dequantizing them."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for storage in dict.fromkeys(b.storage for b in buffers):  # each storage once, in first-seen order
        same = [b for b in buffers if b.storage is storage]
        if not storage.scaled:
            total += squared_sum([b.values for b in same], device, limit)
            continue
        group_bytes = same[0].group_size // storage.format.per_element
        codes = [b.values.reshape(-1) for b in same]
        scales = [b.scale.reshape(-1) for b in same]
        for run in runs([c.numel() for c in codes], max(limit // storage.format.per_element, group_bytes),
                        group_bytes):
            squares = _code_squares(_joined(codes, run), storage)
            per_group = squares.view(-1, group_bytes).sum(1, dtype=torch.float64)
            total += torch.dot(per_group, _joined(scales, run, group_bytes).double().square())
    return total
