"""The CUDA binding's checks, run in a process of their own (``python -m tests.unit.ops.binding_checks``, from the
repository root, on a machine with a GPU): ``test_loco_kernels.py`` runs this module in a subprocess, so that a check
that kills the process (as one did on the GPU image, deepspeed_loco/csrc/quantization/README.md) fails that test instead of ending the test run.

Each case calls a ``deepspeed_loco`` op with at least one CUDA tensor (so the dispatcher picks the kernels) and one
bad argument, size or tensor, straight into the binding (no Python check runs first). Tensors the kernels cannot take
(on the host, of another dtype, without unit stride along their rows) are errors like any other: the kernels never
hand a call to the reference. Before a case the module prints ``start <name>``, after it one JSON line ``{"case",
"raised", "message"}``; last, ``done``.
"""
import json

import torch

from deepspeed_loco.layout import limits
from deepspeed_loco.ops import loco_cuda
from deepspeed_loco.ops.error_buffer import ErrorBuffer

OPS = torch.ops.deepspeed_loco
GROUP = 32
WORLD = 2
NUMEL = 500  # P = 250, P' = 256: a 4-bit wire row of 128 bytes of values and 8 fp32 scales, 160 bytes


def _hop1(**change):
    """quantize_bucket with valid CUDA arguments, ``change`` replacing some of them."""
    args = dict(grads=[torch.randn(NUMEL, device="cuda")], error_values=[], error_scales=[],
                send=torch.zeros(WORLD, 160, dtype=torch.uint8, device="cuda"), world_size=WORLD, local_size=WORLD,
                bits=4, group_size=GROUP, err_beta=0.8, hadamard=False, grid="symmetric", stats=None, own=-1,
                own_out=None)
    args.update(change)
    OPS.quantize_bucket(*args.values())


def _hop2(**change):
    """requantize_bucket of one 256-column parameter (W = 4 = 2 x 2), ``change`` replacing some arguments."""
    args = dict(recv=torch.zeros(4, 160, dtype=torch.uint8, device="cuda"), error_values=[], error_scales=[],
                send=torch.zeros(2, 160, dtype=torch.uint8, device="cuda"), widths=[256], world_size=4, local_size=2,
                bits=4, in_bits=4, in_blocks=2, group_size=GROUP, err_beta=0.8, grid="symmetric", stats=None,
                own_in=None, in_own=-1, own=-1, own_out=None)
    args.update(change)
    OPS.requantize_bucket(*args.values())


def _final(**change):
    args = dict(recv=torch.zeros(1, 160, dtype=torch.uint8, device="cuda"), numels=[NUMEL], world_size=WORLD, bits=4,
                group_size=GROUP, hadamard=False, grid="symmetric", rank=0, out_dtype=torch.float32, stats=None,
                own_in=None, in_own=-1)
    args.update(change)
    return OPS.final_mean_bucket(*args.values())


def _sample(**change):
    args = dict(tensors=[torch.randn(10, device="cuda")], owners=torch.zeros(2, dtype=torch.int32),
                coords=torch.tensor([0, 9]), scales=torch.ones(1))
    args.update(change)
    return OPS.gather_sample(*args.values())


def _int8_error(rows=WORLD, cols=256):
    return ErrorBuffer.zeros(rows, cols, GROUP, 8, "cuda")


