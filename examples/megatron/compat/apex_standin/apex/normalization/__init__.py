"""``apex.normalization`` (see ``apex/__init__.py``)."""
from .fused_layer_norm import FusedLayerNorm, FusedLayerNormAffineFunction, FusedRMSNorm, MixedFusedLayerNorm, \
    MixedFusedRMSNorm

__all__ = ["FusedLayerNorm", "FusedLayerNormAffineFunction", "FusedRMSNorm", "MixedFusedLayerNorm",
           "MixedFusedRMSNorm"]
