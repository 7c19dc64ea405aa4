"""Times LoCo's fused CUDA kernels and DeepSpeed's plain qgZ kernels on one GPU (issues 4 and 8).

For gradients (4096, 4096), (8192, 8192), (16384, 16384) in bf16 and fp16, with a simulated 2 nodes x 8 GPUs
(W = 16, L = 8, M = 2), group size 256 and int8 error (beta 0.8), and per-hop bits intra/inter 4/4 and 8/2, each
without and with the Hadamard rotation (``+H``, fused into hop 1 and the final mean), prints per kernel the median time,
the bytes it must move (each input read once, each output written once), the achieved bandwidth and its fraction
of the device-to-device copy bandwidth measured in the same run, and the transient device memory (peak allocated
during the call above what was allocated before it, outputs passed in excluded). Then, on the same shapes,
DeepSpeed's own ``swizzle_quant`` and ``quantized_reduction`` (QuantizerBuilder of the installed DeepSpeed, called
as ``all_to_all_quant_reduce`` calls them; they read the gradient as fp16 whatever its dtype, so their bf16 rows
are timings only).

Inputs rotate over enough copies to exceed the L2 cache several times; times are CUDA-event medians.

    python3 benchmarks/kernels.py [--reps 50] [--configs 4/4 8/2 4/4+H 8/2+H] [--no-baseline] [--json out.json]
"""
import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepspeed_loco.ops import loco_cuda  # noqa: E402
from deepspeed_loco.ops.error_buffer import ErrorBuffer  # noqa: E402
from deepspeed_loco.layout import padded_partition_size, partition_size  # noqa: E402

SHAPES = [(4096, 4096), (8192, 8192), (16384, 16384)]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
WORLD, LOCAL, GROUP, BETA = 16, 8, 256, 0.8
CONFIGS = ("4/4", "8/2", "4/4+H", "8/2+H")  # intra/inter bits, +H: Hadamard
NODES = WORLD // LOCAL
ROTATE_BYTES = 256 << 20  # rotate inputs over at least this much (H200 L2: 50 MB)


