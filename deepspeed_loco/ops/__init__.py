"""LoCo's kernels: the ``deepspeed_loco`` ops with their PyTorch reference (:mod:`~deepspeed_loco.ops.library`,
:mod:`~deepspeed_loco.ops.loco_reference`) and, for CUDA tensors, the fused CUDA kernels
(:mod:`~deepspeed_loco.ops.loco_cuda`). :func:`kernels_for` is the reducer's one dispatch point."""
from deepspeed_loco.ops.library import CONFIG_KEY, CUDA, ENV_VAR, REFERENCE, Kernels, kernels_for

__all__ = ["CONFIG_KEY", "CUDA", "ENV_VAR", "REFERENCE", "Kernels", "kernels_for"]
