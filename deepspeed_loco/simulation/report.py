"""A report of simulated (or real) runs: the table with every column explained, what it says with 95% intervals,
the loss-curve PNG, a JSON, and a progress bar; the demo app (``loco_lab``) prints the same.

Input: result records, one per (arm, seed), from :func:`record` (a :class:`~deepspeed_loco.simulation.ArmResult` of
:func:`~deepspeed_loco.simulation.simulate`) or from the demo's DeepSpeed workers (the same keys).
:func:`write_report` writes ``table.md``, ``results.json`` and ``loss_curves.png``; ``deepspeed-loco-report
results.json --out DIR`` (:func:`main`) renders a saved ``results.json`` again. The PNG needs matplotlib and the bar
tqdm: ``pip install "deepspeed-loco[report]"``.
"""
import argparse
import json
import logging
import math
import os
import statistics
import sys
from dataclasses import replace
from typing import Any, Dict, List, Optional, Sequence

from deepspeed_loco.config import LocoConfig
from deepspeed_loco.layout import plan_hops
from deepspeed_loco.runtime.comm.error_feedback import ErrorFeedbackState
from deepspeed_loco.simulation.arms import Arm, parse_arm
from deepspeed_loco.simulation.charts import Color, Panel, Series, line_chart
from deepspeed_loco.simulation.train import ArmResult
from deepspeed_loco.utils.logging import HANDLER_NAME, logger
from deepspeed_loco.utils.stats import ema, format_mean_sd, t_interval

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
    "val loss": "{loss} on {held_out} after the last step: mean +- sd over seeds",
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


def record_arm(record: dict) -> Arm:
    """The arm of a result record (a report record or a line of the benchmark's ``runs.jsonl``).

    Rebuilt from the record's ``key`` and ``arm.seed``, which every record has: older records hold
    ``{"kind", "bits", "seed"}`` in ``arm``, newer ones the fields of ``Arm``.
    """
    return replace(parse_arm(record["key"]), seed=record["arm"]["seed"])


