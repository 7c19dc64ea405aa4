"""Summary statistics of repeated runs: mean and sd over seeds, the Student-t interval of a mean, a smoothed curve.

One module for the library (the simulation's reports), the demo (``loco_lab``) and the benchmarks.

Missing values: every function takes numbers only; a ``None`` among ``values`` is a ``ValueError``, so a caller
whose records can lack a measurement drops the missing ones itself, visibly (``[v for v in values if v is not
None]``). NaN and infinity are numbers here: they propagate into the mean and sd, as a diverged run should.

The t quantile is SciPy's (``scipy.stats.t.ppf``, declared in ``setup.py``'s ``install_requires``); SciPy is
imported on the first :func:`t_interval` call, so importing this module stays cheap.
"""
import math
import statistics
from typing import List, Optional, Sequence, Tuple


def _numbers(values: Sequence[float]) -> List[float]:
    """``values`` as a list, rejecting ``None`` (see the module's note on missing values)."""
    values = list(values)
    if any(v is None for v in values):
        raise ValueError("statistics over values with None among them: drop the missing values first")
    return values


def mean_sd(values: Sequence[float]) -> Tuple[float, float, int]:
    """``(mean, sd, n)`` of ``values``: ``sd`` is the sample standard deviation (divisor ``n - 1``), 0.0 for one
    value; no values give ``(nan, nan, 0)``, a NaN or infinite value a NaN ``sd``."""
    values = _numbers(values)
    if not values:
        return math.nan, math.nan, 0
    if not all(math.isfinite(v) for v in values):
        sd = math.nan  # statistics.stdev would raise on NaN; the spread of a diverged run is undefined
    else:
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return statistics.fmean(values), sd, len(values)


def format_mean_sd(values: Sequence[float], digits: int = 4) -> str:
    """``"mean +- sd"`` of ``values`` with ``digits`` decimals; the mean alone for one value, ``"-"`` for none."""
    mean, sd, n = mean_sd(values)
    if n == 0:
        return "-"
    return f"{mean:.{digits}f}" + (f" +- {sd:.{digits}f}" if n > 1 else "")


def t_interval(values: Sequence[float], confidence: float = 0.95) -> Optional[Tuple[float, float, float]]:
    """``(mean, low, high)``: the mean of ``values`` (for example paired differences) and its two-sided Student-t
    interval at ``confidence``, ``mean -+ t_{(1 + confidence) / 2, n - 1} * sd / sqrt(n)``; None for fewer than
    two values, which give no interval."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    mean, sd, n = mean_sd(values)
    if n < 2:
        return None
    from scipy.stats import t as student_t  # imported here: a SciPy import takes a fraction of a second

    half = student_t.ppf(0.5 + confidence / 2, n - 1) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def ema(values: Sequence[float], beta: float) -> List[float]:
    """The bias-corrected exponential moving average of ``values``, one point per value: ``m_t = beta * m_{t-1} +
    (1 - beta) * v_t`` from ``m_0 = 0``, reported as ``m_t / (1 - beta^t)``, so every point is a weighted mean of the
    values so far (a constant series stays that constant from the first point on). ``beta`` in [0, 1)."""
    if not 0 <= beta < 1:
        raise ValueError(f"beta must lie in [0, 1), got {beta}")
    out, m, weight = [], 0.0, 1.0
    for v in _numbers(values):
        m = beta * m + (1 - beta) * v
        weight *= beta
        out.append(m / (1 - weight))
    return out
