"""The demo's table and loss-curve PNG, from the workers' per-arm results."""
import math
import statistics
from dataclasses import replace
from typing import Dict, List, Optional, Sequence

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


def table_rows(results: Sequence[dict]) -> List[List[str]]:
    header = ["arm", "train loss", "val loss", "step time", "grad bytes/step/rank", "vs full", "error buffers/rank",
              "grad rel. err", "running-sum rel. err"]
    rows = [header]
    for r in results:
        fid = r.get("fidelity") or {}
        rows.append([
            r["label"],
            f"{r['train_loss']:.4f}",
            f"{r['val_loss']:.4f}",
            f"{r['step_time_s'] * 1000:.0f} ms",
            human_bytes(r["bytes_per_step"]),
            f"{r['bytes_per_step'] / r['full_precision_bytes_per_step']:.3f}x",
            human_bytes(r["error_buffer_bytes"]),
            _fmt_err(fid.get("grad_rel_error_mean")),
            _fmt_err(fid.get("sum_rel_error_final")),
        ])
    return rows


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
    """What the numbers say, per LoCo arm whose plain twin ran, in words (single run: no claim below seed noise)."""
    by_key: Dict[str, dict] = {r["key"]: r for r in results}
    full = by_key.get("full")
    lines = []
    for loco in results:
        arm = record_arm(loco)
        plain = by_key.get(replace(arm, kind="plain").key) if arm.kind == "loco" else None
        if plain is None:
            continue
        diff = plain["val_loss"] - loco["val_loss"]
        text = (f"{arm.variant}: validation loss plain {plain['val_loss']:.4f}, LoCo {loco['val_loss']:.4f} "
                f"(LoCo {'lower' if diff > 0 else 'higher'} by {abs(diff):.4f})")
        if full is not None:
            share = gap_closed(full["val_loss"], plain["val_loss"], loco["val_loss"])
            gap = plain["val_loss"] - full["val_loss"]
            text += f"; plain - full = {gap:+.4f}"
            if gap <= 0:
                text += " (plain qgZ is not worse than full precision here: there is no gap for LoCo to close)"
            elif share is not None:
                text += f", share of that gap LoCo closes: {share:+.0%}"
        lines.append(text)
        pf, lf = plain.get("fidelity") or {}, loco.get("fidelity") or {}
        if pf.get("sum_rel_error_final") is not None and lf.get("sum_rel_error_final") is not None:
            lines.append(f"  running sum of communicated gradients vs exact: plain {pf['sum_rel_error_final']:.4f}, "
                         f"LoCo {lf['sum_rel_error_final']:.4f} (relative error after the last step)")
    if lines:
        lines.append("One seed, a short run: validation-loss differences of about 0.01-0.02 are within seed noise. "
                     "`benchmarks/convergence.py` repeats this over seeds and bit widths.")
    return lines


def ema(values: Sequence[float], decay: float = 0.9) -> List[float]:
    out, acc = [], None
    for i, v in enumerate(values):
        acc = v if acc is None else decay * acc + (1 - decay) * v
        out.append(acc / 1.0)
    return out


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
    """PNG bytes: train loss (EMA), validation loss, and the running-sum gradient error, per arm."""
    train, val, err = [], [], []
    skip = 0
    for r in results:
        color, label = arm_color(record_arm(r)), r["label"]
        losses = r["train_losses"]
        skip = max(skip, len(losses) // 10)
        train.append(Series(label, list(enumerate(ema(losses), start=1)), color))
        val.append(Series(label, r["validation"], color, markers=True))
        fid = r.get("fidelity") or {}
        if fid.get("sum_rel_errors"):
            err.append(Series(label, list(enumerate(fid["sum_rel_errors"], start=1)), color))
    tail = [y for s in train for x, y in s.points if x > skip]
    ylim = (min(tail), max(tail)) if tail else None
    early = [y for s in train for x, y in s.points if x == max(1, (len(s.points) * 3) // 10)]
    if ylim and early:  # show the part where the arms can differ, not the first drop from ln(256)
        ylim = (ylim[0], min(ylim[1], max(early)))
    panels = [Panel("train loss (EMA 0.9, zoomed past the first drop)", "step", train, ylim),
              Panel("validation loss, held-out plays (every point)", "step", val)]
    last = max((x for series in val for x, _ in series.points), default=0)
    late = [y for series in val for x, y in series.points if x >= last / 2]
    if len(late) > 1:  # the same curves again, zoomed on the second half where the arms differ
        panels.append(Panel("validation loss, second half (zoom)", "step", val, (min(late), max(late))))
    if err:
        panels.append(Panel("running-sum grad rel. error", "step", err))
    return line_chart(panels, title=title)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")
