"""Line charts for the simulation report, the demo and the benchmarks, drawn with matplotlib (Agg, no display needed;
matplotlib is the `report` extra, imported when a chart is drawn)."""
import io
import math
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

from deepspeed_loco.utils.extras import import_extra

Color = Tuple[int, int, int]  # RGB, 0-255


@dataclass
class Series:
    """One curve: ``points`` ``(x, y)`` (non-finite y are left out), an RGB ``color``, optional markers.
    ``reference``: the curve the others are read against (full precision): drawn dashed and above the others, so
    that it stays visible where they lie on it."""
    label: str
    points: Sequence[Tuple[float, float]]
    color: Color
    width: float = 1.6
    markers: bool = False
    reference: bool = False


@dataclass
class Panel:
    """One plot: its title, axis labels and curves; ``ylim`` ``(low, high)`` zooms the y axis (plus 5% margins), None
    shows every point of every curve; ``xlim`` the same for the x axis (plus 2% margins, so end markers stay whole)."""
    title: str
    xlabel: str
    ylabel: str
    series: List[Series] = field(default_factory=list)
    ylim: Optional[Tuple[float, float]] = None
    xlim: Optional[Tuple[float, float]] = None


def line_chart(panels: Sequence[Panel], title: str = "", panel_size: Tuple[int, int] = (560, 400),
               columns: Optional[int] = None) -> bytes:
    """PNG bytes of ``panels`` in rows of ``columns`` (None: all in one row), ``panel_size`` in pixels each, at 100
    dpi, one legend per panel."""
    FigureCanvasAgg = import_extra("matplotlib.backends.backend_agg", "report").FigureCanvasAgg
    Figure = import_extra("matplotlib.figure", "report").Figure
    width, height = panel_size
    columns = max(1, min(columns or len(panels), len(panels)))
    rows = max(1, math.ceil(len(panels) / columns))
    fig = Figure(figsize=(width * columns / 100, height * rows / 100), dpi=100)
    FigureCanvasAgg(fig)  # draws with Agg without touching pyplot's global backend
    axes = fig.subplots(rows, columns, squeeze=False).ravel()
    for ax in axes[len(panels):]:
        ax.set_axis_off()  # the last row's empty places
    for ax, panel in zip(axes, panels):
        for s in panel.series:
            finite = [(x, y) for x, y in s.points if y is not None and math.isfinite(y)]
            if not finite:
                continue
            xs, ys = zip(*finite)
            ax.plot(xs, ys, label=s.label, color=tuple(c / 255 for c in s.color), linewidth=s.width,
                    marker="o" if s.markers else None, markersize=3, linestyle="--" if s.reference else "-",
                    zorder=3 if s.reference else 2)
        if panel.ylim is not None and panel.ylim[0] < panel.ylim[1]:
            low, high = panel.ylim
            pad = 0.05 * (high - low)  # the zoom's own extremes stay inside the frame
            ax.set_ylim(low - pad, high + pad)
        if panel.xlim is not None and panel.xlim[0] < panel.xlim[1]:
            low, high = panel.xlim
            pad = 0.02 * (high - low)
            ax.set_xlim(low - pad, high + pad)
        ax.set_title(panel.title, fontsize=10)
        ax.set_xlabel(panel.xlabel)
        ax.set_ylabel(panel.ylabel)
        ax.grid(True, color="0.9")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    out = io.BytesIO()
    fig.savefig(out, format="png")
    return out.getvalue()
