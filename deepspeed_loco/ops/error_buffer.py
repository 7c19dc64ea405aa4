"""Storage of one error-feedback buffer in a format of :class:`~deepspeed_loco.layout.formats.ErrorStorage`: 4-bit or
int8 codes with one fp32 scale per group, or plain fp32."""
from dataclasses import dataclass
from typing import Optional, Union

import torch

from deepspeed_loco.layout.formats import STORED, ErrorStorage
from deepspeed_loco.ops.quantizer import dequantize_groups, pack, quantize_groups, unpack


@dataclass
class ErrorBuffer:
    """An fp32 error array of shape ``(rows, cols)`` as stored between steps (:attr:`storage`).

    ``ErrorStorage.INT8``: ``values`` int8 ``(rows, cols)`` and ``scale`` fp32 ``(rows, cols // group_size)``,
    the error being ``values * scale`` per group (symmetric grid, qmax 127).
    ``ErrorStorage.INT4``: ``values`` uint8 ``(rows, cols // 2)``, two 4-bit codes a byte (the wire's packing, even
    column in the low nibble), and ``scale`` as for int8 (symmetric grid, qmax 7).
    ``ErrorStorage.FP32``: ``values`` fp32 ``(rows, cols)`` and ``scale`` is None.
    Zero means "no remembered error"; stored values are always finite.
    """
    values: torch.Tensor
    scale: Optional[torch.Tensor]
    group_size: int

    @classmethod
    def zeros(cls, rows: int, cols: int, group_size: int, storage: Union[ErrorStorage, int], device) -> "ErrorBuffer":
        """A buffer of zeros stored as ``storage``: a stored :class:`ErrorStorage`, or its bits (``error_bits``)."""
        if not isinstance(storage, ErrorStorage):
            storage = ErrorStorage.of_bits(storage)
        if storage not in STORED:
            raise ValueError(f"an error buffer is stored as one of {[s.label for s in STORED]}, not {storage!r}")
        scale = torch.zeros(rows, cols // group_size, dtype=torch.float32, device=device) if storage.scaled else None
        values = torch.zeros(storage.values_shape(rows, cols), dtype=storage.values_dtype, device=device)
        return cls(values, scale, group_size)

    @property
    def storage(self) -> ErrorStorage:
        return ErrorStorage.of_values(self.values.dtype)

    @property
    def shape(self):
        """The error's ``(rows, cols)`` (an int4 buffer's values hold two columns a byte)."""
        rows, width = self.values.shape
        return rows, width * self.storage.format.per_element

    def nbytes(self) -> int:
        scale_bytes = 0 if self.scale is None else self.scale.numel() * self.scale.element_size()
        return self.values.numel() * self.values.element_size() + scale_bytes

    @property
    def codes(self) -> torch.Tensor:
        """The stored codes as int8 ``(rows, cols)`` (scaled storages only)."""
        return unpack(self.values, 4) if self.storage is ErrorStorage.INT4 else self.values

    def dequantize(self) -> torch.Tensor:
        """The error as fp32 ``(rows, cols)``."""
        if self.scale is None:
            return self.values
        return dequantize_groups(self.codes, self.scale, self.group_size)

    def store_(self, error: torch.Tensor) -> None:
        """Stores fp32 ``error`` ``(rows, cols)``; groups holding a non-finite value are stored as zero."""
        if self.scale is None:
            groups = error.reshape(error.shape[0], -1, self.group_size)
            finite = torch.isfinite(groups).all(dim=-1, keepdim=True)
            self.values.copy_(torch.where(finite, groups, torch.zeros_like(groups)).reshape(error.shape))
            return
        bits = self.storage.bits
        q, scale = quantize_groups(error, bits, self.group_size)
        self.values.copy_(pack(q, bits) if bits == 4 else q)
        self.scale.copy_(torch.nan_to_num(scale, nan=0.0))

    def zero_(self) -> None:
        self.values.zero_()
        if self.scale is not None:
            self.scale.zero_()

    def rescale_(self, factor: float) -> None:
        """Multiplies the stored error by ``factor`` (fp16 loss-scale changes)."""
        (self.values if self.scale is None else self.scale).mul_(factor)
