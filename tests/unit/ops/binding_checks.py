"""The CUDA binding's checks, run in a process of their own (``python -m tests.unit.ops.binding_checks``, from the
repository root, on a machine with a GPU): ``test_loco_kernels.py`` runs this module in a subprocess, so that a check
that kills the process (as one did on the GPU image, deepspeed_loco/csrc/quantization/README.md) fails that test instead of ending the test run.

Each case calls a ``deepspeed_loco`` op on CUDA tensors with one bad argument or size, straight into the binding (no
Python check runs first). Before a case the module prints ``start <name>``, after it one JSON line ``{"case",
"raised", "message"}``; last, ``done``. A tensor the kernels do not take is not an error: the op runs the reference and
logs why once per reason, which the case ``fallback_once`` checks (its JSON line carries the log lines and whether the
outputs are the reference's).
"""
import json
import logging

import torch

from deepspeed_loco.layout import HopArgs, WireLayout, limits, padded_partition_size
from deepspeed_loco.ops import library, loco_cuda
from deepspeed_loco.ops import loco_reference as ref
from deepspeed_loco.ops.error_buffer import ErrorBuffer

OPS = torch.ops.deepspeed_loco
GROUP = 32
WORLD = 2
NUMEL = 500  # P = 250, P' = 256: a 4-bit wire row of 128 bytes of values and 8 fp32 scales, 160 bytes


def _hop1(**change):
    """quantize_bucket with valid CUDA arguments, ``change`` replacing some of them."""
    args = dict(grads=[torch.randn(NUMEL, device="cuda")], error_values=[], error_scales=[],
                send=torch.zeros(WORLD, 160, dtype=torch.uint8, device="cuda"), world_size=WORLD, local_size=WORLD,
                bits=4, group_size=GROUP, err_beta=0.8, hadamard=False, grid="symmetric", stats=None)
    args.update(change)
    OPS.quantize_bucket(*args.values())


def _hop2(**change):
    """requantize_bucket of one 256-column parameter (W = 4 = 2 x 2), ``change`` replacing some arguments."""
    args = dict(recv=torch.zeros(4, 160, dtype=torch.uint8, device="cuda"), error_values=[], error_scales=[],
                send=torch.zeros(2, 160, dtype=torch.uint8, device="cuda"), widths=[256], world_size=4, local_size=2,
                bits=4, in_bits=4, in_blocks=2, group_size=GROUP, err_beta=0.8, grid="symmetric", stats=None)
    args.update(change)
    OPS.requantize_bucket(*args.values())


def _final(**change):
    args = dict(recv=torch.zeros(1, 160, dtype=torch.uint8, device="cuda"), numels=[NUMEL], world_size=WORLD, bits=4,
                group_size=GROUP, hadamard=False, grid="symmetric", rank=0, out_dtype=torch.float32, stats=None)
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
                    r"LoCo kernels: error values of dtype Half: an error buffer holds torch.int8 or torch.float32"),
    "error_scales": (lambda: _hop1(error_values=[_int8_error().values]),
                     r"LoCo kernels: 0 error scales for 1 int8 error buffers"),
    "stats": (lambda: _hop1(stats=torch.zeros(2, device="cuda")), r"LoCo kernels: stats must be float64 \(2,\)"),
    "in_bits": (lambda: _hop2(in_bits=7), r"LoCo kernels: in_bits = 7 must be 2, 3, 4 or 8"),
    "rank": (lambda: _final(rank=2), r"LoCo kernels: rank = 2 must be in \[0, 2\)"),
    "parameter_pairs": (lambda: _final(numels=[(limits.MAX_PARAMETER_PAIRS + 1) * GROUP], world_size=1),
                        rf"LoCo kernels: numels\[0\] has 1 x {limits.MAX_PARAMETER_PAIRS + 1} = \d+ \(row, group\) "
                        rf"pairs on this hop, above kMaxParameterPairs = {limits.MAX_PARAMETER_PAIRS}"),
    "launch_pairs": (lambda: _hop2(widths=[HALF_BUCKET] * 3),
                     rf"LoCo kernels: the bucket of widths \(3 tensors\) has \d+ \(row, group\) pairs on this hop, "
                     rf"above kMaxLaunchPairs = {limits.MAX_LAUNCH_PAIRS}"),
    "sample_owner": (lambda: _sample(owners=torch.tensor([0, 3], dtype=torch.int32)),
                     r"LoCo sample: owners\[1\] = 3 must be in \[0, 1\)"),
    "sample_coords": (lambda: _sample(coords=torch.tensor([0, 9], device="cuda")),
                      r"LoCo sample: coords must be a contiguous CPU Long tensor of 2 elements"),
}


def fallback_once():
    """An int8 error buffer without unit stride along its rows, twice through hop 1: the reference's bytes and
    errors, and one WARNING line saying why."""
    lines = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("deepspeed_loco").addHandler(handler)
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(300, generator=gen).cuda(), torch.randn(70, generator=gen).cuda()]
    args = HopArgs(4, 2, 4, GROUP, 0.8)
    wire = WireLayout(tuple(padded_partition_size(g.numel(), 4, GROUP) for g in grads), 4, GROUP)
    errors = [ErrorBuffer.zeros(4, w, GROUP, 8, "cuda") for w in wire.widths]
    for e in errors:
        e.store_(torch.randn(4, e.values.shape[1], generator=gen).cuda() * 0.1)
    strided = []
    for e in errors:
        values = torch.empty((4, 2 * e.values.shape[1]), dtype=torch.int8, device="cuda")[:, ::2]
        strided.append(ErrorBuffer(values.copy_(e.values), e.scale.clone(), GROUP))
    send, want = wire.empty(4, "cuda"), wire.empty(4, "cuda")
    for _ in range(2):
        library.CUDA.quantize_bucket_(grads, strided, args, wire, send)
        ref.quantize_bucket_(grads, errors, args, wire, want)  # the reference on the same device, contiguous
    same = torch.equal(send, want) and all(
        torch.equal(s.values, e.values) and torch.equal(s.scale, e.scale) for s, e in zip(strided, errors))
    return {"case": "fallback_once", "same": same, "lines": lines}


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
    print("start fallback_once", flush=True)
    print(json.dumps(fallback_once()), flush=True)
    print("done", flush=True)


if __name__ == "__main__":
    main()
