import pytest
import torch

from deepspeed_loco.layout import WireLayout


def test_views_are_the_parameters_bytes_and_scales_in_place():
    wire = WireLayout((64, 32), 4, 32)  # 48 data bytes, then 3 fp32 scales per row
    buffer = torch.arange(2 * wire.row_bytes, dtype=torch.int64).to(torch.uint8).view(2, wire.row_bytes)
    data, scales = wire.views(buffer, 1, 64)
    assert data.shape == (2, 16) and data.data_ptr() == buffer[:, 32:].data_ptr()
    assert scales.shape == (2, 1) and scales.data_ptr() == buffer[:, 48 + 8:].data_ptr()


def test_views_of_a_buffer_without_contiguous_rows_raise_naming_the_wire_buffer():
    wire = WireLayout((64,), 4, 32)
    strided = wire.empty(2, "cpu").repeat(1, 2)[:, ::2]
    with pytest.raises(ValueError, match=r"wire buffer: expected rows of contiguous bytes .* strides \(80, 2\)"):
        wire.views(strided, 0, 0)
