"""The dependency-free PNG writer produces a valid PNG with the drawn content."""
import math
import struct
import zlib

from deepspeed_loco.demo.png import Canvas, Panel, Series, line_chart, nice_ticks


def _chunks(png: bytes):
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    pos, out = 8, []
    while pos < len(png):
        (length, ) = struct.unpack(">I", png[pos:pos + 4])
        kind, body = png[pos + 4:pos + 8], png[pos + 8:pos + 8 + length]
        (crc, ) = struct.unpack(">I", png[pos + 8 + length:pos + 12 + length])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF, kind
        out.append((kind, body))
        pos += 12 + length
    return out


def _decode(png: bytes):
    chunks = _chunks(png)
    assert [k for k, _ in chunks][0] == b"IHDR" and chunks[-1][0] == b"IEND"
    width, height, depth, color, _, _, _ = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, color) == (8, 2)
    raw = zlib.decompress(b"".join(b for k, b in chunks if k == b"IDAT"))
    assert len(raw) == height * (1 + 3 * width)
    return width, height, raw


def test_canvas_roundtrip():
    canvas = Canvas(7, 5)
    canvas.set(3, 2, (10, 20, 30))
    width, height, raw = _decode(canvas.png())
    assert (width, height) == (7, 5)
    row = raw[2 * (1 + 21):3 * (1 + 21)]
    assert row[0] == 0 and row[1 + 9:1 + 12] == bytes([10, 20, 30])


def test_line_chart_valid_and_drawn():
    series = [Series("A", [(i, math.exp(-i / 20)) for i in range(100)], (200, 0, 0)),
              Series("B", [(0, float("nan")), (50, 0.5), (99, 0.1)], (0, 0, 200), markers=True)]
    png = line_chart([Panel("loss", "step", series), Panel("empty", "step", [])], title="test 2x2")
    width, height, raw = _decode(png)
    assert width > 1000 and height > 400
    assert bytes([200, 0, 0]) in raw and bytes([0, 0, 200]) in raw


def test_nice_ticks():
    assert nice_ticks(0, 100, 5) == [0, 20, 40, 60, 80, 100]
    ticks = nice_ticks(1.83, 2.31, 6)
    assert all(1.83 <= t <= 2.31 for t in ticks) and len(ticks) >= 3
    assert nice_ticks(1.0, 1.0) != []
