"""Summary statistics of repeated runs (placeholder until the shared statistics module lands)."""
import math
import statistics
from typing import Sequence, Tuple


def t_interval(values: Sequence[float], confidence: float = 0.95) -> Tuple[float, float, float]:
    """``(mean, low, high)``: the Student-t interval of the mean of ``values`` (at least two)."""
    from scipy.stats import t as student_t
    n = len(values)
    mean = statistics.fmean(values)
    half = student_t.ppf(0.5 + confidence / 2, n - 1) * statistics.stdev(values) / math.sqrt(n)
    return mean, mean - half, mean + half
