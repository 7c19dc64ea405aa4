"""LoCo's kernels: the ``deepspeed_loco`` ops (:mod:`~deepspeed_loco.ops.library`), their PyTorch reference
(``loco_reference``) and, for CUDA tensors, the fused CUDA kernels (``loco_cuda``).

:func:`kernels_for` is the one dispatch point of the reducer: it returns the :class:`Kernels` (bucket entry points
``quantize_bucket_``, ``requantize_bucket_``, ``final_mean_bucket`` with ``loco_reference``'s signatures) for tensors
on a device: :data:`CUDA` (the ops' entry points, which run the fused kernels, ``loco_cuda``, when the ``loco_ops``
extension builds and loads: tried once per process, built with ninja by ``op_builder.LocoBuilder``) or
:data:`REFERENCE` (``loco_reference``'s own entry points: every device but CUDA, and CUDA with the reference chosen;
the ops' non-CUDA implementation computes the same bits, and stays for ``torch.compile`` and direct op calls). The
choice is logged once per device type (logger ``deepspeed_loco``, INFO), with the reason, on rank 0 (a CUDA
extension that failed to build or load: on each rank where it failed, naming the rank).

The choice, ``zeropp_loco_param.kernels`` (the ``mode`` argument; ``docs/config.md``):
    ``auto`` (default): the CUDA kernels when they load, else the reference, saying why.
    ``reference``: always the PyTorch reference (for A/B checks and debugging).
    ``cuda``: the CUDA kernels for CUDA tensors; failing to build or load them is an error.

Environment: ``DS_LOCO_KERNELS``, when set to one of those, overrides the config key (logged once).
"""
import os
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from deepspeed_loco.config import KERNEL_CHOICES
from deepspeed_loco.ops import library, loco_cuda, loco_reference
from deepspeed_loco.utils.logging import log_rank0, logger

ENV_VAR = "DS_LOCO_KERNELS"
CONFIG_KEY = "zeropp_loco_param.kernels"


@dataclass(frozen=True)
class Kernels:
    """The bucket entry points the reducer calls (``loco_reference``'s signatures), and ``gather_sample``, the
    live rho's sample gather (:func:`loco_reference.gather_sample`). ``name``: what computes,
    ``"loco_reference"`` or ``"loco_cuda"`` (the start-up line and the benchmarks report it)."""
    name: str
    quantize_bucket_: Callable[..., None]
    requantize_bucket_: Callable[..., None]
    final_mean_bucket: Callable[..., List[torch.Tensor]]
    gather_sample: Callable[..., torch.Tensor]


REFERENCE = Kernels("loco_reference", loco_reference.quantize_bucket_, loco_reference.requantize_bucket_,
                    loco_reference.final_mean_bucket, loco_reference.gather_sample)  # the one route to the reference
CUDA = Kernels("loco_cuda", library.quantize_bucket_, library.requantize_bucket_, library.final_mean_bucket,
               loco_cuda.gather_sample)  # the ops, on CUDA tensors: the fused kernels (the sample: one launch)

_load_error: Optional[Tuple[Optional[BaseException]]] = None  # (None,) loaded; (exception,) failed; None: not tried
_logged: Dict[str, str] = {}


def kernels_for(device: torch.device, mode: str = "auto") -> Kernels:
    """The bucket entry points for tensors on ``device``; ``mode``: ``zeropp_loco_param.kernels`` (``ENV_VAR``
    overrides it when set). ValueError for an invalid mode; RuntimeError for ``cuda`` without the CUDA kernels."""
    device = torch.device(device)
    mode, source = _mode(mode)
    if device.type != "cuda":
        _log_once(device.type, f"deepspeed_loco: PyTorch reference kernels for {device.type} tensors "
                  f"(the fused op is CUDA-only)")
        return REFERENCE
    if mode == "reference":
        _log_once("cuda", f"deepspeed_loco: PyTorch reference kernels for CUDA tensors ({source}=reference)")
        return REFERENCE
    error = _cuda_load_error()
    if error is None:
        _log_once("cuda", "deepspeed_loco: fused CUDA kernels (loco_ops) for CUDA tensors")
        return CUDA
    if mode == "cuda":
        raise RuntimeError(f"{source}=cuda but the loco_ops CUDA extension did not build or load") from error
    _log_once("cuda", f"deepspeed_loco: PyTorch reference kernels for CUDA tensors: the loco_ops CUDA extension did "
              f"not build or load ({type(error).__name__}: {error})", every_rank=True)
    return REFERENCE


def _mode(configured: str) -> Tuple[str, str]:
    """``(mode, where it came from)``: the environment variable when set, else the config key; validated."""
    override = os.environ.get(ENV_VAR, "").strip().lower()
    mode, source = (override, ENV_VAR) if override else (configured, CONFIG_KEY)
    if mode not in KERNEL_CHOICES:
        raise ValueError(f"{source}={mode!r} is invalid: it must be one of {KERNEL_CHOICES}")
    if override and override != configured:
        _log_once("override", f"deepspeed_loco: {ENV_VAR}={override} overrides {CONFIG_KEY}={configured!r}")
    return mode, source


def _cuda_load_error() -> Optional[BaseException]:
    """None when the ``loco_ops`` extension loads, else why not; tried once per process."""
    global _load_error
    if _load_error is None:
        try:
            loco_cuda.load()
            _load_error = (None, )
        except Exception as exc:  # a failed build or load of the optional op: the caller says why
            _load_error = (exc, )
    return _load_error[0]


def _log_once(key: str, message: str, every_rank: bool = False) -> None:
    """Logs ``message`` once per process for ``key`` (again only if it changes): on rank 0 only, as the choice is
    the job's; with ``every_rank``, on each rank, named (a build or load that failed is the rank's own)."""
    if _logged.get(key) == message:
        return
    _logged[key] = message
    if every_rank and torch.distributed.is_initialized():
        logger.info(f"rank {torch.distributed.get_rank()}: {message}")
    else:
        log_rank0(message)


def _reset() -> None:
    """Forgets the load attempt and what was logged (tests)."""
    global _load_error
    _load_error = None
    _logged.clear()
