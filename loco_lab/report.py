"""The demo's table and loss-curve PNG, from the workers' per-arm results."""
import math
import statistics
from dataclasses import replace
from typing import Dict, List, Optional, Sequence

from deepspeed_loco.utils.stats import ema, format_mean_sd, t_interval
from loco_lab.arms import Arm, record_arm
from loco_lab.plots import Color, Panel, Series, line_chart

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


def human_bytes(n: Optional[float]) -> str:
    if n is None:
        return "-"
    if n == 0:
        return "0"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _fmt_err(value: Optional[float]) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    return f"{value:.1e}" if value < 1e-3 else f"{value:.4f}"


COLUMNS = {  # every column of the demo's table, explained (printed under it; column_notes fills in the braces)
    "arm": "how gradients were reduced: full precision, plain qgZ (quantized, no error feedback) or qgZ + LoCo",
    "val loss": "next-byte cross-entropy on {held_out} after the last step: mean +- sd over seeds",
    "train loss": "training loss over the last 10% of steps: mean +- sd over seeds",
    "bytes/step/rank": "gradient bytes one rank sends per optimizer step, both hops, values and scales",
    "vs full": "those bytes over what a full-precision (fp32) reduce-scatter sends",
    "error buffers/rank": "memory of LoCo's int8 error buffers on each rank (0 without LoCo)",
    "grad rel. err": "||communicated mean - exact mean|| / ||exact mean||, averaged over steps",
    "running-sum rel. err": "the same for the sums of all communicated and all exact gradients so far, after the "
                            "last step: the bias error feedback removes",
    "median step time": "{step_time}; the median over seeds",
}
STEP_TIMES = {  # what "median step time" measured, by engine
    "simulated": "wall time per optimizer step of all W virtual ranks together, simulated in one process on this "
                 "machine (training time / steps, evaluation excluded)",
    "deepspeed": "wall time per optimizer step of the slowest of the W DeepSpeed worker processes, which share this "
                 "machine (median over steps)",
}


def _by_arm(results: Sequence[dict]) -> Dict[str, List[dict]]:
    """Records grouped by arm key, in first-seen order."""
    groups: Dict[str, List[dict]] = {}
    for r in results:
        groups.setdefault(r["key"], []).append(r)
    return groups


def table_rows(results: Sequence[dict]) -> List[List[str]]:
    """One row per arm, each figure over that arm's seeds (see ``COLUMNS``)."""
    rows = [list(COLUMNS)]
    for key, runs in _by_arm(results).items():
        fid = [r.get("fidelity") or {} for r in runs]
        first = runs[0]
        rows.append([
            first["label"],
            format_mean_sd([r["val_loss"] for r in runs]),
            format_mean_sd([r["train_loss"] for r in runs]),
            human_bytes(statistics.fmean(r["bytes_per_step"] for r in runs)),
            f"{first['bytes_per_step'] / first['full_precision_bytes_per_step']:.3f}x",
            human_bytes(first["error_buffer_bytes"]),
            _fmt_err(_mean([f.get("grad_rel_error_mean") for f in fid])),
            _fmt_err(_mean([f.get("sum_rel_error_final") for f in fid])),
            f"{statistics.median(r['step_time_s'] for r in runs) * 1000:.0f} ms",
        ])
    return rows


def column_notes(held_out: str = "the held-out plays", engine: str = "simulated") -> List[str]:
    """One line per column of ``COLUMNS``: ``held_out`` names the validation text (e.g. ``"the held-out plays"``,
    ``"the last 10% of mine.txt"``), ``engine`` ("simulated" or "deepspeed") what the step time measured."""
    return [f"  {name}: {meaning.format(held_out=held_out, step_time=STEP_TIMES[engine])}"
            for name, meaning in COLUMNS.items()]


def _mean(values) -> Optional[float]:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def format_table(rows: List[List[str]], markdown: bool = False) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    if markdown:
        lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
        lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
        return "\n".join(lines)
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def gap_closed(full: Optional[float], plain: Optional[float], loco: Optional[float]) -> Optional[float]:
    """``(plain - loco) / (plain - full)``: 1 = LoCo matches full precision, 0 = no better than plain qgZ."""
    if None in (full, plain, loco) or plain == full:
        return None
    return (plain - loco) / (plain - full)


