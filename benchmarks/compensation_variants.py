"""Experiments on LoCo's compensation rule (issue 21 item 3), run on the PyTorch reference kernels only.

The library's rule (``deepspeed_loco.ops.loco_reference.compensate_and_quantize``): ``c = x + e``, quantized on
``c``'s own group scale, ``e <- beta*e + (1-beta)*(c - deq)``. A variant here replaces that one function for the
life of the process and forces the reference kernels (``DS_LOCO_KERNELS=reference``: the CUDA kernels do not
know it), so a ``convergence_sim.py run --variant NAME`` measures the rule alone. None of these is a library option:
by the issue's rule one ships only if it wins across seeds on both model sizes and on two texts.

``bounded``: ``c = x + e`` is clipped to the group range of ``x`` alone (``[-absmax x, absmax x]``, plain qgZ's
range) before it is quantized, so no value sent exceeds what plain qgZ would send for that group; the clipped part
stays in the residual ``c - deq`` and so in the buffer, released at most one group range per step. Aimed at LoCo's
early burst (``RESULTS.md``, "Why LoCo loses where it loses"): a buffer holding residuals of the larger gradients
of the first steps no longer sends several times the true gradient at once.
"""
import os
from typing import Optional

import torch

from deepspeed_loco.ops import loco_reference
from deepspeed_loco.ops.error_buffer import ErrorBuffer
from deepspeed_loco.ops.quantizer import dequantize_groups, quantize_groups
from deepspeed_loco.utils.logging import logger

LIBRARY_RULE = loco_reference.compensate_and_quantize


def group_range(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """fp32 ``(rows, n)``: each element's group absmax of ``x`` ``(rows, n)`` (``n % group_size == 0``)."""
    groups = x.reshape(x.shape[0], -1, group_size)
    return groups.abs().amax(dim=-1, keepdim=True).expand_as(groups).reshape(x.shape)


def bounded(x: torch.Tensor, error: Optional[ErrorBuffer], beta: float, bits: int, group_size: int,
            grid: str = "symmetric", stats: Optional[torch.Tensor] = None):
    """``compensate_and_quantize``'s contract (fp32 ``x`` ``(rows, n)`` to int8 codes and fp32 group scales, the
    error updated in place, ``stats[1]`` gaining ``||x + e - deq||^2``), with ``x + e`` clipped to ``x``'s group range
    before quantizing (module docstring)."""
    if error is None:
        return LIBRARY_RULE(x, None, beta, bits, group_size, grid, stats)
    limit = group_range(x, group_size)
    remembered = error.dequantize()
    compensated = x + remembered
    codes, scale = quantize_groups(torch.minimum(torch.maximum(compensated, -limit), limit), bits, group_size, grid)
    keep = torch.tensor(beta, dtype=torch.float32, device=x.device)
    residual = compensated - dequantize_groups(codes, scale, group_size, grid)
    if stats is not None:
        stats[1] += residual.pow(2).sum()
    error.store_(remembered * keep + residual * (1 - keep))
    return codes, scale


VARIANTS = {"bounded": bounded}
CHOICES = ("none", *VARIANTS)


def install(name: str) -> None:
    """Makes ``name`` (one of ``CHOICES``) the compensation rule of this process and forces the reference kernels;
    ``"none"`` leaves the library as it is. ValueError for an unknown name."""
    if name not in CHOICES:
        raise ValueError(f"--variant {name!r}: must be one of {CHOICES}")
    if name == "none":
        return
    os.environ["DS_LOCO_KERNELS"] = "reference"
    loco_reference.compensate_and_quantize = VARIANTS[name]
    logger.info(f"compensation variant {name!r} installed: PyTorch reference kernels only (DS_LOCO_KERNELS=reference)")
