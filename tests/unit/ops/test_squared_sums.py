"""deepspeed_loco.ops.squared_sums: the runs cover every value once, the sums equal an fp64 reference (exactly, up to
fp64 rounding, for scaled error buffers), and the number of kernels dispatched does not grow with the number of
tensors."""
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from deepspeed_loco.layout.formats import STORED
from deepspeed_loco.ops.error_buffer import ErrorBuffer
from deepspeed_loco.ops.squared_sums import error_squared_sum, runs, squared_sum

GROUP = 256


@pytest.mark.parametrize("lengths,limit,align", [([5, 3, 8], 4, 1), ([8, 4, 12], 8, 4), ([0, 7, 0, 9], 5, 1),
                                                 ([1024, 256], 1000, 256), ([3], 100, 1)])
def test_runs_cover_every_element_once_in_order_within_the_limit(lengths, limit, align):
    covered = {index: [] for index in range(len(lengths))}
    for run in runs(lengths, limit, align):
        assert run and sum(stop - start for _, start, stop in run) <= limit
        for index, start, stop in run:
            assert start % align == 0 and stop % align == 0 and start < stop
            covered[index].append((start, stop))
    for index, length in enumerate(lengths):
        flat = [i for start, stop in covered[index] for i in range(start, stop)]
        assert flat == list(range(length))


def test_runs_refuse_a_limit_below_the_alignment():
    with pytest.raises(ValueError, match="limit 128 must be at least align 256"):
        list(runs([512], 128, 256))


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]  # the telemetry reads the buffers where they are


def _buffers(storage, shapes, seed=0, device="cpu"):
    generator = torch.Generator().manual_seed(seed)
    buffers = []
    for rows, cols in shapes:
        buffer = ErrorBuffer.zeros(rows, cols, GROUP, storage, device)
        values = torch.randn(rows, cols, generator=generator) * torch.rand(rows, cols, generator=generator)
        buffer.store_(values.to(device))
        buffers.append(buffer)
    return buffers


def _exact_squares(buffer: ErrorBuffer) -> torch.Tensor:
    """``||e||^2`` in fp64 from the codes and scales (each product exact in fp64), or the fp32 values."""
    if buffer.scale is None:
        return buffer.values.double().square().sum()
    rows, cols = buffer.shape
    codes = buffer.codes.double().reshape(rows, cols // GROUP, GROUP)
    return (codes * buffer.scale.double()[..., None]).square().sum()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("storage", STORED, ids=lambda s: s.label)
@pytest.mark.parametrize("limit", [GROUP, 3 * GROUP, 5000, 1 << 24])
def test_error_squared_sum_equals_the_dequantized_errors_squares(storage, limit, device):
    buffers = _buffers(storage, [(3, 512), (1, 256), (5, 1024), (2, 2048)], device=device)
    expected = sum(_exact_squares(b) for b in buffers)
    got = error_squared_sum(buffers, device, limit)
    assert got.dtype == torch.float64 and got.dim() == 0
    # scaled: every term exact, only fp64 summation order differs; fp32: each run's norm accumulates in fp32
    tolerance = 1e-12 if storage.scaled else 1e-5
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=0)


def test_error_squared_sum_of_mixed_storages_and_of_none():
    buffers = _buffers(STORED[0], [(2, 512)]) + _buffers(STORED[1], [(1, 256)], seed=1)
    torch.testing.assert_close(error_squared_sum(buffers, "cpu"), sum(_exact_squares(b) for b in buffers),
                               rtol=1e-12, atol=0)
    assert float(error_squared_sum([], "cpu")) == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("limit", [7, 100, 1 << 24])
def test_squared_sum_equals_the_fp64_sum_of_squares(dtype, limit):
    generator = torch.Generator().manual_seed(2)
    tensors = [torch.randn(shape, generator=generator).to(dtype) for shape in [(3, 5), (17,), (4, 4, 4), (1,)]]
    expected = sum(t.double().square().sum() for t in tensors)
    torch.testing.assert_close(squared_sum(tensors, "cpu", limit), expected, rtol=1e-5, atol=0)
    assert float(squared_sum([], "cpu")) == 0.0


class _KernelCount(TorchDispatchMode):
    """Counts the ops dispatched that compute (views excluded): one kernel launch each on an accelerator."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("storage", STORED, ids=lambda s: s.label)
def test_launches_do_not_grow_with_the_number_of_buffers(storage):
    few, many = _buffers(storage, [(2, 2048)] * 2), _buffers(storage, [(1, 256)] * 32)  # the same 8192 values

    def launches(buffers):
        values = [b.values.float() for b in buffers]
        counter = _KernelCount()
        with counter:
            error_squared_sum(buffers, "cpu")
            squared_sum(values, "cpu")
        return counter.ops

    launches(few)  # the table of squared codes, built once per storage and device
    assert launches(few) == launches(many)


@pytest.mark.parametrize("gap", [0, 5])
def test_tensors_back_to_back_in_one_buffer_are_read_without_a_copy(gap):
    """A bucket's gradients as views of one flat buffer, listed out of memory order (DeepSpeed 0.19.8's contiguous
    gradients: the buffer in the order the gradients arrived in backward): one view spans them, no concatenation; a
    gap between them falls back to the concatenation, with the same sum."""
    flat = torch.randn(1000 + gap, generator=torch.Generator().manual_seed(3))
    tensors = [flat[300 + gap:].view(-1), flat[:300].view(10, 30)]
    expected = sum(t.double().square().sum() for t in tensors)
    counter = _KernelCount()
    with counter:
        got = squared_sum(tensors, "cpu")
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)
    assert counter.ops["aten.cat"] == (1 if gap else 0)
