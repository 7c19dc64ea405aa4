"""The table of result records, one row per arm over its seeds, and a note under it for every column."""
import math
import statistics
from typing import List, Optional, Sequence

from deepspeed_loco.simulation.records import by_arm
from deepspeed_loco.utils.stats import format_mean_sd


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
    "val loss": "{loss}{on_held_out} after the last step: mean +- sd over seeds",
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


def table_rows(results: Sequence[dict]) -> List[List[str]]:
    """One row per arm, each figure over that arm's seeds (see ``COLUMNS``)."""
    rows = [list(COLUMNS)]
    for key, runs in by_arm(results).items():
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


def column_notes(held_out: Optional[str] = None, engine: str = "simulated",
                 loss: str = "the validation loss (eval_fn)") -> List[str]:
    """One line per column of ``COLUMNS``: ``held_out`` names the validation data (e.g. ``"the held-out plays"``,
    ``"the last 10% of mine.txt"``; None: not named), ``engine`` ("simulated" or "deepspeed") what the step time
    measured, ``loss``
    what the validation loss is (e.g. ``"next-byte cross-entropy"``)."""
    on_held_out = f" on {held_out}" if held_out else ""
    return [f"  {name}: {meaning.format(on_held_out=on_held_out, step_time=STEP_TIMES[engine], loss=loss)}"
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
