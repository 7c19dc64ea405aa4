"""DeepSpeed op builder of LoCo's fused CUDA kernels (``deepspeed_loco/csrc/quantization/``: ``loco_kernels.cu``,
``loco_kernels_own.cu`` (the kernels with an exact own block, compiled in parallel) and ``loco_binding.cpp``, headers
``loco_kernels.cuh``, ``loco_formats.h`` and ``loco_limits.h``).

``LocoBuilder().load()`` JIT-compiles the op with ninja through DeepSpeed's ``CUDAOpBuilder`` (so it honours
``TORCH_CUDA_ARCH_LIST``, ``DS_NVCC_THREADS`` and DeepSpeed's build cache) and returns the extension module
``loco_ops``, whose loading registers the CUDA implementations of the ``deepspeed_loco`` ops
(``deepspeed_loco.ops.library``) and which exports ``limits``. DeepSpeed's default ``--use_fast_math`` is removed and
fp32 contraction, flush-to-zero and approximate division are switched off: the kernels are bit-identical to
``deepspeed_loco.ops.loco_reference`` only under IEEE fp32 arithmetic (the source refuses fast math).
"""
from pathlib import Path
from typing import List

from deepspeed.ops.op_builder.builder import CUDAOpBuilder

_SOURCES = ("loco_kernels.cu", "loco_kernels_own.cu", "loco_binding.cpp")
_HEADERS = ("loco_kernels.cuh", "loco_formats.h", "loco_limits.h")
_IEEE_NVCC_FLAGS = ["-fmad=false", "-ftz=false", "-prec-div=true", "-prec-sqrt=true"]


def csrc_dir() -> Path:
    """``deepspeed_loco/csrc/quantization``: the kernel sources and header, package data of the installed package
    (wheel, sdist, editable or source checkout alike)."""
    root = Path(__file__).resolve().parents[2] / "csrc" / "quantization"
    missing = [name for name in _SOURCES + _HEADERS if not (root / name).is_file()]
    if missing:
        raise FileNotFoundError(f"LoCo kernel sources {missing} not found in {root} (an install without its package "
                                f"data?)")
    return root


class LocoBuilder(CUDAOpBuilder):
    """Builds ``loco_ops`` (see the module docstring)."""
    BUILD_VAR = "DS_BUILD_LOCO"
    NAME = "loco_ops"

    def __init__(self, name=None):
        super().__init__(name=self.NAME if name is None else name)

    def absolute_name(self) -> str:
        return f"deepspeed_loco.ops.{self.NAME}"

    def sources(self) -> List[str]:
        root = csrc_dir()
        return [str(root / name) for name in _SOURCES]

    def include_paths(self) -> List[str]:
        return [str(csrc_dir())]

    def nvcc_args(self) -> List[str]:
        args = [arg for arg in super().nvcc_args() if arg != "--use_fast_math"]
        return args + _IEEE_NVCC_FLAGS if args else args

    def cxx_args(self) -> List[str]:
        return super().cxx_args() + ["-fno-fast-math"]

