"""The formats (``deepspeed_loco/layout/formats.py``) and their C++ mirror (``csrc/quantization/loco_formats.h``): the
header compiled with g++ gives the same enumerators, values, grid table and levels, and nothing more."""
import shutil
import subprocess

import pytest
import torch

from deepspeed_loco.layout import GRID_NAMES, GRIDS, STORED, ErrorStorage, Rounding, formats, grid_named, limits
from deepspeed_loco.ops.quantizer import dequantize_groups, quantize_groups


def _camel(name: str) -> str:
    """``NEAREST_EVEN`` -> ``kNearestEven``: a Python member's C++ enumerator."""
    return "k" + "".join(part.capitalize() for part in name.split("_"))


def _enum_lines(cpp_enum: str, members) -> str:
    """C++ printing each member's value, and a switch over them that fails to compile (-Werror=switch) when the C++
    enum has an enumerator that Python does not."""
    cases = " ".join(f"case loco::{cpp_enum}::{_camel(m.name)}: break;" for m in members)
    prints = " ".join(f'std::printf("{m.name} %d\\n", (int)loco::{cpp_enum}::{_camel(m.name)});' for m in members)
    return f"  {prints}\n  switch (loco::{cpp_enum}(0)) {{ {cases} }}\n"


@pytest.fixture(scope="module")
def mirror(tmp_path_factory):
    """The lines the C++ mirror prints: enum values, cell centres, the grid table, the levels at every wire width."""
    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    folder = tmp_path_factory.mktemp("formats")
    levels = " ".join(
        f'{{ const loco::math::Levels l = loco::math::levels({bits}, loco::Rounding::{_camel(r.name)}); '
        f'std::printf("levels {r.name} {bits} %.9g %.9g %.9g %.9g\\n", l.divisor.d, l.low, l.high, l.half); }}'
        for r in Rounding for bits in limits.WIRE_BITS)
    program = (
        '#include <cstdio>\n#define LOCO_NO_LAUNCHERS\n#include "loco_kernels.cuh"\nint main() {\n'
        + _enum_lines("ErrorStorage", ErrorStorage) + _enum_lines("Rounding", Rounding)
        + " ".join(f'{{ constexpr loco::StorageFormat f = loco::storage_format(loco::ErrorStorage::{_camel(s.name)}); '
                   f'std::printf("format {s.name} %d %d %d\\n", f.bits, f.per_element, (int)f.scaled); }}'
                   for s in ErrorStorage)
        + " ".join(f'std::printf("centre {r.name} %g\\n", loco::cell_centre(loco::Rounding::{_camel(r.name)}));'
                   for r in Rounding)
        + '\n  for (const loco::Grid& g : loco::kGrids) std::printf("grid %s %d\\n", g.name, (int)g.rounding);\n  '
        + levels + "\n}\n")
    (folder / "mirror.cpp").write_text(program)
    binary = folder / "mirror"
    subprocess.run(["g++", "-std=c++17", "-Werror=switch", f"-I{limits.HEADER.parent}", str(folder / "mirror.cpp"),
                    "-o", str(binary)], check=True)
    return subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout.splitlines()


def test_the_error_storages_and_roundings_have_their_cpp_values(mirror):
    values = dict(line.split() for line in mirror if len(line.split()) == 2)
    assert {name: int(value) for name, value in values.items()} == {
        **{m.name: int(m) for m in ErrorStorage}, **{m.name: int(m) for m in Rounding}}
    centres = [line.split()[1:] for line in mirror if line.startswith("centre ")]
    assert [(name, float(c)) for name, c in centres] == [(r.name, r.cell_centre) for r in Rounding]


def test_the_grid_table_is_the_cpp_table(mirror):
    rows = [line.split()[1:] for line in mirror if line.startswith("grid ")]
    assert [(name, int(rounding)) for name, rounding in rows] == [(g.name, int(g.rounding)) for g in GRIDS.values()]
    assert GRID_NAMES == tuple(GRIDS) == ("symmetric", "midrise")


def test_every_grid_has_the_kernels_levels_at_every_wire_width(mirror):
    got = {(r, int(b)): tuple(float(x) for x in rest)
           for _, r, b, *rest in (line.split() for line in mirror if line.startswith("levels "))}
    for grid in GRIDS.values():
        for bits in limits.WIRE_BITS:
            lv = grid.levels(bits)
            assert got[(grid.rounding.name, bits)] == (lv.divisor, lv.low, lv.high, lv.half), (grid.name, bits)


@pytest.mark.parametrize("bits", limits.WIRE_BITS)
def test_a_grids_levels_are_what_its_quantizer_produces(bits):
    """The extreme values ``(low + half) * s`` and ``(high + half) * s`` are ``-absmax`` and ``absmax`` (the
    values are symmetric about zero), and quantizing a group spanning ``[-absmax, absmax]`` uses exactly the codes
    ``low .. high``."""
    group = 4096
    c = torch.linspace(-3.0, 3.0, group).unsqueeze(0)
    for grid in GRIDS.values():
        lv = grid.levels(bits)
        q, scale = quantize_groups(c, bits, group, grid.name)
        assert (lv.high + lv.half) * float(scale) == pytest.approx(3.0, rel=1e-6)
        assert (lv.low + lv.half) * float(scale) == pytest.approx(-3.0, rel=1e-6)
        assert set(q.unique().tolist()) == set(range(lv.low, lv.high + 1)), grid.name
        error = (c - dequantize_groups(q, scale, group, grid.name)).abs().max()
        assert float(error) <= float(scale) * (0.5 + 1e-5)


def test_error_storages():
    assert [s.bits for s in STORED] == [4, 8, 32] and ErrorStorage.of_bits(8) is ErrorStorage.INT8
    assert [s.label for s in ErrorStorage] == ["none", "int4", "int8", "fp32"]
    assert [(s.values_dtype, s.scaled) for s in STORED] == [(torch.uint8, True), (torch.int8, True),
                                                            (torch.float32, False)]
    assert ErrorStorage.INT4.row_bytes(512, 256) == 256 + 2 * 4 and ErrorStorage.INT4.values_shape(3, 512) == (3, 256)
    assert ErrorStorage.INT8.row_bytes(512, 256) == 512 + 2 * 4 and ErrorStorage.FP32.row_bytes(512, 256) == 2048
    assert [ErrorStorage.of_values(s.values_dtype) for s in STORED] == list(STORED)
    with pytest.raises(ValueError, match=r"error values of dtype torch.float16: an error buffer holds torch.uint8 "
                       r"\(int4\) or torch.int8 \(int8\) or torch.float32 \(fp32\) values"):
        ErrorStorage.of_values(torch.float16)
    with pytest.raises(ValueError, match="error_bits 16: an error buffer stores 4, 8, 32 bits"):
        ErrorStorage.of_bits(16)
    with pytest.raises(ValueError, match="holds no values"):
        ErrorStorage.NONE.values_dtype


def test_each_storage_format_is_the_cpp_descriptor(mirror):
    got = {name: tuple(int(x) for x in rest) for _, name, *rest in
           (line.split() for line in mirror if line.startswith("format "))}
    assert got == {s.name: (s.format.bits, s.format.per_element, int(s.format.scaled)) for s in ErrorStorage}


def test_an_unknown_grid_is_refused_naming_the_valid_ones():
    assert grid_named("midrise") is GRIDS["midrise"] and formats.GRIDS["symmetric"].rounding is Rounding.NEAREST_EVEN
    with pytest.raises(ValueError, match="quantization grid 'uniform': must be 'symmetric' or 'midrise'"):
        grid_named("uniform")
