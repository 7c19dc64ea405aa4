"""The ``deepspeed_loco`` torch.library ops (``deepspeed_loco/ops/library.py``).

* ``torch.library.opcheck`` of every op (schema, fake implementation, dispatch under functionalization) on CPU, and on
  CUDA with the fused kernels where a GPU is present (those cases are skipped here and run on the device machine).
* The ops give the reference's bytes (bit for bit) through the bucket entry points, on CPU.
* A reduce step (hop 1, an exchange, hop 2, the final mean) compiled with ``torch.compile(fullgraph=True)``: no graph
  break, and the same bytes, error buffers and means as eager.
* The limits have one source (``loco_limits.h``): the config takes them from it (checked against the header compiled
  with g++), and so does the CUDA binding; the entry points check a bucket's sizes against them before a call.
"""
import shutil
import subprocess

import pytest
import torch

from deepspeed_loco import config
from deepspeed_loco.layout import HopArgs, MeanArgs, WireLayout, formats, limits, padded_partition_size
from deepspeed_loco.ops import library
from deepspeed_loco.ops import loco_reference as ref
from deepspeed_loco.ops.error_buffer import ErrorBuffer

OPS = library.CUDA  # the entry points that call the ops (on CPU tensors the ops run the reference)

NUMELS = (300, 17, 64)  # tiny: opcheck runs each op several times
GROUP = 32
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]  # the fused LoCo kernels


@pytest.fixture(params=DEVICES)
def device(request):
    if request.param == "cuda":
        from deepspeed_loco.ops import loco_cuda
        loco_cuda.load()
    return request.param


def _errors(rows, widths, error_bits, device, gen):
    """The ops' error lists ``(values, scales)`` with non-zero remembered errors."""
    if error_bits == 0:
        return [], []
    buffers = [ErrorBuffer.zeros(rows, w, GROUP, error_bits, "cpu") for w in widths]
    for b in buffers:
        b.store_(torch.randn(rows, b.values.shape[1], generator=gen) * 0.1)
    values = [b.values.to(device) for b in buffers]
    return values, [b.scale.to(device) for b in buffers if b.scale is not None]


def _hop1_args(device, error_bits, hadamard, grid, dtype=torch.float32, world=4, local=2, bits=4):
    gen = torch.Generator().manual_seed(error_bits + 7 * hadamard)
    grads = [torch.randn(n, generator=gen).to(dtype).to(device) for n in NUMELS]
    widths = [padded_partition_size(n, world, GROUP) for n in NUMELS]
    values, scales = _errors(world, widths, error_bits, device, gen)
    send = WireLayout(tuple(widths), bits, GROUP).empty(world, device).zero_()
    return (grads, values, scales, send, world, local, bits, GROUP, 0.8, hadamard, grid)


@pytest.mark.parametrize("error_bits", [0, 8, 32])
@pytest.mark.parametrize("hadamard,grid", [(False, "symmetric"), (True, "midrise")])
def test_opcheck_quantize_bucket(device, error_bits, hadamard, grid):
    torch.library.opcheck(torch.ops.deepspeed_loco.quantize_bucket.default,
                          _hop1_args(device, error_bits, hadamard, grid) + (None, -1, None))  # none has a default


