"""Times LoCo's fused CUDA kernels and DeepSpeed's plain qgZ kernels on one GPU (issues 4 and 8).

For gradients (4096, 4096), (8192, 8192), (16384, 16384) in bf16 and fp16, with a simulated 2 nodes x 8 GPUs
(W = 16, L = 8, M = 2), group size 256 and int8 or int4 error (beta 0.8), and per-hop bits intra/inter 4/4 and 8/2, each
without and with the Hadamard rotation (``+H``, fused into hop 1 and the final mean), prints per kernel the median time,
the bytes it must move (each input read once, each output written once), the achieved bandwidth, its fraction
of the device-to-device copy bandwidth measured in the same run and of the H200's 4.8 TB/s peak, the floor (bytes
at the copy bandwidth), and the transient device memory (peak allocated during the call above what was allocated
before it, outputs passed in excluded). Then, on the same shapes, DeepSpeed's own ``swizzle_quant``,
``quantized_reduction`` and ``dequantize`` (alone, and with the torch mean over nodes that follows it) from the
QuantizerBuilder of the installed DeepSpeed, called as ``all_to_all_quant_reduce`` calls them (they read the
gradient as fp16 whatever its dtype, so their bf16 rows are timings only), the ratio of ours to theirs, and the
issue-23 kernel targets, met or not (after the bucket table). Last, a per-bucket table (one launch per hop per
bucket): one Llama-2-7B decoder layer's gradients, 256 tensors of 4096 elements and one tensor of 1,048,576, our
three kernels without and with error feedback against DeepSpeed's two kernels on the same tensors.

Measured and unmeasured launches (issue 48): a step on which the live rho measures (``rho_every``) passes ``stats``
to every kernel, which then also sums the noise statistics; every other step runs kernels compiled without them. At
the largest shape each of our kernels is timed both ways (rows ``..., measured``), the 7B-layer bucket too (arms
``plain+rho``, ``loco+rho``), and a table gives measured / unmeasured of the same run.

Inputs rotate over enough copies to exceed the L2 cache several times; times are CUDA-event medians of the GPU
time alone: a spin kernel queued before each start event keeps the GPU busy while the host prepares the call, so
host work (Python wrappers, argument checks, the parameter table) is not counted there. The bucket table also gives
the host-inclusive time per call (wall clock over back-to-back calls, synchronized at the end).

``--variant FLAGS`` (repeatable) also builds the kernels with extra nvcc flags (e.g. ``-DLOCO_MIN_BLOCKS=4``) as a
further extension and repeats the LoCo rows of the largest shape with it, for A/B comparisons in one run.

    python3 benchmarks/kernels.py [--reps 50] [--configs 4/4 8/2 4/4+H 8/2+H] [--no-baseline] [--json out.json]
                                  [--largest-only] [--variant FLAGS ...]
"""
import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepspeed_loco.ops import library, loco_cuda  # noqa: E402
from deepspeed_loco.ops.error_buffer import ErrorBuffer  # noqa: E402
from deepspeed_loco.ops.op_builder import LocoBuilder  # noqa: E402
from deepspeed_loco.layout import HopArgs, WireLayout, padded_partition_size, partition_size  # noqa: E402

SHAPES = [(4096, 4096), (8192, 8192), (16384, 16384)]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
WORLD, LOCAL, GROUP, BETA = 16, 8, 256, 0.8
CONFIGS = ("4/4", "8/2", "4/4+H", "8/2+H")  # intra/inter bits, +H: Hadamard
NODES = WORLD // LOCAL
RANK = 3  # the rank whose reduce is timed (its final mean's partition; with an exact own block, its own blocks)
OWN = ", own exact"  # the suffix of a LoCo kernel's name timed with an exact own block (exact_own_block)
ROTATE_BYTES = 256 << 20  # rotate inputs over at least this much (H200 L2: 50 MB)
SPIN_CYCLES = 10_000_000  # ~5 ms of GPU clock cycles queued ahead of each timed call (longer than its host work)
PEAK_BW = 4.8e12  # H200 HBM3e peak (bytes/s): the "of peak" column; "of copy" is against the copy measured in the run
TARGETS = (  # issue #23 item 4: (ours, theirs or None, bound: ratio to theirs, or ms when theirs is None)
    ("plain hop1 (no err)", "4/4", "deepspeed swizzle_quant", 1.0),
    ("loco final mean", "4/4", "deepspeed dequantize", 1.0),
    ("loco hop1 (int8 err)", "4/4", None, 0.36),
    ("loco hop1 (int8 err)", "4/4+H", None, 0.45),
)
BUCKET_TARGET = 1.6  # LoCo bucket (3 kernels) / DeepSpeed's two kernels
MEASURED = ", measured"  # the suffix of a kernel's name timed with stats (a live-rho step)


