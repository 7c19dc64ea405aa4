"""Summary statistics of repeated runs: mean and sd over seeds, the Student-t interval of a mean, the pool of several
such intervals, the error-to-noise ratio of a communicated gradient, a smoothed curve.

One module for the library (the simulation's reports), the demo (``loco_lab``) and the benchmarks.

Missing values: every function takes numbers only; a ``None`` among ``values`` is a ``ValueError``, so a caller
whose records can lack a measurement drops the missing ones itself, visibly (``[v for v in values if v is not
None]``). NaN and infinity are numbers here: they propagate into the mean and sd, as a diverged run should.

The t quantile is SciPy's (``scipy.stats.t.ppf``, declared in ``setup.py``'s ``install_requires``); SciPy is
imported on the first :func:`t_interval` call, so importing this module stays cheap.
"""
import math
import statistics
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Pooled:
    """Several estimates of one effect pooled (:func:`pool_intervals`): ``mean`` and its interval ``[low, high]``;
    ``k`` estimates; Cochran's ``q`` of their heterogeneity on ``k - 1`` degrees of freedom and its p-value
    ``p_heterogeneity`` (small: the estimates differ by more than their intervals allow); ``tau``: the spread
    between the estimates' true values that the pool allowed for (0 when ``q <= k - 1``)."""
    mean: float
    low: float
    high: float
    k: int
    q: float
    p_heterogeneity: float
    tau: float


def pool_intervals(intervals: Sequence[Tuple[float, float, float]], confidence: float = 0.95) -> Optional[Pooled]:
    """The random-effects pool (DerSimonian and Laird, 1986) of independent estimates, each given as ``(mean, low,
    high)``, a two-sided interval at ``confidence`` (e.g. :func:`t_interval`'s); None for no estimate.

    Each estimate's standard error is its half-width over the normal quantile ``z`` (for a Student-t interval of a
    few values that is larger than the sample's own standard error: the pool inherits the t interval's caution).
    The weights are ``1 / (se^2 + tau^2)``, ``tau^2 = max(0, (q - (k - 1)) / (sum w - sum w^2 / sum w))`` from the
    fixed-effect weights ``w = 1 / se^2``; the pooled interval is ``mean -+ z / sqrt(sum of the weights)``. Raises
    ValueError for an interval of zero or negative width or a mean outside it."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    if not intervals:
        return None
    from scipy.stats import chi2, norm  # imported here, as in t_interval

    z = norm.ppf(0.5 + confidence / 2)
    means, variances = [], []
    for mean, low, high in intervals:
        if not low <= mean <= high or not high > low:
            raise ValueError(f"pool_intervals: ({mean}, {low}, {high}) is not a mean inside an interval of "
                             f"positive width")
        means.append(mean)
        variances.append(((high - low) / (2 * z))**2)
    weights = [1 / v for v in variances]
    fixed = sum(w * m for w, m in zip(weights, means)) / sum(weights)
    q = sum(w * (m - fixed)**2 for w, m in zip(weights, means))
    k = len(means)
    spread = sum(weights) - sum(w * w for w in weights) / sum(weights)
    tau_sq = max(0.0, (q - (k - 1)) / spread) if k > 1 and spread > 0 else 0.0
    pooled_weights = [1 / (v + tau_sq) for v in variances]
    mean = sum(w * m for w, m in zip(pooled_weights, means)) / sum(pooled_weights)
    half = z / math.sqrt(sum(pooled_weights))
    p_heterogeneity = float(chi2.sf(q, k - 1)) if k > 1 else 1.0
    return Pooled(mean, mean - half, mean + half, k, q, p_heterogeneity, math.sqrt(tau_sq))


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