def median_ms(fn, sets, reps, warmup=5):
    """Median over ``reps`` calls of ``fn(i)`` (``i`` cycling over ``sets`` input sets), timed with CUDA events."""
    for i in range(warmup):
        fn(i % sets)
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        starts[i].record()
        fn(i % sets)
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def transient_bytes(fn, own_output_bytes=0):
    """Peak device memory allocated during ``fn()`` beyond what was allocated before (minus its own output)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del result
    return max(0, peak - own_output_bytes)


def copy_bandwidth(reps):
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda i: dst.copy_(src), 1, reps)
    return 2 * src.numel() / (ms * 1e-3)


def copies(n_bytes):
    return max(1, min(8, math.ceil(ROTATE_BYTES / max(n_bytes, 1))))


def parse_config(text):
    """``"8/2+H"`` -> ``(8, 2, True)``."""
    hadamard = text.endswith("+H")
    intra, inter = (int(b) for b in text.removesuffix("+H").split("/"))
    return intra, inter, hadamard


def random_error(rows, cols):
    """A CUDA int8 error buffer ``(rows, cols)`` with random values and scales (timing on zeros can flatter a kernel)."""
    error = ErrorBuffer.zeros(rows, cols, GROUP, 8, "cuda")
    error.values.random_(-127, 128)
    error.scale.uniform_(0, 1e-3)
    return error


def loco_cases(shape, dtype, config):
    """``(name, fn(i), sets, bytes, transient_fn)`` for the fused kernels on one gradient shape and one
    ``config`` (see :func:`parse_config`): hop 1 sends ``intra`` bits, hop 2 ``inter`` bits."""
    intra, inter, hadamard = parse_config(config)
    numel = shape[0] * shape[1]
    es = torch.empty((), dtype=dtype).element_size()
    cols = padded_partition_size(numel, WORLD, GROUP)
    groups = cols // GROUP
    grad_bytes = numel * es
    err_bytes = lambda rows: rows * (cols + groups * 4)  # int8 values + fp32 scales
    wire_bytes = lambda rows, bits: rows * (cols * bits // 8 + groups * 4)

    hop1_set_bytes = grad_bytes + err_bytes(WORLD) + wire_bytes(WORLD, intra)
    sets = copies(hop1_set_bytes)
    grads = [torch.randn(shape, device="cuda", dtype=dtype) for _ in range(sets)]
    errors = [random_error(WORLD, cols) for _ in range(sets)]
    outs = [(torch.empty(WORLD, cols * intra // 8, dtype=torch.uint8, device="cuda"),
             torch.empty(WORLD, groups, device="cuda")) for _ in range(sets)]
    hop1 = lambda i: loco_cuda.hop1_(grads[i], WORLD, LOCAL, errors[i], BETA, intra, GROUP, *outs[i],
                                     hadamard=hadamard)
    plain1 = lambda i: loco_cuda.hop1_(grads[i], WORLD, LOCAL, None, BETA, intra, GROUP, *outs[i],
                                       hadamard=hadamard)
    cases = [
        ("loco hop1 (int8 err)", hop1, sets, grad_bytes + 2 * err_bytes(WORLD) + wire_bytes(WORLD, intra),
         lambda: transient_bytes(lambda: hop1(0))),
        ("plain hop1 (no err)", plain1, sets, grad_bytes + wire_bytes(WORLD, intra),
         lambda: transient_bytes(lambda: plain1(0))),
    ]

    # hop 2: the L received blocks (W rows in the hop-1 wire format; here the hop-1 outputs) to M rows
    for i in range(sets):
        hop1(i)
    recv = outs
    errors2 = [random_error(NODES, cols) for _ in range(sets)]
    outs2 = [(torch.empty(NODES, cols * inter // 8, dtype=torch.uint8, device="cuda"),
              torch.empty(NODES, groups, device="cuda")) for _ in range(sets)]
    hop2 = lambda i: loco_cuda.hop2_(*recv[i], LOCAL, intra, errors2[i], BETA, inter, GROUP, *outs2[i])
    cases.append(("loco hop2 (int8 err)", hop2, sets,
                  wire_bytes(WORLD, intra) + 2 * err_bytes(NODES) + wire_bytes(NODES, inter),
                  lambda: transient_bytes(lambda: hop2(0))))

    part = partition_size(numel, WORLD)
    for i in range(sets):
        hop2(i)
    final = lambda i: loco_cuda.final_mean(*outs2[i], inter, GROUP, WORLD, numel, 3, dtype, hadamard=hadamard)
    cases.append(("loco final mean", final, sets, wire_bytes(NODES, inter) + part * es,
                  lambda: transient_bytes(lambda: final(0), part * es)))
    return cases, (grads, errors, outs, errors2, outs2)


def deepspeed_cases(quantizer, shape, dtype):
    """DeepSpeed's plain qgZ kernels as ``all_to_all_quant_reduce`` calls them (4 bits, symmetric)."""
    numel = shape[0] * shape[1]
    es = torch.empty((), dtype=dtype).element_size()
    groups = max(shape[0], shape[1], WORLD)
    sets = copies(numel * es + numel // 2)
    grads = [torch.randn(shape, device="cuda", dtype=dtype) for _ in range(sets)]
    swizzle = lambda i: quantizer.swizzle_quant(grads[i], groups, 4, quantizer.Symmetric, 1, NODES, LOCAL)
    quantized = [swizzle(i) for i in range(sets)]
    reduce = lambda i: quantizer.quantized_reduction(quantized[i][0], quantized[i][1], groups, groups // LOCAL, 4,
                                                     quantizer.Symmetric, LOCAL)
    swizzle_out = numel // 2 + groups * 4
    reduce_out = numel // 2 // LOCAL + groups // LOCAL * 4
    return [
        ("deepspeed swizzle_quant", swizzle, sets, numel * es + swizzle_out,
         lambda: transient_bytes(lambda: swizzle(0), swizzle_out)),
        ("deepspeed quantized_reduction", reduce, sets, numel // 2 + groups * 4 + reduce_out,
         lambda: transient_bytes(lambda: reduce(0), reduce_out)),
    ], (grads, quantized)


def run_cases(cases, config, shape, dname, reps, copy_bw):
    """Times each case, prints its table line, returns the rows."""
    rows = []
    for name, fn, sets, n_bytes, transient_fn in cases:
        ms = median_ms(fn, sets, reps)
        transient = transient_fn()
        bw = n_bytes / (ms * 1e-3)
        rows.append(dict(kernel=name, config=config, shape=list(shape), dtype=dname, ms=ms, bytes=n_bytes,
                         gbps=bw / 1e9, fraction_of_copy=bw / copy_bw, transient_bytes=transient))
        print(f"{name:32s} {config:>6s} {str(shape):>13s} {dname:>5s} {ms:8.4f} {n_bytes / 1e6:9.1f} "
              f"{bw / 1e9:7.0f} {bw / copy_bw:7.2f} {transient / 2**20:13.1f}", flush=True)
    return rows


def print_ratios(rows, configs):
    """Per LoCo kernel, shape and dtype: each config's time over the 4/4 time of the same run."""
    others = [c for c in configs if c != "4/4"]
    if "4/4" not in configs or not others:
        return
    ms = {(r["kernel"], r["config"], tuple(r["shape"]), r["dtype"]): r["ms"] for r in rows}
    print(f"\ntime relative to 4/4 in this run: {'kernel':32s} {'shape':>13s} {'dtype':>5s} "
          + " ".join(f"{c:>7s}" for c in others))
    for (kernel, config, shape, dname), base in ms.items():
        if config != "4/4" or not kernel.startswith(("loco", "plain")):
            continue
        ratios = " ".join(f"{ms[(kernel, c, shape, dname)] / base:7.2f}" if (kernel, c, shape, dname) in ms
                          else f"{'-':>7s}" for c in others)
        print(f"{'':33s}{kernel:32s} {str(shape):>13s} {dname:>5s} {ratios}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--no-baseline", action="store_true", help="skip DeepSpeed's QuantizerBuilder kernels")
    parser.add_argument("--json", type=str, default=None, help="also write the rows to this JSON file")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS),
                        help="intra/inter bits, '+H' for the Hadamard rotation")
    args = parser.parse_args()
    for config in args.configs:
        try:
            intra, inter, _ = parse_config(config)
        except ValueError:
            parser.error(f"--configs: {config!r} is not INTRA/INTER[+H]")
        if intra not in (2, 3, 4, 8) or inter not in (2, 3, 4, 8):
            parser.error(f"--configs: {config!r}: bits must be 2, 3, 4 or 8")

    loco_cuda.load()
    quantizer = None
    if not args.no_baseline:
        try:
            from deepspeed.ops.op_builder import QuantizerBuilder
            quantizer = QuantizerBuilder().load(verbose=False)
        except Exception as exc:  # the baseline is optional; say why it is missing
            print(f"DeepSpeed QuantizerBuilder unavailable, no baseline rows: {type(exc).__name__}: {exc}")

    copy_bw = copy_bandwidth(args.reps)
    device = torch.cuda.get_device_name()
    print(f"device: {device}; torch {torch.__version__}; copy bandwidth (read + write) {copy_bw / 1e9:.0f} GB/s")
    print(f"LoCo: W={WORLD} (L={LOCAL} x M={NODES}), bits intra/inter per config, group {GROUP}, int8 error, "
          f"beta {BETA}; median of {args.reps}; DeepSpeed rows: its fixed 4-bit qgZ")
    rows = []
    header = f"{'kernel':32s} {'config':>6s} {'shape':>13s} {'dtype':>5s} {'ms':>8s} {'MB moved':>9s} {'GB/s':>7s} " \
             f"{'of copy':>7s} {'transient MiB':>13s}"
    print(header)
    for shape in SHAPES:
        for dname, dtype in DTYPES.items():
            for config in args.configs:
                cases, keep = loco_cases(shape, dtype, config)
                rows += run_cases(cases, config, shape, dname, args.reps, copy_bw)
                del keep
                torch.cuda.empty_cache()
            if quantizer is not None:
                cases, keep = deepspeed_cases(quantizer, shape, dtype)
                rows += run_cases(cases, "4/4", shape, dname, args.reps, copy_bw)
                del keep
                torch.cuda.empty_cache()
    hop1 = [r for r in rows if r["kernel"].startswith("loco hop1") and r["shape"] == [16384, 16384]
            and r["dtype"] == "bf16" and r["config"] == "4/4"]
    if hop1:
        print(f"target: loco hop1 (16384, 16384) bf16 <= 0.36 ms: {hop1[0]['ms']:.4f} ms")
    print_ratios(rows, args.configs)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=device, copy_gbps=copy_bw / 1e9, rows=rows), indent=1))


if __name__ == "__main__":
    main()