@pytest.mark.parametrize("error_bits", [0, 8, 32])
@pytest.mark.parametrize("grid", ["symmetric", "midrise"])
def test_opcheck_requantize_bucket(device, error_bits, grid):
    gen = torch.Generator().manual_seed(error_bits)
    world, local, in_bits, bits = 4, 2, 4, 2
    nodes = world // local
    widths = [padded_partition_size(n, world, GROUP) for n in NUMELS]
    recv = torch.randint(0, 256, (local * nodes, WireLayout(tuple(widths), in_bits, GROUP).row_bytes),
                         dtype=torch.uint8, generator=gen)
    recv = _with_scales(recv, WireLayout(tuple(widths), in_bits, GROUP), gen).to(device)
    values, scales = _errors(nodes, widths, error_bits, device, gen)
    send = WireLayout(tuple(widths), bits, GROUP).empty(nodes, device).zero_()
    torch.library.opcheck(torch.ops.deepspeed_loco.requantize_bucket.default,
                          (recv, values, scales, send, widths, world, local, bits, in_bits, local, GROUP, 0.5, grid,
                           None, None, -1, -1, None))


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hadamard,grid", [(False, "symmetric"), (True, "midrise")])
def test_opcheck_final_mean_bucket(device, out_dtype, hadamard, grid):
    gen = torch.Generator().manual_seed(3)
    world, bits = 4, 8
    wire = WireLayout(tuple(padded_partition_size(n, world, GROUP) for n in NUMELS), bits, GROUP)
    recv = _with_scales(torch.randint(0, 256, (world, wire.row_bytes), dtype=torch.uint8, generator=gen), wire,
                        gen).to(device)
    torch.library.opcheck(torch.ops.deepspeed_loco.final_mean_bucket.default,
                          (recv, list(NUMELS), world, bits, GROUP, hadamard, grid, 1, out_dtype,
                           None, None, -1))


def test_opcheck_gather_sample(device):
    gen = torch.Generator().manual_seed(4)
    tensors = [torch.randn(n, generator=gen).to(device) for n in NUMELS]
    owners = torch.arange(len(NUMELS), dtype=torch.int32).repeat_interleave(5)
    coords = torch.cat([torch.randint(-1, n, (5, ), generator=gen) for n in NUMELS])
    torch.library.opcheck(torch.ops.deepspeed_loco.gather_sample.default,
                          (tensors, owners, coords, torch.rand(len(NUMELS), generator=gen)))


