"""LoCo's early update burst: how much larger the optimizer's steps were with LoCo than with plain qgZ (same bits,
seed and batches) in the first 100 steps, window by window. The line the regime map drew on it, with its
provenance, is ``deepspeed_loco.findings.UPDATE_BURST``.
"""
import statistics
from typing import List, Sequence

BURST_WINDOW = 10  # steps per window
BURST_WINDOWS = 10  # windows compared: the first 100 steps


def window_means(values: Sequence[float], window: int = BURST_WINDOW) -> List[float]:
    """Means of consecutive windows of ``window`` values (the last one may be shorter); [] for no values."""
    return [statistics.fmean(values[i:i + window]) for i in range(0, len(values), window)]


def update_burst(loco_windows: Sequence[float], plain_windows: Sequence[float],
                 windows: int = BURST_WINDOWS) -> float:
    """The largest ratio, window by window over the first ``windows`` windows, of LoCo's update RMS over plain
    qgZ's (:func:`window_means` of each run's per-step update RMS, same seed); window by window, so plain's large
    first steps do not hide LoCo's larger steps later."""
    ratios = [loco / plain for loco, plain in zip(loco_windows[:windows], plain_windows[:windows])]
    if not ratios:
        raise ValueError("update_burst: no window to compare (a run recorded no update RMS)")
    return max(ratios)
