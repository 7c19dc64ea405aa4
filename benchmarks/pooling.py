"""The random-effects pool of several regimes' intervals of one effect (:func:`pool_intervals`), for
``regime_map.py``'s pooled tables. Needs SciPy (``pip install -e ".[demo]"``)."""
import math
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple


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
    from scipy.stats import chi2, norm  # SciPy: the benchmarks' requirement (the demo extra), not the library's

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
