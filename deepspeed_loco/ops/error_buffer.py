"""Storage of one error-feedback buffer in a format of :class:`~deepspeed_loco.layout.formats.ErrorStorage`: int8
values with one fp32 scale per group, or plain fp32."""
from dataclasses import dataclass
from typing import Optional

import torch

from deepspeed_loco.layout.formats import STORED, ErrorStorage
from deepspeed_loco.ops.quantizer import dequantize_groups, quantize_groups


@dataclass
class ErrorBuffer:
    """An fp32 error array of shape ``(rows, cols)`` as stored between steps (:attr:`storage`).

    ``ErrorStorage.INT8``: ``values`` int8 ``(rows, cols)`` and ``scale`` fp32 ``(rows, cols // group_size)``,
    the error being ``values * scale`` per group (symmetric, qmax 127).
    ``ErrorStorage.FP32``: ``values`` fp32 ``(rows, cols)`` and ``scale`` is None.
    Zero means "no remembered error"; stored values are always finite.
    """
    values: torch.Tensor
    scale: Optional[torch.Tensor]
    group_size: int

    @classmethod
    def zeros(cls, rows: int, cols: int, group_size: int, storage: ErrorStorage, device) -> "ErrorBuffer":
        """A buffer of zeros stored as ``storage`` (an :class:`ErrorStorage` or its bits, ``error_bits``)."""
        storage = ErrorStorage(storage)
        if storage not in STORED:
            raise ValueError(f"an error buffer is stored as one of {[s.label for s in STORED]}, not {storage.label}")
        scale = torch.zeros(rows, cols // group_size, dtype=torch.float32, device=device) if storage.scaled else None
        return cls(torch.zeros(rows, cols, dtype=storage.values_dtype, device=device), scale, group_size)

    @property
    def storage(self) -> ErrorStorage:
        return ErrorStorage.of_values(self.values.dtype)

    @property
    def shape(self):
        return tuple(self.values.shape)

    def nbytes(self) -> int:
        scale_bytes = 0 if self.scale is None else self.scale.numel() * self.scale.element_size()
        return self.values.numel() * self.values.element_size() + scale_bytes

    def dequantize(self) -> torch.Tensor:
        """The error as fp32 ``(rows, cols)``."""
        if self.scale is None:
            return self.values
        return dequantize_groups(self.values, self.scale, self.group_size)

    def store_(self, error: torch.Tensor) -> None:
        """Stores fp32 ``error`` ``(rows, cols)``; groups holding a non-finite value are stored as zero."""
        if self.scale is None:
            groups = error.reshape(error.shape[0], -1, self.group_size)
            finite = torch.isfinite(groups).all(dim=-1, keepdim=True)
            self.values.copy_(torch.where(finite, groups, torch.zeros_like(groups)).reshape(error.shape))
            return
        q, scale = quantize_groups(error, 8, self.group_size)
        self.values.copy_(q)
        self.scale.copy_(torch.nan_to_num(scale, nan=0.0))

    def zero_(self) -> None:
        self.values.zero_()
        if self.scale is not None:
            self.scale.zero_()

    def rescale_(self, factor: float) -> None:
        """Multiplies the stored error by ``factor`` (fp16 loss-scale changes)."""
        (self.values if self.scale is None else self.scale).mul_(factor)
