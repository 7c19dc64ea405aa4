"""LoCo's kernels: the pure-PyTorch reference (``loco_reference``) and, for CUDA tensors, the fused CUDA op.

:func:`kernels_for` returns a module with the bucket entry points ``quantize_bucket_``, ``requantize_bucket_``
and ``final_mean_bucket`` (``loco_reference``'s signatures; one kernel launch each in ``loco_cuda``): ``loco_cuda``
for CUDA devices when the ``loco_ops`` extension builds and loads (tried once per process, built with ninja by
``op_builder.LocoBuilder``), ``loco_reference`` otherwise. The choice is logged once
per device type (logger ``deepspeed_loco``, INFO), with the reason.

Environment:

``DS_LOCO_KERNELS``
    ``auto`` (default): the CUDA kernels when they load, else the reference, saying why.
    ``reference``: always the PyTorch reference (for A/B checks and debugging).
    ``cuda``: the CUDA kernels for CUDA tensors; failing to build or load them is an error.
"""
import os
from types import ModuleType
from typing import Dict, Optional, Tuple

import torch

from deepspeed_loco.ops import loco_reference
from deepspeed_loco.utils.logging import logger

ENV_VAR = "DS_LOCO_KERNELS"
_MODES = ("auto", "reference", "cuda")
_cuda_choice: Optional[Tuple[ModuleType, str]] = None
_logged: Dict[str, str] = {}


def kernels_for(device: torch.device) -> ModuleType:
    """The implementation of the bucket entry points for tensors on ``device``."""
    device = torch.device(device)
    if device.type != "cuda":
        _log_once(device.type, f"deepspeed_loco: PyTorch reference kernels for {device.type} tensors "
                  f"(the fused op is CUDA-only)")
        return loco_reference
    module, message = _cuda_kernels()
    _log_once("cuda", message)
    return module


def _mode() -> str:
    mode = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if mode not in _MODES:
        raise ValueError(f"{ENV_VAR}={mode!r} is invalid: it must be one of {_MODES}")
    return mode


def _cuda_kernels() -> Tuple[ModuleType, str]:
    """``(module, reason)`` for CUDA tensors, decided once per process."""
    global _cuda_choice
    if _cuda_choice is not None:
        return _cuda_choice
    mode = _mode()
    if mode == "reference":
        _cuda_choice = (loco_reference, f"deepspeed_loco: PyTorch reference kernels for CUDA tensors "
                        f"({ENV_VAR}=reference)")
        return _cuda_choice
    try:
        from deepspeed_loco.ops import loco_cuda
        loco_cuda.load()
    except Exception as exc:  # a failed build or load of the optional op: say why, then use the reference
        if mode == "cuda":
            raise RuntimeError(f"{ENV_VAR}=cuda but the loco_ops CUDA extension did not build or load") from exc
        _cuda_choice = (loco_reference, f"deepspeed_loco: PyTorch reference kernels for CUDA tensors: the loco_ops "
                        f"CUDA extension did not build or load ({type(exc).__name__}: {exc})")
        return _cuda_choice
    _cuda_choice = (loco_cuda, "deepspeed_loco: fused CUDA kernels (loco_ops) for CUDA tensors")
    return _cuda_choice


def _log_once(key: str, message: str) -> None:
    if _logged.get(key) != message:
        _logged[key] = message
        logger.info(message)


def _reset() -> None:
    """Forgets the cached choice and what was logged (tests)."""
    global _cuda_choice
    _cuda_choice = None
    _logged.clear()
