"""Summary statistics of repeated runs: mean and sd over seeds, the Student-t interval of a mean, the error-to-noise
ratio of a communicated gradient, a smoothed curve.

One module for the library (the simulation's reports), the demo (``loco_lab``) and the benchmarks.

Missing values: every function takes numbers only; a ``None`` among ``values`` is a ``ValueError``, so a caller
whose records can lack a measurement drops the missing ones itself, visibly (``[v for v in values if v is not
None]``). NaN and infinity are numbers here: they propagate into the mean and sd, as a diverged run should.

The t quantile is computed here, from the closed form of Student's t distribution for a whole number of degrees of
freedom, to 1e-12 relative (no SciPy).
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


def _t_central(theta: float, df: int) -> float:
    """``P(|T| <= sqrt(df) tan(theta))`` for Student's t on ``df`` degrees of freedom, ``theta`` in [0, pi/2]: the
    finite series for a whole ``df`` (Abramowitz and Stegun 26.7.3 and 26.7.4)."""
    cos2 = math.cos(theta)**2
    k, term = (1, math.cos(theta)) if df % 2 else (0, 1.0)
    total = 0.0
    while k <= df - 2:
        total += term
        term *= cos2 * (k + 1) / (k + 2)
        k += 2
    if df % 2:
        return 2 / math.pi * (theta + math.sin(theta) * total)
    return math.sin(theta) * total


def t_quantile_two_sided(confidence: float, df: int) -> float:
    """``t`` with ``P(|T| <= t) = confidence`` for Student's t on ``df >= 1`` (whole) degrees of freedom, i.e. the
    ``(1 + confidence) / 2`` quantile, to 1e-12 relative: bisection on ``theta = atan(t / sqrt(df))``."""
    if not 0 < confidence < 1 or df < 1 or int(df) != df:
        raise ValueError(f"t quantile: confidence in (0, 1) and whole df >= 1, got {confidence} and {df}")
    low, high = 0.0, math.pi / 2
    for _ in range(200):  # far past double precision; stops early once the interval cannot shrink
        mid = (low + high) / 2
        if mid in (low, high):
            break
        low, high = (mid, high) if _t_central(mid, int(df)) < confidence else (low, mid)
    return math.sqrt(df) * math.tan((low + high) / 2)


def t_interval(values: Sequence[float], confidence: float = 0.95) -> Optional[Tuple[float, float, float]]:
    """``(mean, low, high)``: the mean of ``values`` (for example paired differences) and its two-sided Student-t
    interval at ``confidence``, ``mean -+ t_{(1 + confidence) / 2, n - 1} * sd / sqrt(n)``; None for fewer than
    two values, which give no interval."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    mean, sd, n = mean_sd(values)
    if n < 2:
        return None
    half = t_quantile_two_sided(confidence, n - 1) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def noise_ratio(error: float, noise_scale: float, batch: float) -> float:
    """``rho``: the power of a communicated mean gradient's error over the power of its own sampling noise,
    ``error^2 (1 + B / batch) / (B / batch)``; ``error``: the per-step relative error of the communicated mean,
    ``noise_scale``: the gradient noise scale ``B`` (``deepspeed_loco.simulation.gradient_noise_scale``, samples,
    > 0), ``batch``: the step's global batch in the same units (the exact mean has ``||g||^2 = ||G||^2 (1 + B /
    batch)``, its sampling noise ``||G||^2 B / batch``)."""
    share = noise_scale / batch
    return error**2 * (1 + share) / share


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
