"""The loss-curve PNG of result records: per arm, train loss, validation loss (and its second half zoomed) and the
running-sum gradient error, two panels a row; an arm's colour tells its kind, bits and Hadamard, and full precision,
the curve the others are read against, is dashed on top of them. Needs matplotlib (the ``report`` extra)."""
import statistics
from typing import List, Optional, Sequence

from deepspeed_loco.simulation.arms import Arm
from deepspeed_loco.simulation.charts import Color, Panel, Series, line_chart
from deepspeed_loco.simulation.records import by_arm, record_arm
from deepspeed_loco.utils.stats import ema

FULL_COLOR = (20, 20, 20)
UNIFORM_COLORS = {  # (kind, bits) with equal bits on both hops: plain qgZ warm, LoCo cool, darker for fewer bits
    ("plain", 8): (240, 170, 40), ("plain", 4): (230, 120, 20), ("plain", 3): (205, 40, 40),
    ("plain", 2): (130, 60, 20),
    ("loco", 8): (90, 170, 240), ("loco", 4): (30, 100, 220), ("loco", 3): (0, 150, 150), ("loco", 2): (120, 40, 180),
}
MIXED_COLORS = {  # (kind, inter-node bits) with other intra-node bits: plain qgZ olive, LoCo green
    ("plain", 8): (200, 190, 60), ("plain", 4): (170, 160, 0), ("plain", 3): (140, 130, 0),
    ("plain", 2): (110, 100, 0),
    ("loco", 8): (110, 200, 110), ("loco", 4): (60, 170, 60), ("loco", 3): (20, 130, 50), ("loco", 2): (0, 90, 40),
}
HADAMARD_WHITE = 0.45  # a Hadamard arm has its arm's colour mixed with this share of white



def train_curve(losses: Sequence[float]) -> List[float]:
    """The plotted train loss: the bias-corrected EMA (:func:`~deepspeed_loco.utils.stats.ema`) over a window of 10%
    of the steps (``beta = 1 - 1 / window``, at least one step: no smoothing), the share of steps the table's train
    loss averages, so a short run lags by a step or less and a long one is smoothed over many."""
    return ema(losses, 1 - 1 / max(1.0, len(losses) / 10))


def arm_color(arm: Arm) -> Color:
    """Black for full precision, else by kind and bits (``UNIFORM_COLORS``, ``MIXED_COLORS``); paler with Hadamard."""
    if arm.kind == "full":
        return FULL_COLOR
    table = UNIFORM_COLORS if arm.intra_bits == arm.inter_bits else MIXED_COLORS
    color = table[(arm.kind, arm.inter_bits)]
    if not arm.hadamard:
        return color
    return tuple(round(c + HADAMARD_WHITE * (255 - c)) for c in color)


def plot(results: Sequence[dict], title: str = "", held_out: Optional[str] = None) -> bytes:
    """PNG bytes of :func:`loss_panels`, two panels a row."""
    return line_chart(loss_panels(results, held_out), title=title, columns=2)


def loss_panels(results: Sequence[dict], held_out: Optional[str] = None) -> List[Panel]:
    """Per arm, the seed mean of the train loss (:func:`train_curve`), of the validation loss (every point, then the
    second half zoomed, its x axis from its first point) and of the running-sum gradient error. ``held_out`` names
    the validation data in the validation panels' titles (e.g. ``"the held-out plays"``); None names none."""
    train, val, err = [], [], []
    skip = 0
    for key, runs in by_arm(results).items():
        seeds = f" ({len(runs)} seeds)" if len(runs) > 1 else ""
        arm = record_arm(runs[0])
        color, label, full = arm_color(arm), runs[0]["label"] + seeds, arm.kind == "full"
        losses = [statistics.fmean(step) for step in zip(*(r["train_losses"] for r in runs))]
        skip = max(skip, len(losses) // 10)
        train.append(Series(label, list(enumerate(train_curve(losses), start=1)), color, reference=full))
        points = [(column[0][0], statistics.fmean(v for _, v in column))
                  for column in zip(*(r["validation"] for r in runs))]
        val.append(Series(label, points, color, markers=True, reference=full))
        sums = [(r.get("fidelity") or {}).get("sum_rel_errors") for r in runs]
        if all(sums):
            err.append(Series(label, list(enumerate((statistics.fmean(s) for s in zip(*sums)), start=1)), color,
                              reference=full))
    tail = [y for s in train for x, y in s.points if x > skip]
    ylim = (min(tail), max(tail)) if tail else None
    early = [y for s in train for x, y in s.points if x == max(1, (len(s.points) * 3) // 10)]
    if ylim and early:  # show the part where the arms can differ, not the first drop from ln(256)
        ylim = (ylim[0], min(ylim[1], max(early)))
    on = f" on {held_out}" if held_out else ""
    panels = [Panel("train loss (seed mean, EMA over 10% of the steps, zoomed past the first drop)", "step",
                    "training loss", train, ylim),
              Panel(f"validation loss{on} (seed mean, every point)", "step", "validation loss", val)]
    last = max((x for series in val for x, _ in series.points), default=0)
    late = [(x, y) for series in val for x, y in series.points if x >= last / 2]
    if len(late) > 1:  # the same curves again, zoomed on the second half where the arms differ
        ys = [y for _, y in late]
        panels.append(Panel(f"validation loss{on}, second half (zoom)", "step", "validation loss", val,
                            (min(ys), max(ys)),
                            xlim=(min(x for x, _ in late), last)))
    if err:
        panels.append(Panel("running-sum grad rel. error (seed mean)", "step",
                            "||sum sent - sum exact|| / ||sum exact||", err))
    return panels