def summary_lines(results: Sequence[dict]) -> List[str]:
    """What the numbers say, per LoCo arm whose plain twin ran: claims only where the 95% interval over the
    seeds both arms share excludes zero; otherwise "no measurable difference"."""
    groups = _by_arm(results)
    full = {r["arm"]["seed"]: r for r in groups.get("full", [])}
    lines = []
    for key, runs in groups.items():
        arm = record_arm(runs[0])
        twin = groups.get(replace(arm, kind="plain").key) if arm.kind == "loco" else None
        if not twin:
            continue
        plain = {r["arm"]["seed"]: r for r in twin}
        loco = {r["arm"]["seed"]: r for r in runs}
        seeds = sorted(set(plain) & set(loco))
        diffs = [loco[s]["val_loss"] - plain[s]["val_loss"] for s in seeds]
        lines.append(f"{arm.variant}, LoCo vs plain qgZ, validation loss over {len(seeds)} seed(s): "
                     + _verdict(diffs, "LoCo"))
        gaps = [plain[s]["val_loss"] - full[s]["val_loss"] for s in seeds if s in full]
        if gaps:
            lines.append("  plain qgZ vs full precision: " + _verdict(gaps, "plain qgZ"))
        ratios = [(plain[s].get("fidelity") or {}).get("sum_rel_error_final", 0) /
                  (loco[s].get("fidelity") or {}).get("sum_rel_error_final", 1) for s in seeds
                  if (loco[s].get("fidelity") or {}).get("sum_rel_error_final")]
        if ratios:
            lines.append(f"  running-sum error of the communicated gradients: LoCo's is {_span(ratios)}x smaller "
                         f"than plain qgZ's on every seed (the bias error feedback removes)" if min(ratios) > 1 else
                         f"  running-sum error: LoCo / plain ratios {', '.join(f'{1 / r:.2f}' for r in ratios)}")
    if max(len(runs) for runs in groups.values()) < 2:
        lines.append("one seed: every figure above is a single run; comparing arms needs two or more seeds "
                     "(e.g. --seeds 0 1 2), which give the 95% intervals")
    return lines


def _span(values: Sequence[float]) -> str:
    """``"1.8"`` when the values agree to one decimal, else ``"1.6-2.1"``."""
    low, high = f"{min(values):.1f}", f"{max(values):.1f}"
    return low if low == high else f"{low}-{high}"


def _verdict(diffs: Sequence[float], subject: str) -> str:
    """``diffs`` (subject minus reference, lower is better) in words, with the 95% interval when there are 2+."""
    interval = t_interval(diffs)
    if interval is None:
        return (f"{diffs[0]:+.4f} ({'one seed: no claim, seed noise is of this size' if diffs else 'no data'})"
                if diffs else "no data")
    mean, low, high = interval
    text = f"{mean:+.4f} (95% CI [{low:+.4f}, {high:+.4f}])"
    if low > 0:
        return text + f": {subject} is worse"
    if high < 0:
        return text + f": {subject} is better"
    return text + ": no measurable difference at this size and length (the interval contains 0)"


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


def plot(results: Sequence[dict], title: str = "") -> bytes:
    """PNG bytes of :func:`loss_panels`."""
    return line_chart(loss_panels(results), title=title)


def loss_panels(results: Sequence[dict]) -> List[Panel]:
    """Per arm, the seed mean of the train loss (:func:`train_curve`), of the validation loss (every point, then the second
    half zoomed, its x axis from its first point) and of the running-sum gradient error."""
    train, val, err = [], [], []
    skip = 0
    for key, runs in _by_arm(results).items():
        seeds = f" ({len(runs)} seeds)" if len(runs) > 1 else ""
        color, label = arm_color(record_arm(runs[0])), runs[0]["label"] + seeds
        losses = [statistics.fmean(step) for step in zip(*(r["train_losses"] for r in runs))]
        skip = max(skip, len(losses) // 10)
        train.append(Series(label, list(enumerate(train_curve(losses), start=1)), color))
        points = [(column[0][0], statistics.fmean(v for _, v in column))
                  for column in zip(*(r["validation"] for r in runs))]
        val.append(Series(label, points, color, markers=True))
        sums = [(r.get("fidelity") or {}).get("sum_rel_errors") for r in runs]
        if all(sums):
            err.append(Series(label, list(enumerate((statistics.fmean(s) for s in zip(*sums)), start=1)), color))
    tail = [y for s in train for x, y in s.points if x > skip]
    ylim = (min(tail), max(tail)) if tail else None
    early = [y for s in train for x, y in s.points if x == max(1, (len(s.points) * 3) // 10)]
    if ylim and early:  # show the part where the arms can differ, not the first drop from ln(256)
        ylim = (ylim[0], min(ylim[1], max(early)))
    panels = [Panel("train loss (seed mean, EMA over 10% of the steps, zoomed past the first drop)", "step", train,
                    ylim),
              Panel("validation loss, held-out text (seed mean, every point)", "step", val)]
    last = max((x for series in val for x, _ in series.points), default=0)
    late = [(x, y) for series in val for x, y in series.points if x >= last / 2]
    if len(late) > 1:  # the same curves again, zoomed on the second half where the arms differ
        ys = [y for _, y in late]
        panels.append(Panel("validation loss, second half (zoom)", "step", val, (min(ys), max(ys)),
                            xlim=(min(x for x, _ in late), last)))
    if err:
        panels.append(Panel("running-sum grad rel. error (seed mean)", "step", err))
    return panels


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")
