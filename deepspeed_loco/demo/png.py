"""A dependency-free PNG line chart (zlib + struct): panels of line series with axes, ticks and a legend.

Text uses a built-in 5x7 bitmap font (upper case, digits, a little punctuation), drawn at 2x.
"""
import math
import struct
import zlib
from typing import List, Optional, Sequence, Tuple

Color = Tuple[int, int, int]

# 5x7 glyphs: 35 characters per glyph, row by row, "#" = ink.
_FONT = {
    "0": ".###.#...##..###.#.###..##...#.###.", "1": "..#...##....#....#....#....#...###.",
    "2": ".###.#...#....#...#...#...#...#####", "3": "####.....#....#.###.....#....#####.",
    "4": "...#...##..#.#.#..#.#####...#....#.", "5": "######....####.....#....##...#.###.",
    "6": ".###.#....#....####.#...##...#.###.", "7": "#####....#...#...#...#....#....#...",
    "8": ".###.#...##...#.###.#...##...#.###.", "9": ".###.#...##...#.####....#....#.###.",
    "A": ".###.#...##...#######...##...##...#", "B": "####.#...##...#####.#...##...#####.",
    "C": ".###.#...##....#....#....#...#.###.", "D": "####.#...##...##...##...##...#####.",
    "E": "######....#....####.#....#....#####", "F": "######....#....####.#....#....#....",
    "G": ".###.#...##....#.####...##...#.####", "H": "#...##...##...#######...##...##...#",
    "I": ".###...#....#....#....#....#...###.", "J": "..###...#....#....#....##..#..##...",
    "K": "#...##..#.#.#..##...#.#..#..#.#...#", "L": "#....#....#....#....#....#....#####",
    "M": "#...###.###.#.##.#.##...##...##...#", "N": "#...##...###..##.#.##..###...##...#",
    "O": ".###.#...##...##...##...##...#.###.", "P": "####.#...##...#####.#....#....#....",
    "Q": ".###.#...##...##...##.#.##..#..##.#", "R": "####.#...##...#####.#.#..#..#.#...#",
    "S": ".#####....#.....###.....#....#####.", "T": "#####..#....#....#....#....#....#..",
    "U": "#...##...##...##...##...##...#.###.", "V": "#...##...##...##...##...#.#.#...#..",
    "W": "#...##...##...##.#.##.#.##.#.#.#.#.", "X": "#...##...#.#.#...#...#.#.#...##...#",
    "Y": "#...##...#.#.#...#....#....#....#..", "Z": "#####....#...#...#...#...#....#####",
    "x": "..........#...#.#.#...#...#.#.#...#", " ": "." * 35,
    ".": "." * 25 + ".##...##..", ",": "....................##....#...#....",
    "-": "...............#####...............", "+": ".......#....#..#####..#....#.......",
    "(": "...#...#...#....#....#.....#.....#.", ")": ".#.....#.....#....#....#...#...#...",
    ":": "......##...##........##...##.......", "/": "." * 5 + "....#...#...#...#...#...." + "." * 5,
    "%": "##..###.#....#...#...#....#.###..##", "=": "..........#####.....#####..........",
    "_": "..............................#####", "?": ".###.#...#....#...#...#.........#..",
}

PALETTE = [(20, 20, 20), (230, 120, 20), (30, 100, 220), (200, 40, 40), (40, 160, 60), (150, 60, 190),
           (120, 120, 120), (0, 170, 180)]