def record(result: ArmResult, parameter_sizes: Sequence[int]) -> Dict[str, Any]:
    """The report record of one simulated run of a model whose parameters have ``parameter_sizes`` elements:
    losses (train loss = mean of the last tenth of the steps), bytes, the error buffers one rank holds, step time
    (training wall time / steps) and fidelity; JSON-serialisable."""
    steps = len(result.train_losses)
    last_k = max(1, steps // 10)
    buffers = 0
    if result.loco:
        config = LocoConfig.from_dict(result.loco)
        state = ErrorFeedbackState(config, plan_hops(result.world_size, config.local_world_size, config))
        buffers = sum(state.planned_bytes(n) for n in parameter_sizes)
    return {
        "arm": replace(parse_arm(result.key), seed=result.seed).to_dict(),
        "key": result.key,
        "label": result.label,
        "parameters": sum(parameter_sizes),
        "train_losses": result.train_losses,
        "train_loss": statistics.fmean(result.train_losses[-last_k:]),
        "train_loss_last_k": last_k,
        "validation": result.validation,
        "val_loss": result.final_val_loss,
        "step_time_s": result.wall_s / steps,
        "bytes_per_step": result.bytes_per_step,
        "full_precision_bytes_per_step": result.full_precision_bytes_per_step,
        "error_buffer_bytes": buffers,
        "fidelity": {"grad_rel_error_mean": statistics.fmean(result.grad_rel_errors),
                     "sum_rel_error_final": result.sum_rel_errors[-1], "sum_rel_errors": result.sum_rel_errors},
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


def column_notes(held_out: str = "the held-out data", engine: str = "simulated",
                 loss: str = "the validation loss (eval_fn)") -> List[str]:
    """One line per column of ``COLUMNS``: ``held_out`` names the validation data (e.g. ``"the held-out plays"``,
    ``"the last 10% of mine.txt"``), ``engine`` ("simulated" or "deepspeed") what the step time measured, ``loss``
    what the validation loss is (e.g. ``"next-byte cross-entropy"``)."""
    return [f"  {name}: {meaning.format(held_out=held_out, step_time=STEP_TIMES[engine], loss=loss)}"
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


def report_text(records: Sequence[dict], held_out: str = "the held-out data", engine: str = "simulated",
                loss: str = "the validation loss (eval_fn)", markdown: bool = False) -> str:
    """The table (markdown with ``markdown``), the notes on its columns and what it says (:func:`summary_lines`)."""
    notes = column_notes(held_out, engine, loss)
    return "\n".join([format_table(table_rows(records), markdown), "", "columns:", *notes, "", *summary_lines(records)])


def write_report(records: Sequence[dict], out_dir: str, title: str = "", header: str = "",
                 held_out: str = "the held-out data", engine: str = "simulated",
                 loss: str = "the validation loss (eval_fn)", extra: Optional[Dict[str, Any]] = None) -> List[str]:
    """Writes ``table.md`` (``header``, the table, its notes, what it says), ``results.json`` (``extra`` and the
    records under ``"arms"``) and ``loss_curves.png`` (titled ``title``; skipped, with a warning naming the
    ``report`` extra, where matplotlib is missing) under ``out_dir``; returns the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, name) for name in ("table.md", "results.json", "loss_curves.png")]
    with open(paths[0], "w") as f:
        f.write((header + "\n\n" if header else "") + report_text(records, held_out, engine, loss, markdown=True)
                + "\n")
    with open(paths[1], "w") as f:
        json.dump({**(extra or {}), "arms": list(records)}, f, indent=1)
    try:
        png = plot(records, title=title)
    except ImportError:
        logger.warning('deepspeed-loco report: no loss_curves.png: matplotlib is missing '
                       '(pip install "deepspeed-loco[report]")')
        return paths[:2]
    with open(paths[2], "wb") as f:
        f.write(png)
    return paths


class _BarLog(logging.Handler):
    """Stands in for the ``deepspeed_loco`` logger's console handler while a bar is open: the same format, filters
    and stream, written through ``tqdm.write`` so that a line never lands inside the bar."""

    def __init__(self, bar, console: logging.StreamHandler):
        super().__init__(console.level)
        self.bar, self.stream = bar, console.stream
        self.setFormatter(console.formatter)
        for log_filter in console.filters:
            self.addFilter(log_filter)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.bar.write(self.format(record), file=self.stream)
        except Exception:
            self.handleError(record)


class ProgressBar:
    """A tqdm bar over ``total`` steps (all arms and seeds) on stdout; while it is open the ``deepspeed_loco``
    logger prints through it. Pass the instance as ``simulate(..., on_step=bar)`` (it takes ``(result, step,
    loss)``), or call :meth:`step`; :meth:`write` prints a line above the bar; :meth:`close` when done.
    ``enabled=False``: no bar, lines are printed."""

    def __init__(self, total: int, enabled: bool = True, desc: str = "starting"):
        self.bar = None
        self.handlers = list(logger.handlers)
        if enabled:
            from tqdm import tqdm
            self.bar = tqdm(total=total, unit="step", dynamic_ncols=True, desc=desc, file=sys.stdout)
            logger.handlers = [_BarLog(self.bar, h) if h.get_name() == HANDLER_NAME else h for h in self.handlers]

    def __call__(self, result: ArmResult, step: int, loss: float) -> None:
        self.step(f"seed {result.seed}: {result.label}", loss)

    def step(self, desc: str, loss: float) -> None:
        """One step done, of the run described by ``desc``, at training loss ``loss``."""
        if self.bar is not None:
            self.bar.set_description(desc, refresh=False)
            self.bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
            self.bar.update(1)

    def write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=sys.stdout)
        else:
            print(text, flush=True)

    def close(self) -> None:
        """Closes the bar and gives the logger its handlers back."""
        if self.bar is not None:
            self.bar.close()
        logger.handlers = self.handlers


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``deepspeed-loco-report RESULTS_JSON --out DIR``: the table, notes and summary of a saved ``results.json``
    (:func:`write_report`'s, or a JSON list of records) printed again and written under ``--out``."""
    parser = argparse.ArgumentParser(prog="deepspeed-loco-report", description=main.__doc__)
    parser.add_argument("results", help="a results.json of write_report (or the demo), or a JSON list of records")
    parser.add_argument("--out", required=True, help="folder for table.md, results.json and loss_curves.png")
    parser.add_argument("--title", default="", help="the PNG's title")
    parser.add_argument("--held-out", default="the held-out data", help="what the validation loss was measured on")
    args = parser.parse_args(argv)
    try:
        with open(args.results) as f:
            saved = json.load(f)
        records = saved.get("arms") if isinstance(saved, dict) else saved
        if not isinstance(records, list) or not records or not all(isinstance(r, dict) and "key" in r
                                                                     for r in records):
            raise ValueError("it holds no result records (a list of objects with 'key', or {'arms': [...]})")
        extra = {k: v for k, v in saved.items() if k != "arms"} if isinstance(saved, dict) else {}
        write_report(records, args.out, title=args.title, held_out=args.held_out, extra=extra)
    except (OSError, ValueError, KeyError) as err:
        print(f"deepspeed-loco-report: error: {args.results}: {err}", file=sys.stderr)
        return 2
    print(report_text(records, args.held_out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