@pytest.mark.parametrize("error_bits", [8, 32])
def test_a_parameter_without_elements_is_taken_with_error_feedback(device, error_bits):
    """A zero-element gradient in a bucket with error buffers (its buffers (rows, 0)): hop 1, hop 2 and the final
    mean through the ops give the reference's bytes, errors and means (on CUDA: the kernels, which skip it)."""
    gen = torch.Generator().manual_seed(error_bits)
    numels = (300, 0, 64)
    world, local = 4, 2
    widths = tuple(padded_partition_size(n, world, GROUP) for n in numels)
    grads = [torch.randn(n, generator=gen) for n in numels]
    args1 = HopArgs(world, local, 4, GROUP, 0.8)
    args2 = HopArgs(world, local, 2, GROUP, 0.8, in_bits=4, in_blocks=local)
    wire1, wire2 = WireLayout(widths, 4, GROUP), WireLayout(widths, 2, GROUP)
    errors = {}
    for rows in (world, world // local):
        errors[rows] = [ErrorBuffer.zeros(rows, w, GROUP, error_bits, "cpu") for w in widths]
        for e in errors[rows]:
            e.store_(torch.randn(rows, e.values.shape[1], generator=gen) * 0.1)
    copy = lambda t: None if t is None else t.to(device, copy=True)
    on_device = {rows: [ErrorBuffer(copy(e.values), copy(e.scale), GROUP) for e in buffers]
                 for rows, buffers in errors.items()}
    got1, want1 = wire1.empty(world, device).zero_(), wire1.empty(world, "cpu").zero_()
    OPS.quantize_bucket_([g.to(device) for g in grads], on_device[world], args1, wire1, got1)
    ref.quantize_bucket_(grads, errors[world], args1, wire1, want1)
    got2, want2 = wire2.empty(2, device).zero_(), wire2.empty(2, "cpu").zero_()
    OPS.requantize_bucket_(got1, wire1, on_device[2], args2, wire2, got2)
    ref.requantize_bucket_(want1, wire1, errors[2], args2, wire2, want2)
    means = OPS.final_mean_bucket(got2, wire2, args2.mean(), numels, 1, torch.float32)
    wanted = ref.final_mean_bucket(want2, wire2, args2.mean(), numels, 1, torch.float32)
    assert torch.equal(got1.cpu(), want1) and torch.equal(got2.cpu(), want2)
    assert [m.shape for m in means] == [w.shape for w in wanted] and means[1].numel() == 0
    assert all(torch.equal(m.cpu(), w) for m, w in zip(means, wanted))
    for buffers, wants in ((on_device[world], errors[world]), (on_device[2], errors[2])):
        for got, want in zip(buffers, wants):
            assert torch.equal(got.values.cpu(), want.values)
            assert got.scale is None or torch.equal(got.scale.cpu(), want.scale)


def test_the_reference_refuses_error_scales_that_do_not_fit_the_storage():
    """int8 error values need their scales and fp32 ones take none: ValueError naming ``error_scales``."""
    grads, send = [torch.randn(10)], torch.zeros(2, 20, dtype=torch.uint8)
    for values, scales, message in (([torch.zeros(2, 32, dtype=torch.int8)], [], "int8 error values take their fp32"),
                                    ([torch.zeros(2, 32)], [torch.zeros(2, 1)], "fp32 error values take no scales")):
        with pytest.raises(ValueError, match=message + r".* \(error_scales\)"):
            torch.ops.deepspeed_loco.quantize_bucket(grads, values, scales, send, 2, 2, 4, GROUP, 0.8, False,
                                                     "symmetric", None, -1, None)


def test_entry_points_check_the_kernels_size_limits_before_a_call():
    """A parameter or a bucket with more (row, group) pairs on a hop than the kernels index in 32 bits is refused
    before any op runs, naming the tensor and the limit (the wire buffer is never touched: it is too small)."""
    send = torch.empty(4, 8, dtype=torch.uint8)
    huge = (limits.MAX_PARAMETER_PAIRS // 4 + 1) * GROUP  # its 4 rows hold 4 pairs too many
    grads = [torch.zeros(1), torch.zeros(1)]
    with pytest.raises(ValueError, match=rf"grads\[1\] has 4 x {huge // GROUP} = \d+ \(row, group\) pairs on this hop, "
                       rf"above kMaxParameterPairs = {limits.MAX_PARAMETER_PAIRS} \(loco_limits.h\)"):
        OPS.quantize_bucket_(grads, [None, None], HopArgs(4, 2, 4, GROUP, 0.8), WireLayout((GROUP, huge), 4, GROUP),
                             send)
    half = limits.MAX_PARAMETER_PAIRS // 4 * GROUP  # each within the parameter limit, together above the launch's
    with pytest.raises(ValueError, match=rf"the bucket of widths \(3 tensors\) has \d+ \(row, group\) pairs on this "
                       rf"hop, above kMaxLaunchPairs = {limits.MAX_LAUNCH_PAIRS}"):
        wire = WireLayout((half, ) * 3, 4, GROUP)
        OPS.requantize_bucket_(send, wire, [None] * 3, HopArgs(16, 4, 4, GROUP, 0.8, in_bits=4, in_blocks=4), wire,
                               send)
    with pytest.raises(ValueError, match=r"numels\[0\] has 1 x"):
        OPS.final_mean_bucket(send, WireLayout(((limits.MAX_PARAMETER_PAIRS + 1) * GROUP, ), 4, GROUP),
                              MeanArgs(1, 4, GROUP), [1], 0, torch.float32)
    limits.check_launch((GROUP, ) * 3, limits.MAX_LAUNCH_PAIRS // 3, GROUP, "grads")  # at the limits: taken


def _with_scales(buffer, wire, gen):
    """``buffer`` with finite positive fp32 scales in place of random bytes (random bytes are often NaN scales)."""
    buffer[:, wire.data_bytes:].view(torch.float32).copy_(
        torch.rand(buffer.shape[0], wire.columns // GROUP, generator=gen) * 0.01 + 1e-3)
    return buffer


@pytest.mark.parametrize("error_bits", [0, 8, 32])
def test_entry_points_give_the_reference_bytes_on_cpu(error_bits):
    """The bucket entry points through the ops, against ``loco_reference``'s own, bit for bit."""
    grads, values, scales, send = _hop1_args("cpu", error_bits, False, "midrise")[:4]
    args = HopArgs(4, 2, 4, GROUP, 0.8, grid="midrise")
    wire = WireLayout(tuple(padded_partition_size(n, 4, GROUP) for n in NUMELS), 4, GROUP)
    buffers = [ErrorBuffer(v, s, GROUP) for v, s in zip(values, scales or [None] * len(values))] or [None] * 3
    twins = [b and ErrorBuffer(b.values.clone(), b.scale if b.scale is None else b.scale.clone(), GROUP)
             for b in buffers]
    want = wire.empty(4, "cpu")
    OPS.quantize_bucket_(grads, buffers, args, wire, send)
    ref.quantize_bucket_(grads, twins, args, wire, want)
    assert torch.equal(send, want)
    for b, t in zip(buffers, twins):
        assert b is None or (torch.equal(b.values, t.values) and (b.scale is None or torch.equal(b.scale, t.scale)))
    got = OPS.final_mean_bucket(send, wire, args.mean(), list(NUMELS), 1, torch.float32)
    expected = ref.final_mean_bucket(send, wire, args.mean(), list(NUMELS), 1, torch.float32)
    assert [g.shape for g in got] == [e.shape for e in expected]
    assert all(torch.equal(g, e) for g, e in zip(got, expected))


def test_entry_points_reject_a_wire_of_other_bits_and_keep_the_reference_errors():
    grads, _, _, send = _hop1_args("cpu", 0, False, "symmetric")[:4]
    args = HopArgs(4, 2, 4, GROUP, 0.8)
    with pytest.raises(ValueError, match="wire has 8 bits"):
        OPS.quantize_bucket_(grads, [None] * 3, args, WireLayout((96, 32, 32), 8, GROUP), send)
    wire = WireLayout(tuple(padded_partition_size(n, 4, GROUP) for n in NUMELS), 4, GROUP)
    with pytest.raises(ValueError, match="wire buffer send: expected rows of contiguous bytes"):
        OPS.quantize_bucket_(grads, [None] * 3, args, wire, wire.empty(4, "cpu").repeat(1, 2)[:, ::2])


def test_entry_points_refuse_a_bucket_mixing_parameters_with_and_without_error_buffers():
    """The error state gives every parameter of a hop its buffers or none: a mixed bucket is a caller's bug, refused
    naming the parameters without buffers (never computed another way), before any output is written."""
    grads, values, scales, send = _hop1_args("cpu", 8, False, "symmetric")[:4]
    errors = [ErrorBuffer(v, s, GROUP) for v, s in zip(values, scales)]
    errors[1] = None
    before = [e.values.clone() for e in errors if e is not None]
    send.fill_(7)
    with pytest.raises(ValueError, match=r"mixes parameters with and without error buffers \(none for parameters "
                                         r"\[1\] of 3\)"):
        OPS.quantize_bucket_(grads, errors, HopArgs(4, 2, 4, GROUP, 0.8),
                             WireLayout(tuple(padded_partition_size(n, 4, GROUP) for n in NUMELS), 4, GROUP), send)
    assert bool((send == 7).all())
    assert all(torch.equal(e.values, b) for e, b in zip([e for e in errors if e is not None], before))


def _reduce_step(grads, errors1, errors2, send1, send2):
    """A LoCo reduce step of a 4-rank world (2 nodes x 2) as one rank sees it, its exchanges replaced by the
    identity (the ops' inputs are what matters): hop 1, hop 2, the final mean."""
    args1, args2 = HopArgs(4, 2, 4, GROUP, 0.8, grid="midrise"), HopArgs(4, 2, 2, GROUP, 0.8, grid="midrise",
                                                                          in_bits=4, in_blocks=2)
    widths = tuple(padded_partition_size(g.numel(), 4, GROUP) for g in grads)
    wire1, wire2 = WireLayout(widths, 4, GROUP), WireLayout(widths, 2, GROUP)
    OPS.quantize_bucket_(grads, errors1, args1, wire1, send1)
    OPS.requantize_bucket_(send1, wire1, errors2, args2, wire2, send2)
    return OPS.final_mean_bucket(send2, wire2, args2.mean(), [g.numel() for g in grads], 1, grads[0].dtype)


def _step_inputs():
    gen = torch.Generator().manual_seed(11)
    grads = [torch.randn(n, generator=gen) for n in NUMELS]
    widths = [padded_partition_size(n, 4, GROUP) for n in NUMELS]
    errors1 = [ErrorBuffer.zeros(4, w, GROUP, 8, "cpu") for w in widths]
    errors2 = [ErrorBuffer.zeros(2, w, GROUP, 8, "cpu") for w in widths]
    send1 = WireLayout(tuple(widths), 4, GROUP).empty(4, "cpu")
    send2 = WireLayout(tuple(widths), 2, GROUP).empty(2, "cpu")
    return grads, errors1, errors2, send1, send2


def test_compiled_reduce_step_has_no_graph_break_and_matches_eager():
    import torch._dynamo
    torch._dynamo.reset()
    explained = torch._dynamo.explain(_reduce_step)(*_step_inputs())
    assert explained.graph_break_count == 0, explained.break_reasons
    ops = {str(n.target).removesuffix(".default") for g in explained.graphs for n in g.graph.nodes
           if n.op == "call_function"}
    assert {"deepspeed_loco.quantize_bucket", "deepspeed_loco.requantize_bucket",
            "deepspeed_loco.final_mean_bucket"} <= ops, ops
    eager, compiled = _step_inputs(), _step_inputs()
    compiled_step = torch.compile(_reduce_step, fullgraph=True, backend="aot_eager")
    for _ in range(2):  # the second step reads the errors the first one wrote
        want, got = _reduce_step(*eager), compiled_step(*compiled)
        assert all(torch.equal(w, g) for w, g in zip(want, got))
        assert torch.equal(eager[3], compiled[3]) and torch.equal(eager[4], compiled[4])
        for a, b in zip(eager[1] + eager[2], compiled[1] + compiled[2]):
            assert torch.equal(a.values, b.values) and torch.equal(a.scale, b.scale)
    torch._dynamo.reset()


def test_limits_have_one_source():
    assert limits.parse("constexpr int kWireBits[] = {2, 4};  // x\nconstexpr int kMaxGroupSize = 64;") == {
        "WIRE_BITS": (2, 4), "MAX_GROUP_SIZE": 64}
    assert config.SUPPORTED_GRAD_BITS == limits.WIRE_BITS == (2, 3, 4, 8)
    assert config.SUPPORTED_ERROR_BITS == tuple(s.bits for s in formats.STORED) == (4, 8, 32)
    assert (config.MIN_GROUP_SIZE, config.MAX_GROUP_SIZE) == (limits.MIN_GROUP_SIZE, limits.MAX_GROUP_SIZE)
    assert (limits.MAX_PARAMETER_PAIRS, limits.MAX_LAUNCH_PAIRS) == (2 ** 31 - 1 - 256, 2 ** 31 - 1)


@pytest.mark.gpu
def test_the_binding_exports_the_same_limits():
    from deepspeed_loco.ops import loco_cuda
    assert loco_cuda.load().limits() == limits.LIMITS


def test_kernels_config_key():
    assert config.LocoConfig().kernels == "auto"
    for value in ("auto", "cuda", "reference"):
        assert config.LocoConfig(kernels=value).kernels == value
    with pytest.raises(config.LocoConfigError, match=r'zeropp_loco_param.kernels = \'fast\' is invalid: it must be '
                       r'"auto", "cuda" or "reference"'):
        config.LocoConfig.from_dict({"kernels": "fast"})


@pytest.mark.slow
def test_compiled_reducer_has_no_graph_break_and_is_bit_identical(device, monkeypatch):
    """``LocoReducer.reduce_scatter`` itself (the plan's hops through ``kernels_for``'s entry points, profiler ranges,
    error state) under ``torch.compile(fullgraph=True)``: one graph, and the same means and error buffers as eager
    over two steps. The exchanges are the identity (one rank's view of a 2 x 2 world)."""
    _check_compiled_reducer(device, monkeypatch)


@pytest.mark.slow  # a torch.compile of the reducer: about 1 s on a 2-core CPU, at the fast tier's budget
def test_compiled_reducer_through_the_ops_has_no_graph_break_on_the_cpu(monkeypatch):
    """The same through the ``deepspeed_loco`` ops (the entry points CUDA tensors take, here on CPU tensors, which
    the ops run with the reference), so that the CPU run checks what a compiled CUDA reduce traces: torch 2.11
    could not trace the ops' argument packing (``vars`` of the hop's arguments) and broke the graph there."""
    from deepspeed_loco import ops
    from deepspeed_loco.runtime.comm import loco_reduce

    monkeypatch.setattr(loco_reduce, "kernels_for", lambda device, mode="auto": ops.CUDA)
    _check_compiled_reducer("cpu", monkeypatch)


def _check_compiled_reducer(device, monkeypatch):
    import types

    import torch._dynamo

    from deepspeed_loco.runtime.comm.loco_reduce import LocoReducer

    def reducer():
        topology = types.SimpleNamespace(world_size=4, local_size=2, rank=1,
                                         exchanges={"intra_node": torch.clone, "inter_node": torch.clone})
        return LocoReducer.for_topology(config.LocoConfig(group_size=GROUP, inter_node_bits=2), topology)

    monkeypatch.delenv("DS_LOCO_KERNELS", raising=False)
    gen = torch.Generator().manual_seed(5)
    names = ["a", "b", "c"]
    steps = [[torch.randn(n, generator=gen).to(device) for n in NUMELS] for _ in range(2)]
    eager, compiled = reducer(), reducer()
    compiled.reduce_scatter(names, steps[0])  # buffers are created on first use, outside the graph
    eager.reduce_scatter(names, steps[0])
    torch._dynamo.reset()
    explained = torch._dynamo.explain(compiled.reduce_scatter)(names, steps[1])
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    eager.reduce_scatter(names, steps[1])  # explain ran the step once on `compiled`
    step = torch.compile(compiled.reduce_scatter, fullgraph=True, backend="aot_eager")
    for grads in steps:
        want, got = eager.reduce_scatter(names, grads), step(names, grads)
        assert all(torch.equal(w, g) for w, g in zip(want, got))
    for (_, _, a), (_, _, b) in zip(eager.state.named_buffers(), compiled.state.named_buffers()):
        assert torch.equal(a.values, b.values) and torch.equal(a.scale, b.scale)
    torch._dynamo.reset()


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_the_header_compiles_to_the_limits_python_parses(tmp_path):
    """``loco_limits.h`` as C++ sees it (compiled with g++) against ``deepspeed_loco.layout.limits``."""
    program = tmp_path / "limits.cpp"
    program.write_text('#include <cstdio>\n#include "loco_limits.h"\nusing namespace loco::limits;\n'
                       'int main() {\n  for (int b : kWireBits) std::printf("%d ", b);\n'
                       '  std::printf("| %d %d | %d %d\\n", kMinGroupSize, kMaxGroupSize, kMaxParameterPairs, '
                       'kMaxLaunchPairs);\n}\n')
    binary = tmp_path / "limits"
    subprocess.run(["g++", "-std=c++17", f"-I{limits.HEADER.parent}", str(program), "-o", str(binary)], check=True)
    wire, groups, pairs = subprocess.run([str(binary)], check=True, capture_output=True,
                                         text=True).stdout.split("|")
    assert tuple(map(int, wire.split())) == limits.WIRE_BITS
    assert tuple(map(int, groups.split())) == (limits.MIN_GROUP_SIZE, limits.MAX_GROUP_SIZE)
    assert tuple(map(int, pairs.split())) == (limits.MAX_PARAMETER_PAIRS, limits.MAX_LAUNCH_PAIRS)