class Canvas:

    def __init__(self, width: int, height: int, background: Color = (255, 255, 255)):
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(background) * (width * height))
        self.clip = (0, 0, width - 1, height - 1)

    def set(self, x: int, y: int, color: Color) -> None:
        x0, y0, x1, y1 = self.clip
        if x0 <= x <= x1 and y0 <= y <= y1:
            i = 3 * (y * self.width + x)
            self.pixels[i:i + 3] = bytes(color)

    def rect(self, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
        for y in range(max(y0, 0), min(y1, self.height - 1) + 1):
            for x in range(max(x0, 0), min(x1, self.width - 1) + 1):
                self.set(x, y, color)

    def line(self, xa: float, ya: float, xb: float, yb: float, color: Color, width: int = 1) -> None:
        steps = int(max(abs(xb - xa), abs(yb - ya))) + 1
        lo, hi = -(width // 2), (width - 1) // 2
        for i in range(steps + 1):
            t = i / steps
            x, y = round(xa + (xb - xa) * t), round(ya + (yb - ya) * t)
            for dy in range(lo, hi + 1):
                for dx in range(lo, hi + 1):
                    self.set(x + dx, y + dy, color)

    def text(self, x: int, y: int, text: str, color: Color = (0, 0, 0), scale: int = 2, anchor: str = "left") -> None:
        """Draws ``text`` with its top at ``y``; ``anchor`` left, center or right of ``x``."""
        width = text_width(text, scale)
        x -= width if anchor == "right" else width // 2 if anchor == "center" else 0
        for ch in text:
            glyph = _FONT.get(ch, _FONT.get(ch.upper(), _FONT["?"]))
            for k, ink in enumerate(glyph):
                if ink == "#":
                    row, col = divmod(k, 5)
                    for dy in range(scale):
                        for dx in range(scale):
                            self.set(x + col * scale + dx, y + row * scale + dy, color)
            x += 6 * scale

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(self.pixels[3 * y * self.width:3 * (y + 1) * self.width])
                       for y in range(self.height))

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


def text_width(text: str, scale: int = 2) -> int:
    return max(0, 6 * scale * len(text) - scale)


def nice_ticks(lo: float, hi: float, count: int = 5) -> List[float]:
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / max(count, 1)
    mag = 10**math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    ticks, t = [], first
    while t <= hi + 1e-9 * step:
        ticks.append(round(t, 10))
        t += step
    return ticks


def _fmt(value: float, step: float) -> str:
    decimals = max(0, -math.floor(math.log10(step) + 1e-9)) if step < 1 else 0
    if step * 10**decimals % 1:
        decimals += 1
    return f"{value:.{decimals}f}"


class Series:

    def __init__(self, label: str, points: Sequence[Tuple[float, float]], color: Color, width: int = 2,
                 markers: bool = False):
        self.label, self.points, self.color, self.width, self.markers = label, list(points), color, width, markers


class Panel:

    def __init__(self, title: str, xlabel: str, series: Sequence[Series], ylim: Optional[Tuple[float, float]] = None):
        self.title, self.xlabel, self.series, self.ylim = title, xlabel, list(series), ylim


def draw_panel(canvas: Canvas, panel: Panel, box: Tuple[int, int, int, int]) -> None:
    left, top, right, bottom = box
    ink, grid = (0, 0, 0), (225, 225, 225)
    canvas.text((left + right) // 2, top - 34, panel.title, ink, anchor="center")
    canvas.text((left + right) // 2, bottom + 30, panel.xlabel, ink, anchor="center")
    points = [p for s in panel.series for p in s.points if all(map(math.isfinite, p))]
    if not points:
        canvas.text((left + right) // 2, (top + bottom) // 2, "NO DATA", ink, anchor="center")
        return
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    xlo, xhi = min(xs), max(xs)
    if xhi <= xlo:
        xhi = xlo + 1
    ylo, yhi = panel.ylim or (min(ys), max(ys))
    if yhi <= ylo:
        yhi, ylo = yhi + 0.5, ylo - 0.5
    pad = 0.05 * (yhi - ylo)
    ylo, yhi = ylo - pad, yhi + pad
    px = lambda x: left + (x - xlo) / (xhi - xlo) * (right - left)
    py = lambda y: bottom - (y - ylo) / (yhi - ylo) * (bottom - top)
    yticks = nice_ticks(ylo, yhi, 6)
    for t in yticks:
        y = round(py(t))
        canvas.line(left, y, right, y, grid)
        canvas.line(left - 5, y, left, y, ink)
        canvas.text(left - 9, y - 7, _fmt(t, yticks[1] - yticks[0] if len(yticks) > 1 else 1), ink, anchor="right")
    xticks = nice_ticks(xlo, xhi, 5)
    for t in xticks:
        x = round(px(t))
        canvas.line(x, top, x, bottom, grid)
        canvas.line(x, bottom, x, bottom + 5, ink)
        canvas.text(x, bottom + 9, _fmt(t, xticks[1] - xticks[0] if len(xticks) > 1 else 1), ink, anchor="center")
    canvas.clip = (left, top, right, bottom)
    for s in panel.series:
        pts = [(px(x), py(y)) for x, y in s.points if math.isfinite(x) and math.isfinite(y)]
        for (xa, ya), (xb, yb) in zip(pts, pts[1:]):
            canvas.line(xa, ya, xb, yb, s.color, s.width)
        if s.markers:
            for x, y in pts:
                canvas.rect(round(x) - 3, round(y) - 3, round(x) + 3, round(y) + 3, s.color)
    canvas.clip = (0, 0, canvas.width - 1, canvas.height - 1)
    for a, b in (((left, top), (right, top)), ((left, bottom), (right, bottom)), ((left, top), (left, bottom)),
                 ((right, top), (right, bottom))):
        canvas.line(*a, *b, ink)
    # legend, top right
    rows = [s for s in panel.series if s.label]
    if rows:
        w = max(text_width(s.label) for s in rows) + 50
        x0, y0 = right - w - 8, top + 8
        canvas.rect(x0, y0, right - 8, y0 + 22 * len(rows) + 8, (255, 255, 255))
        for i, s in enumerate(rows):
            y = y0 + 8 + 22 * i
            canvas.line(x0 + 8, y + 7, x0 + 36, y + 7, s.color, 3)
            canvas.text(x0 + 44, y, s.label, ink)


def line_chart(panels: Sequence[Panel], title: str = "", panel_size: Tuple[int, int] = (560, 400)) -> bytes:
    """PNG bytes of ``panels`` side by side under ``title``."""
    pw, ph = panel_size
    margin_l, margin_r, margin_t, margin_b = 90, 30, 80 + (30 if title else 0), 60
    width = len(panels) * (pw + margin_l + margin_r)
    height = ph + margin_t + margin_b
    canvas = Canvas(width, height)
    if title:
        canvas.text(width // 2, 14, title, (0, 0, 0), anchor="center")
    for i, panel in enumerate(panels):
        left = i * (pw + margin_l + margin_r) + margin_l
        draw_panel(canvas, panel, (left, margin_t, left + pw, margin_t + ph))
    return canvas.png()