def median_ms(fn, sets, reps, warmup=5):
    """Median GPU time (ms) over ``reps`` calls of ``fn(i)`` (``i`` cycling over ``sets`` input sets): CUDA events
    around each call, behind a spin kernel that hides the call's host work."""
    for i in range(warmup):
        fn(i % sets)
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        torch.cuda._sleep(SPIN_CYCLES)
        starts[i].record()
        fn(i % sets)
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def call_ms(fn, reps):
    """Host-inclusive time (ms) per call: wall clock over ``reps`` back-to-back calls and a final synchronize."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / reps


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


def random_error(rows, cols, error_bits=8):
    """A CUDA error buffer ``(rows, cols)`` stored in ``error_bits`` (8: int8, 4: two 4-bit codes a byte) with random
    codes and scales (timing on zeros can flatter a kernel)."""
    error = ErrorBuffer.zeros(rows, cols, GROUP, error_bits, "cuda")
    if error_bits == 4:
        error.values.random_(0, 256)
    else:
        error.values.random_(-127, 128)
    error.scale.uniform_(0, 1e-3)
    return error


def hop_args(config, error=True, own=False):
    """``(args1, args2)``: the HopArgs of hop 1 (``intra`` bits) and hop 2 (``inter`` bits; its ``.mean()`` is the
    final mean's) of rank :data:`RANK`; ``own``: with its exact own block (``exact_own_block``)."""
    intra, inter, hadamard = parse_config(config)
    beta = BETA if error else 0.0
    local, node = (RANK % LOCAL, RANK // LOCAL) if own else (-1, -1)
    args1 = HopArgs(WORLD, LOCAL, intra, GROUP, beta, hadamard, own=local)
    return args1, HopArgs(WORLD, LOCAL, inter, GROUP, beta, hadamard, in_bits=intra, in_blocks=LOCAL, own=node,
                          in_own=local)


def bucket_calls(grads, config, error=True, measured=False, kernels=library.CUDA, error_bits=8, own=False):
    """``(hop1, hop2, final, keep)`` for one bucket of ``grads`` (each ``fn()`` is one kernel launch of the bucket),
    ``measured``: each launch adds its noise statistics to a float64 ``stats`` (a live-rho step); ``kernels``: the
    entry points (the default build's ops, or a further build's); ``error_bits``: the error buffers' storage (8 or
    4); ``own``: the exact own block (its error rows left out, its fp32 own buffers handed from hop to hop)."""
    args1, args2 = hop_args(config, error, own)
    numels = [g.numel() for g in grads]
    widths = tuple(padded_partition_size(n, WORLD, GROUP) for n in numels)
    wire1, wire2 = WireLayout(widths, args1.bits, GROUP), WireLayout(widths, args2.bits, GROUP)
    rows1, rows2 = (WORLD - NODES, NODES - 1) if own else (WORLD, NODES)
    errors1 = [random_error(rows1, w, error_bits) if error else None for w in widths]
    errors2 = [random_error(rows2, w, error_bits) if error else None for w in widths]
    send1, send2 = wire1.empty(WORLD, "cuda"), wire2.empty(NODES, "cuda")
    own1, own2 = ((torch.empty(rows, sum(widths), device="cuda") for rows in (NODES, 1)) if own else (None, None))
    stats = [torch.zeros(n, dtype=torch.float64, device="cuda") if measured else None for n in (2, 2, 1)]
    hop1 = lambda: kernels.quantize_bucket_(grads, errors1, args1, wire1, send1, stats[0], own1)
    hop2 = lambda: kernels.requantize_bucket_(send1, wire1, errors2, args2, wire2, send2, stats[1], own1, own2)
    final = lambda: kernels.final_mean_bucket(send2, wire2, args2.mean(), numels, RANK, grads[0].dtype, stats[2],
                                              own2)
    hop1()
    hop2()
    return hop1, hop2, final, (errors1, errors2, send1, send2, own1, own2)


def loco_cases(shape, dtype, config, measured=False, kernels=library.CUDA):
    """``(name, fn(i), sets, bytes, transient_fn)`` for the fused kernels on one gradient shape and one
    ``config`` (see :func:`parse_config`): hop 1 sends ``intra`` bits, hop 2 ``inter`` bits; ``measured``: launched
    with stats (the names end in :data:`MEASURED`)."""
    intra, inter, hadamard = parse_config(config)
    numel = shape[0] * shape[1]
    es = torch.empty((), dtype=dtype).element_size()
    cols = padded_partition_size(numel, WORLD, GROUP)
    groups = cols // GROUP
    grad_bytes = numel * es
    err_bytes = lambda rows, bits=8: rows * (cols * bits // 8 + groups * 4)  # int8 / int4 values + fp32 scales
    wire_bytes = lambda rows, bits: rows * (cols * bits // 8 + groups * 4)

    sets = copies(grad_bytes + err_bytes(WORLD) + wire_bytes(WORLD, intra))
    grads = [torch.randn(shape, device="cuda", dtype=dtype) for _ in range(sets)]
    loco = [bucket_calls([g], config, measured=measured, kernels=kernels) for g in grads]
    loco4 = [bucket_calls([g], config, measured=measured, kernels=kernels, error_bits=4) for g in grads]
    plain = [bucket_calls([g], config, error=False, measured=measured, kernels=kernels) for g in grads]
    own = [bucket_calls([g], config, measured=measured, kernels=kernels, own=True) for g in grads]
    part = partition_size(numel, WORLD)
    suffix = MEASURED if measured else ""
    own_bytes = lambda rows: rows * cols * 4  # fp32 rows of an own buffer
    return [
        ("loco hop1 (int8 err)" + suffix, lambda i: loco[i][0](), sets,
         grad_bytes + 2 * err_bytes(WORLD) + wire_bytes(WORLD, intra), lambda: transient_bytes(loco[0][0])),
        ("loco hop1 (int4 err)" + suffix, lambda i: loco4[i][0](), sets,
         grad_bytes + 2 * err_bytes(WORLD, 4) + wire_bytes(WORLD, intra), lambda: transient_bytes(loco4[0][0])),
        ("plain hop1 (no err)" + suffix, lambda i: plain[i][0](), sets, grad_bytes + wire_bytes(WORLD, intra),
         lambda: transient_bytes(plain[0][0])),
        ("loco hop2 (int8 err)" + suffix, lambda i: loco[i][1](), sets,
         wire_bytes(WORLD, intra) + 2 * err_bytes(NODES) + wire_bytes(NODES, inter),
         lambda: transient_bytes(loco[0][1])),
        ("loco hop2 (int4 err)" + suffix, lambda i: loco4[i][1](), sets,
         wire_bytes(WORLD, intra) + 2 * err_bytes(NODES, 4) + wire_bytes(NODES, inter),
         lambda: transient_bytes(loco4[0][1])),
        ("plain hop2 (no err)" + suffix, lambda i: plain[i][1](), sets,
         wire_bytes(WORLD, intra) + wire_bytes(NODES, inter), lambda: transient_bytes(plain[0][1])),
        ("loco final mean" + suffix, lambda i: loco[i][2](), sets, wire_bytes(NODES, inter) + part * es,
         lambda: transient_bytes(loco[0][2], part * es)),
        # the exact own block: its error rows and received copies are not touched, its fp32 rows are
        ("loco hop1 (int8 err" + OWN + ")" + suffix, lambda i: own[i][0](), sets,
         grad_bytes + 2 * err_bytes(WORLD - NODES) + wire_bytes(WORLD, intra) + own_bytes(NODES),
         lambda: transient_bytes(own[0][0])),
        ("loco hop2 (int8 err" + OWN + ")" + suffix, lambda i: own[i][1](), sets,
         wire_bytes(WORLD - NODES, intra) + own_bytes(NODES) + 2 * err_bytes(NODES - 1) + wire_bytes(NODES, inter)
         + own_bytes(1), lambda: transient_bytes(own[0][1])),
        ("loco final mean" + OWN + suffix, lambda i: own[i][2](), sets,
         wire_bytes(NODES - 1, inter) + own_bytes(1) + part * es, lambda: transient_bytes(own[0][2], part * es)),
    ], (grads, loco, loco4, plain, own)


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
    # the last step of all_to_all_quant_reduce, on this rank's received inter-node rows (the reduction's output has
    # their size): dequantize to fp16 (numel / LOCAL values = NODES rows of the partition), then the mean over nodes
    # in torch (two more kernels, timed as a second row)
    reduced = [reduce(i) for i in range(sets)]
    dequantize = lambda i: quantizer.dequantize(reduced[i][0], reduced[i][1], reduced[i][1].numel(), 4,
                                                quantizer.Symmetric)
    mean = lambda i: sum(list(dequantize(i).chunk(NODES))) / NODES
    dequant_out = numel // LOCAL * 2
    return [
        ("deepspeed swizzle_quant", swizzle, sets, numel * es + swizzle_out,
         lambda: transient_bytes(lambda: swizzle(0), swizzle_out)),
        ("deepspeed quantized_reduction", reduce, sets, numel // 2 + groups * 4 + reduce_out,
         lambda: transient_bytes(lambda: reduce(0), reduce_out)),
        ("deepspeed dequantize", dequantize, sets, reduce_out + dequant_out,
         lambda: transient_bytes(lambda: dequantize(0), dequant_out)),
        ("deepspeed dequantize + mean", mean, sets, reduce_out + dequant_out // NODES,
         lambda: transient_bytes(lambda: mean(0), dequant_out // NODES)),
    ], (grads, quantized, reduced)


BUCKETS = {  # name: gradient shapes of one bucket
    "llama2-7b layer": [(4096, 4096)] * 4 + [(11008, 4096)] * 3 + [(4096,)] * 2,
    "256 x 4096": [(4096,)] * 256,
    "1 x 1048576": [(1 << 20,)],
}


def deepspeed_bucket(quantizer, grads):
    """DeepSpeed's two qgZ kernels on a bucket as ``all_to_all_quant_reduce`` calls them, one tensor at a time:
    ``(fn, tensors quantized)``. It sends 1-D tensors unquantized (reduce_scatter), so they get no kernel here."""
    calls = [(g, max(g.shape[0], g.shape[1], WORLD)) for g in grads if g.dim() == 2]

    def run():
        for grad, groups in calls:
            q, scale = quantizer.swizzle_quant(grad, groups, 4, quantizer.Symmetric, 1, NODES, LOCAL)
            quantizer.quantized_reduction(q, scale, groups, groups // LOCAL, 4, quantizer.Symmetric, LOCAL)
    return run, len(calls)


def bucket_rows(quantizer, reps):
    """Per bucket (fp16, 4/4): our three kernels (one launch per hop for the whole bucket) without and with int8
    error feedback, each hop alone and the three together, against DeepSpeed's two kernels on the same tensors."""
    print(f"\nbuckets (fp16, 4/4, W={WORLD}): one launch per hop per bucket; median ms")
    print(f"{'bucket':18s} {'tensors':>7s} {'elements':>11s} {'arm':>9s} {'hop1':>8s} {'hop2':>8s} {'final':>8s} "
          f"{'3 kernels':>9s} {'DeepSpeed 2':>11s} {'ratio':>6s} {'3 calls, host-incl.':>19s} "
          f"{'DeepSpeed, host-incl.':>21s}")
    rows = []
    for name, shapes in BUCKETS.items():
        grads = [torch.randn(shape, device="cuda", dtype=torch.float16) for shape in shapes]
        numel = sum(g.numel() for g in grads)
        ds_ms, ds_call, ds_tensors = None, None, 0
        if quantizer is not None:
            ds_fn, ds_tensors = deepspeed_bucket(quantizer, grads)
            ds_ms = median_ms(lambda i: ds_fn(), 1, reps) if ds_tensors else None
            ds_call = call_ms(ds_fn, reps) if ds_tensors else None
        arms = (("plain", False, False), ("loco", True, False))
        if name == "llama2-7b layer":  # and as on a live-rho step
            arms += (("plain+rho", False, True), ("loco+rho", True, True))
        for arm, error, measured in arms:
            hop1, hop2, final, keep = bucket_calls(grads, "4/4", error, measured)
            times = [median_ms(lambda i, f=f: f(), 1, reps) for f in (hop1, hop2, final)]
            total = median_ms(lambda i: (hop1(), hop2(), final()), 1, reps)
            total_call = call_ms(lambda: (hop1(), hop2(), final()), reps)
            ratio = total / ds_ms if ds_ms else None
            rows.append(dict(bucket=name, tensors=len(grads), elements=numel, arm=arm, hop1_ms=times[0],
                             hop2_ms=times[1], final_ms=times[2], total_ms=total, deepspeed_ms=ds_ms,
                             deepspeed_tensors=ds_tensors, ratio_to_deepspeed=ratio, total_call_ms=total_call,
                             deepspeed_call_ms=ds_call))
            ds_text = f"{ds_ms:11.4f}" if ds_ms else f"{'-':>11s}"
            ratio_text = f"{ratio:6.2f}" if ratio else f"{'-':>6s}"
            ds_call_text = f"{ds_call:21.4f}" if ds_call else f"{'-':>21s}"
            print(f"{name:18s} {len(grads):7d} {numel:11d} {arm:>9s} {times[0]:8.4f} {times[1]:8.4f} {times[2]:8.4f} "
                  f"{total:9.4f} {ds_text} {ratio_text} {total_call:19.4f} {ds_call_text}", flush=True)
            del keep
        del grads
        torch.cuda.empty_cache()
    by = {(r["bucket"], r["arm"]): r for r in rows}
    for arm in ("plain", "loco"):
        measured, unmeasured = by[("llama2-7b layer", arm + "+rho")], by[("llama2-7b layer", arm)]
        print(f"{arm}: llama2-7b layer measured / unmeasured (live-rho step / other steps): " + ", ".join(
            f"{k[:-3]} {measured[k] / unmeasured[k]:.3f}" for k in ("hop1_ms", "hop2_ms", "final_ms", "total_ms")))
        many, one = by[("256 x 4096", arm)], by[("1 x 1048576", arm)]
        print(f"{arm}: 256 tensors of 4096 / one tensor of 1048576: " + ", ".join(
            f"{k[:-3]} {many[k] / one[k]:.2f}" for k in ("hop1_ms", "hop2_ms", "final_ms", "total_ms",
                                                          "total_call_ms")))
    return rows


def variant_namespace(index):
    """The ops' namespace of further build ``index``: its kernels register there, beside the default build's."""
    return f"deepspeed_loco_variant{index}"


class VariantBuilder(LocoBuilder):
    """The kernels as a further extension, ``loco_ops_variant<index>``, built with extra nvcc ``flags`` and
    registered for the ops of :func:`variant_namespace` (which :func:`variant_kernels` defines)."""

    def __init__(self, flags, index):
        super().__init__(name=f"loco_ops_variant{index}")
        self.flags, self.namespace = flags.split(), variant_namespace(index)

    def nvcc_args(self):
        return super().nvcc_args() + self.flags + [f"-DLOCO_OPS_NAMESPACE={self.namespace}"]

    def cxx_args(self):
        return super().cxx_args() + [f"-DLOCO_OPS_NAMESPACE={self.namespace}"]


def variant_builder(flags, index=0):
    return VariantBuilder(flags, index)


def variant_kernels(flags, index):
    """The entry points on further build ``index``'s ops: the ops defined in its namespace (schemas, references,
    fakes: ``library.define_ops``), then its extension built and loaded (which registers their CUDA kernels).
    Returns ``(kernels, library)``: keep the library alive while the kernels run."""
    namespace = variant_namespace(index)
    ops = library.define_ops(namespace)
    variant_builder(flags, index).load(verbose=False)
    return library.Kernels.of_ops(f"loco_cuda variant {index}", library.OpEntryPoints(namespace)), ops


def _outputs(kernels, grads, config, error, seed, error_bits=8):
    """Every output of one bucket's three kernels (hop 1's send buffer and error, hop 2's, the final mean) run with the
    entry points ``kernels`` on inputs fixed by ``seed`` (random error buffers of ``error_bits`` included)."""
    torch.manual_seed(seed)
    hop1, hop2, final, (errors1, errors2, send1, send2, _, _) = bucket_calls(grads, config, error, kernels=kernels,
                                                                              error_bits=error_bits)
    # bucket_calls ran hop 1 and hop 2 once on fresh random error buffers; run them again on zeroed wire buffers
    # (row padding that no kernel writes must not differ), then the final mean
    send1.zero_()
    send2.zero_()
    hop1()
    hop2()
    out = final()
    tensors = [send1, send2] + (out if isinstance(out, (list, tuple)) else [out])
    for e in errors1 + errors2:
        if e is not None:
            tensors += [e.values] + ([e.scale] if e.scale is not None else [])
    torch.cuda.synchronize()
    return [t.detach().clone() for t in tensors]


def variant_matches_default(variant, configs):
    """Whether the variant build's outputs equal the default build's, bit for bit, on the bucket shapes and a
    (4096, 4096) gradient of both dtypes, every config, without error feedback and with int8 and int4 errors
    (NaN-free inputs: plain bitwise equality). A variant that is faster but computes something else must not be
    mistaken for a win."""
    ok = True
    for dname, dtype in DTYPES.items():
        gen = torch.Generator(device="cuda").manual_seed(1)
        shapes = [(4096, 4096), (1000, 37), (4096,), (1 << 20,)]
        grads = [torch.randn(shape, device="cuda", dtype=dtype, generator=gen) for shape in shapes]
        for config in configs:
            for error, bits in ((False, 8), (True, 8), (True, 4)):
                mine = _outputs(variant, grads, config, error, 2, bits)
                theirs = _outputs(library.CUDA, grads, config, error, 2, bits)
                same = len(mine) == len(theirs) and all(
                    a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.dtype != torch.uint8 else a,
                                                       b.view(torch.uint8) if b.dtype != torch.uint8 else b)
                    for a, b in zip(mine, theirs))
                if not same:
                    print(f"  variant differs from the default build: {dname} {config} error={error} "
                          f"error_bits={bits}")
                    ok = False
    return ok


def variant_rows(flags, index, configs, reps, copy_bw):
    """The LoCo rows of the largest shape (both dtypes) with the kernels of ``variant_kernels(flags, index)``, after
    checking that its outputs equal the default build's bit for bit."""
    variant, keep_ops = variant_kernels(flags, index)
    same = variant_matches_default(variant, configs)
    print(f"\nvariant {index} build: nvcc {flags}; outputs {'identical to' if same else 'DIFFER from'} the default "
          f"build's")
    rows = []
    for dname, dtype in DTYPES.items():
        for config in configs:
            cases, keep = loco_cases(SHAPES[-1], dtype, config, kernels=variant)
            rows += run_cases(cases, f"{config} v{index}", SHAPES[-1], dname, reps, copy_bw)
            del keep
            torch.cuda.empty_cache()
    del keep_ops
    return rows


def run_cases(cases, config, shape, dname, reps, copy_bw):
    """Times each case, prints its table line, returns the rows."""
    rows = []
    for name, fn, sets, n_bytes, transient_fn in cases:
        ms = median_ms(fn, sets, reps)
        transient = transient_fn()
        bw = n_bytes / (ms * 1e-3)
        rows.append(dict(kernel=name, config=config, shape=list(shape), dtype=dname, ms=ms, bytes=n_bytes,
                         gbps=bw / 1e9, fraction_of_copy=bw / copy_bw, fraction_of_peak=bw / PEAK_BW,
                         floor_ms=n_bytes / copy_bw * 1e3, transient_bytes=transient))
        print(f"{name:32s} {config:>6s} {str(shape):>13s} {dname:>5s} {ms:8.4f} {n_bytes / 1e6:9.1f} "
              f"{bw / 1e9:7.0f} {bw / copy_bw:7.2f} {bw / PEAK_BW:7.2f} {n_bytes / copy_bw * 1e3:9.4f} "
              f"{transient / 2**20:13.1f}", flush=True)
    return rows


def print_deepspeed_ratios(rows):
    """Ours over DeepSpeed's in the same run: hop 1 / swizzle_quant and hop 2 / quantized_reduction (4/4)."""
    ms = {(r["kernel"], r["config"], tuple(r["shape"]), r["dtype"]): r["ms"] for r in rows}
    pairs = [("plain hop1 (no err)", "deepspeed swizzle_quant"), ("loco hop1 (int8 err)", "deepspeed swizzle_quant"),
             ("loco hop2 (int8 err)", "deepspeed quantized_reduction"),
             ("plain hop2 (no err)", "deepspeed quantized_reduction"), ("loco final mean", "deepspeed dequantize"),
             ("loco final mean", "deepspeed dequantize + mean")]
    print("\nours / DeepSpeed (4/4, same run; measured: launched with stats, as on a live-rho step):")
    for (kernel, config, shape, dname), ours in ms.items():
        for mine, theirs in pairs:
            if kernel in (mine, mine + MEASURED) and config in ("4/4", "4/4+H") and (theirs, "4/4", shape, dname) in ms:
                print(f"  {kernel + ' ' + config:38s} / {theirs:30s} {str(shape):>14s} {dname:>5s} "
                      f"{ours / ms[(theirs, '4/4', shape, dname)]:6.2f}")


def print_measured_ratios(rows):
    """Per kernel timed both ways in this run: measured (with stats) over unmeasured."""
    ms = {(r["kernel"], r["config"], tuple(r["shape"]), r["dtype"]): r["ms"] for r in rows}
    print("\nmeasured / unmeasured (same run; a live-rho step's launch over another step's):")
    for (kernel, config, shape, dname), measured in ms.items():
        unmeasured = ms.get((kernel.removesuffix(MEASURED), config, shape, dname))
        if kernel.endswith(MEASURED) and unmeasured:
            print(f"  {kernel.removesuffix(MEASURED) + ' ' + config:30s} {str(shape):>14s} {dname:>5s} "
                  f"{measured:8.4f} / {unmeasured:8.4f} ms = {measured / unmeasured:5.3f}")


def print_error_storage_ratios(rows):
    """Per hop, shape, dtype and config: the LoCo kernel with int4 error buffers over the same with int8, and its
    fraction of the copy bandwidth (issue 56: at least 0.85 of copy and no slower than int8)."""
    ms = {(r["kernel"], r["config"], tuple(r["shape"]), r["dtype"]): r for r in rows}
    print("\nint4 / int8 error storage (same run):")
    for (kernel, config, shape, dname), row in ms.items():
        if "(int4 err)" not in kernel:
            continue
        int8 = ms.get((kernel.replace("int4", "int8"), config, shape, dname))
        if int8:
            print(f"  {kernel + ' ' + config:38s} {str(shape):>14s} {dname:>5s} {row['ms']:8.4f} / {int8['ms']:8.4f} "
                  f"ms = {row['ms'] / int8['ms']:5.3f}; {row['fraction_of_copy']:.2f} of copy "
                  f"(int8: {int8['fraction_of_copy']:.2f})")


def print_own_block_ratios(rows):
    """Per kernel, shape, dtype and config: LoCo with an exact own block over LoCo as shipped (int8 errors, same
    run; issue 56 item 3: adopted only if it does no harm)."""
    ms = {(r["kernel"], r["config"], tuple(r["shape"]), r["dtype"]): r["ms"] for r in rows}
    print("\nexact own block / every block quantized (same run):")
    for (kernel, config, shape, dname), own in ms.items():
        shipped = ms.get((kernel.replace(OWN, ""), config, shape, dname))
        if OWN in kernel and shipped:
            print(f"  {kernel + ' ' + config:52s} {str(shape):>14s} {dname:>5s} {own:8.4f} / {shipped:8.4f} ms = "
                  f"{own / shipped:5.3f}")


def print_targets(rows, buckets):
    """Issue #23 item 4's kernel targets at (16384, 16384) (both dtypes) and the 7B-layer LoCo bucket: met or not."""
    ms = {(r["kernel"], r["config"], tuple(r["shape"]), r["dtype"]): r for r in rows}
    print("\ntargets (issue #23 item 4), (16384, 16384):")
    for dname in DTYPES:
        for ours, config, theirs, bound in TARGETS:
            mine = ms.get((ours, config, SHAPES[-1], dname))
            if mine is None:
                continue
            if theirs is None:
                value, text = mine["ms"], f"{mine['ms']:.4f} ms <= {bound} ms"
            else:
                other = ms.get((theirs, "4/4", SHAPES[-1], dname))
                if other is None:
                    continue
                value = mine["ms"] / other["ms"]
                text = f"{mine['ms']:.4f} / {other['ms']:.4f} ms = {value:.2f}x {theirs} <= {bound}x"
            print(f"  {ours + ' ' + config:28s} {dname:>5s} {text:60s} floor {mine['floor_ms']:.4f} ms "
                  f"{'met' if value <= bound else 'NOT met'}")
    for row in buckets:
        if row["bucket"] == "llama2-7b layer" and row["ratio_to_deepspeed"]:
            print(f"  7B-layer bucket {row['arm']:9s} fp16 {row['total_ms']:.4f} / {row['deepspeed_ms']:.4f} ms = "
                  f"{row['ratio_to_deepspeed']:.2f}x DeepSpeed's two kernels"
                  + (f" <= {BUCKET_TARGET}x {'met' if row['ratio_to_deepspeed'] <= BUCKET_TARGET else 'NOT met'}"
                     if row["arm"] == "loco" else ""))


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


def profile_hop1():
    """Hop 1 at the largest shape, bf16, 4/4: LoCo (twice), plain, LoCo + Hadamard, LoCo with int4 errors (twice),
    one launch each."""
    grad = [torch.randn(SHAPES[-1], device="cuda", dtype=torch.bfloat16)]
    loco, plain = bucket_calls(grad, "4/4"), bucket_calls(grad, "4/4", error=False)
    rotated, loco4 = bucket_calls(grad, "4/4+H"), bucket_calls(grad, "4/4", error_bits=4)
    for call in (loco[0], loco[0], plain[0], rotated[0], loco4[0], loco4[0]):
        call()
    torch.cuda.synchronize()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--no-baseline", action="store_true", help="skip DeepSpeed's QuantizerBuilder kernels")
    parser.add_argument("--json", type=str, default=None, help="also write the rows to this JSON file")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS),
                        help="intra/inter bits, '+H' for the Hadamard rotation")
    parser.add_argument("--profile-hop1", action="store_true",
                        help="only run hop 1 at (16384, 16384) bf16 4/4 (each set-up launch, then LoCo twice, plain, "
                             "LoCo + Hadamard, LoCo with int4 errors twice) for a profiler: skip the first 4 launches")
    parser.add_argument("--largest-only", action="store_true",
                        help=f"only the largest shape {SHAPES[-1]}, without the per-bucket table (a quick check)")
    parser.add_argument("--variant", type=str, action="append", default=[],
                        help="extra nvcc flags of a further build whose LoCo rows (largest shape) are printed too; "
                             "repeatable")
    args = parser.parse_args()
    for config in args.configs:
        try:
            intra, inter, _ = parse_config(config)
        except ValueError:
            parser.error(f"--configs: {config!r} is not INTRA/INTER[+H]")
        if intra not in (2, 3, 4, 8) or inter not in (2, 3, 4, 8):
            parser.error(f"--configs: {config!r}: bits must be 2, 3, 4 or 8")

    loco_cuda.load()
    if args.profile_hop1:
        profile_hop1()
        return
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
    print(f"LoCo: W={WORLD} (L={LOCAL} x M={NODES}), bits intra/inter per config, group {GROUP}, int8 or int4 error, "
          f"beta {BETA}; median of {args.reps}; DeepSpeed rows: its fixed 4-bit qgZ")
    print("MB moved: each input read once, each output written once; GB/s = MB moved / ms; of copy: of the copy "
          f"bandwidth above; of 4.8T: of the H200's {PEAK_BW / 1e12:.1f} TB/s peak; floor ms: MB moved at the copy "
          "bandwidth")
    rows = []
    header = f"{'kernel':32s} {'config':>6s} {'shape':>13s} {'dtype':>5s} {'ms':>8s} {'MB moved':>9s} {'GB/s':>7s} " \
             f"{'of copy':>7s} {'of 4.8T':>7s} {'floor ms':>9s} {'transient MiB':>13s}"
    print(header)
    for shape in SHAPES[-1:] if args.largest_only else SHAPES:
        for dname, dtype in DTYPES.items():
            for config in args.configs:
                for measured in (False, True) if shape == SHAPES[-1] else (False, ):
                    cases, keep = loco_cases(shape, dtype, config, measured)
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
    print_deepspeed_ratios(rows)
    print_measured_ratios(rows)
    print_error_storage_ratios(rows)
    print_own_block_ratios(rows)
    buckets = [] if args.largest_only else bucket_rows(quantizer, args.reps)
    print_targets(rows, buckets)
    for index, flags in enumerate(args.variant):
        rows += variant_rows(flags, index, args.configs, args.reps, copy_bw)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=device, copy_gbps=copy_bw / 1e9, rows=rows, buckets=buckets),
                                              indent=1))


if __name__ == "__main__":
    main()
