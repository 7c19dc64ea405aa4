"""Apex's fused layer and RMS norms as ``torch.nn.functional`` (see ``apex/__init__.py``)."""
import numbers

import torch
import torch.nn.functional as F


class FusedLayerNormAffineFunction:
    """``FusedLayerNormAffineFunction.apply(input, weight, bias, normalized_shape, eps[, memory_efficient])``:
    ``F.layer_norm``; autograd differentiates it. ``forward`` carries Apex's signature, which Megatron inspects."""

    @staticmethod
    def forward(ctx, input, weight, bias, normalized_shape, eps, memory_efficient=False):
        return F.layer_norm(input, tuple(normalized_shape), weight, bias, eps)

    @staticmethod
    def apply(input, weight, bias, normalized_shape, eps, memory_efficient=False):
        return F.layer_norm(input, tuple(normalized_shape), weight, bias, eps)


def _shape(normalized_shape):
    return (normalized_shape,) if isinstance(normalized_shape, numbers.Integral) else tuple(normalized_shape)


class FusedLayerNorm(torch.nn.LayerNorm):

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, **_):
        super().__init__(_shape(normalized_shape), eps=eps, elementwise_affine=elementwise_affine)


MixedFusedLayerNorm = FusedLayerNorm


class FusedRMSNorm(torch.nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last ``len(normalized_shape)`` dimensions, in float32."""

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, **_):
        super().__init__()
        self.normalized_shape = _shape(normalized_shape)
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(self.normalized_shape)) if elementwise_affine else None

    def forward(self, input):
        dims = tuple(range(-len(self.normalized_shape), 0))
        x = input.float()
        out = (x * torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + self.eps)).to(input.dtype)
        return out if self.weight is None else out * self.weight


MixedFusedRMSNorm = FusedRMSNorm
