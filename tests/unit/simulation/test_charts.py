"""The matplotlib line charts: a valid PNG of the requested size, panels in rows, each curve drawn in its colour, the
reference curve visible where another lies on it."""
import io
import math

import pytest

from deepspeed_loco.simulation.charts import Panel, Series, line_chart
from tests.extras import needs_extra

image = needs_extra("matplotlib.image", "report")


def _pixels(png: bytes):
    return (image.imread(io.BytesIO(png))[..., :3] * 255).round().astype(int)


def _colours(png: bytes):
    pixels = _pixels(png)
    return pixels.shape, {tuple(p) for p in pixels.reshape(-1, 3).tolist()}


def _count(png: bytes, colour) -> int:
    return int((_pixels(png) == colour).all(axis=-1).sum())


@pytest.mark.slow
def test_line_chart_draws_every_curve_in_its_colour():
    series = [Series("A", [(i, math.exp(-i / 20)) for i in range(100)], (200, 0, 0)),
              Series("B", [(0, float("nan")), (50, 0.5), (99, 0.1)], (0, 0, 200), markers=True)]
    png = line_chart([Panel("loss", "step", "loss", series), Panel("empty", "step", "loss", [])], title="test",
                     panel_size=(400, 300))
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    shape, colours = _colours(png)
    assert shape[:2] == (300, 800)
    assert (200, 0, 0) in colours and (0, 0, 200) in colours


def test_a_zoomed_panel_hides_what_is_outside_and_an_unzoomed_one_shows_it():
    """ylim cuts curves off; the demo's validation panel passes None so that every curve stays in view."""
    outlier = Series("far", [(0, 50.0), (1, 60.0)], (0, 160, 0))
    near = Series("near", [(0, 1.0), (1, 1.1)], (0, 0, 0))
    green = (0, 160, 0)
    zoomed = _count(line_chart([Panel("v", "step", "loss", [near, outlier], ylim=(0.9, 1.2))]), green)
    whole = _count(line_chart([Panel("v", "step", "loss", [near, outlier])]), green)
    assert whole > 3 * zoomed  # in the zoomed panel only the legend's swatch is left of the outlier


def test_xlim_starts_the_x_axis_where_asked():
    early = Series("early", [(0, 1.0), (40, 1.0)], (0, 160, 0))
    late = Series("late", [(50, 1.0), (100, 1.1)], (0, 0, 0))
    green = (0, 160, 0)
    cut = _count(line_chart([Panel("v", "step", "loss", [early, late], xlim=(50, 100))]), green)
    whole = _count(line_chart([Panel("v", "step", "loss", [early, late])]), green)
    assert whole > 3 * cut  # only the legend's swatch is left of the early curve


@pytest.mark.slow
@pytest.mark.parametrize("count, columns, grid", [(4, 2, (2, 2)), (3, 2, (2, 2)), (2, None, (1, 2)), (1, 3, (1, 1))])
def test_panels_go_in_rows_of_the_columns_asked(count, columns, grid):
    panels = [Panel(f"p{i}", "step", "loss", [Series("A", [(0, 1.0), (1, 0.5)], (200, 0, 0))]) for i in range(count)]
    shape, _ = _colours(line_chart(panels, panel_size=(300, 200), columns=columns))
    assert shape[:2] == (200 * grid[0], 300 * grid[1])


def test_a_reference_curve_stays_visible_where_another_lies_on_it():
    """Full precision comes first and the others often lie on it: as a reference it is drawn on top, dashed."""
    points = [(i, math.exp(-i / 20)) for i in range(100)]
    green = (0, 160, 0)  # not black: the axes' text is black

    def green_pixels(reference: bool) -> int:
        series = [Series("full", points, green, reference=reference), Series("plain", points, (200, 0, 0))]
        return _count(line_chart([Panel("loss", "step", "loss", series)]), green)

    assert green_pixels(True) > 3 * green_pixels(False)  # not a reference: hidden but for its legend swatch