HALF_BUCKET = limits.MAX_PARAMETER_PAIRS // 2 * GROUP  # a parameter within the limit on 2 rows; 3 exceed a launch's
CASES = {  # name: (the call, the message it must raise, a regular expression)
    "group_size": (lambda: _hop1(group_size=48, send=torch.zeros(2, 150, dtype=torch.uint8, device="cuda")),
                   r"LoCo kernels: group_size = 48 must be a power of two from 32 to 4096"),
    "bits": (lambda: _hop1(bits=5), r"LoCo kernels: bits = 5 must be 2, 3, 4 or 8"),
    "err_beta": (lambda: _hop1(err_beta=1.0), r"LoCo kernels: err_beta = 1 must satisfy 0 <= err_beta < 1"),
    "grid": (lambda: _hop1(grid="uniform"), r"LoCo kernels: grid = 'uniform' must be one of 'symmetric', 'midrise'"),
    "world": (lambda: _hop1(world_size=6, local_size=4),
              r"LoCo kernels: world_size = 6 must be a positive multiple of local_size = 4"),
    "send_shape": (lambda: _hop1(send=torch.zeros(2, 8, dtype=torch.uint8, device="cuda")),
                   r"LoCo kernels: send must have shape \(2, 160\), got \[2, 8\]"),
    "error_dtype": (lambda: _hop1(error_values=[torch.zeros(2, 256, dtype=torch.float16, device="cuda")]),
                    r"LoCo kernels: error values of dtype Half: an error buffer holds "),
    "error_scales": (lambda: _hop1(error_values=[_int8_error().values]),
                     r"LoCo kernels: 0 error scales for 1 scaled error buffers"),
    "send_on_host": (lambda: _hop1(send=torch.zeros(WORLD, 160, dtype=torch.uint8)),
                     r"LoCo kernels: send must be a CUDA tensor \(the kernels run on CUDA tensors only\), got one on "
                     r"cpu"),
    "error_on_host": (lambda: _hop1(error_values=[_int8_error().values.cpu()], error_scales=[_int8_error().scale]),
                      r"LoCo kernels: error values must be on cuda:\d+, got cpu"),
    "error_stride": (lambda: _hop1(error_values=[torch.zeros(2, 512, dtype=torch.int8, device="cuda")[:, ::2]],
                                   error_scales=[_int8_error().scale]),
                     r"LoCo kernels: error values must have unit stride along a row, got strides \[512, 2\]"),
    "grad_dtype": (lambda: _hop1(grads=[torch.randn(NUMEL, dtype=torch.float64, device="cuda")]),
                   r"LoCo kernels: grad must be float32, float16 or bfloat16, got Double"),
    "grad_dtypes": (lambda: _hop1(grads=[torch.randn(NUMEL, device="cuda"), torch.randn(NUMEL, device="cuda").half()],
                                  send=torch.zeros(WORLD, 320, dtype=torch.uint8, device="cuda")),
                    r"LoCo kernels: the gradients of a bucket must share one dtype, got Float and Half"),
    "stats": (lambda: _hop1(stats=torch.zeros(2, device="cuda")), r"LoCo kernels: stats must be float64 \(2,\)"),
    "in_bits": (lambda: _hop2(in_bits=7), r"LoCo kernels: in_bits = 7 must be 2, 3, 4 or 8"),
    "rank": (lambda: _final(rank=2), r"LoCo kernels: rank = 2 must be in \[0, 2\)"),
    "out_dtype": (lambda: _final(out_dtype=torch.float64),
                  r"LoCo kernels: out_dtype must be float32, float16 or bfloat16, got Double"),
    "parameter_pairs": (lambda: _final(numels=[(limits.MAX_PARAMETER_PAIRS + 1) * GROUP], world_size=1),
                        rf"LoCo kernels: numels\[0\] has 1 x {limits.MAX_PARAMETER_PAIRS + 1} = \d+ \(row, group\) "
                        rf"pairs on this hop, above kMaxParameterPairs = {limits.MAX_PARAMETER_PAIRS}"),
    "launch_pairs": (lambda: _hop2(widths=[HALF_BUCKET] * 3),
                     rf"LoCo kernels: the bucket of widths \(3 tensors\) has \d+ \(row, group\) pairs on this hop, "
                     rf"above kMaxLaunchPairs = {limits.MAX_LAUNCH_PAIRS}"),
    "own_range": (lambda: _hop1(own=2, own_out=torch.zeros(1, 256, device="cuda")),
                  r"LoCo kernels: own = 2 must be -1 \(no exact own block\) or in \[0, 2\)"),
    "own_out_missing": (lambda: _hop1(own=0), r"LoCo kernels: own_out is required with own = 0"),
    "own_out_shape": (lambda: _hop1(own=1, own_out=torch.zeros(2, 256, device="cuda")),
                      r"LoCo kernels: own_out must have shape \(1, 256\), got \[2, 256\]"),
    "own_in_unasked": (lambda: _hop2(own_in=torch.zeros(2, 256, device="cuda")),
                       r"LoCo kernels: own_in must be None with in_own = -1"),
    "own_in_on_host": (lambda: _hop2(in_own=1, own_in=torch.zeros(2, 256)),
                       r"LoCo kernels: own_in must be on cuda:\d+, got cpu"),
    "own_in_one_row": (lambda: _final(in_own=0, own_in=torch.zeros(1, 256, device="cuda")),
                       r"LoCo kernels: in_own = 0 needs at least 2 received blocks to sum, got 1"),
    "sample_owner": (lambda: _sample(owners=torch.tensor([0, 3], dtype=torch.int32)),
                     r"LoCo sample: owners\[1\] = 3 must be in \[0, 1\)"),
    "sample_coords": (lambda: _sample(coords=torch.tensor([0, 9], device="cuda")),
                      r"LoCo sample: coords must be a contiguous CPU Long tensor of 2 elements"),
    "sample_dtype": (lambda: _sample(tensors=[torch.randn(10, dtype=torch.float64, device="cuda")]),
                     r"LoCo kernels: a sampled tensor must be float32, float16 or bfloat16, got Double"),
    "sample_on_host": (lambda: _sample(tensors=[torch.randn(10), torch.randn(10, device="cuda")],
                                       scales=torch.ones(2)),
                       r"LoCo kernels: a sampled tensor must be a CUDA tensor \(the kernels run on CUDA tensors "
                       r"only\), got one on cpu"),
}


def main():
    loco_cuda.load()
    for name, (call, _) in CASES.items():
        print(f"start {name}", flush=True)
        try:
            call()
            torch.cuda.synchronize()
            result = {"case": name, "raised": None, "message": ""}
        except Exception as exc:  # every exception is reported: the parent test judges it
            result = {"case": name, "raised": type(exc).__name__, "message": str(exc).splitlines()[0]}
        print(json.dumps(result), flush=True)
    print("done", flush=True)


if __name__ == "__main__":
    main()
