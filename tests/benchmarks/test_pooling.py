"""benchmarks/pooling.py: the random-effects pool of regimes' intervals, exact on made-up intervals."""
import math

import pytest

from benchmarks.pooling import pool_intervals
from tests.extras import needs_extra


@pytest.fixture(autouse=True)
def scipy():
    """benchmarks/pooling.py's quantiles."""
    return needs_extra("scipy", "demo")


Z95 = 1.959963984540054  # the normal quantile of a 95% two-sided interval


def test_pool_of_one_interval_is_that_interval():
    pooled = pool_intervals([(0.5, 0.2, 0.8)])
    assert (pooled.k, pooled.q, pooled.tau, pooled.p_heterogeneity) == (1, 0.0, 0.0, 1.0)
    assert (pooled.mean, pooled.low, pooled.high) == pytest.approx((0.5, 0.2, 0.8), rel=1e-12)
    assert pool_intervals([]) is None


def test_pool_of_agreeing_estimates_narrows_by_root_k():
    # se = 1 / z each, w = z^2; fixed mean 0.1; q = w * (0.1^2 + 0.1^2) = 0.02 z^2 < 1 = k - 1: no spread added
    pooled = pool_intervals([(0.0, -1.0, 1.0), (0.2, -0.8, 1.2)])
    assert pooled.mean == pytest.approx(0.1, rel=1e-12) and pooled.tau == 0.0
    assert pooled.q == pytest.approx(0.02 * Z95**2, rel=1e-9)
    assert pooled.high - pooled.mean == pytest.approx(1 / math.sqrt(2), rel=1e-9)


def test_pool_of_disagreeing_estimates_allows_for_their_spread():
    # se = 0.1 / z, w = 100 z^2 each; fixed mean 0; q = 2 w; tau^2 = (q - 1) / (2w - w) = 2 - 1 / w, so every
    # estimate's variance becomes se^2 + tau^2 = 2: the pooled half-width is z / sqrt(1 / 2 + 1 / 2) = z
    pooled = pool_intervals([(-1.0, -1.1, -0.9), (1.0, 0.9, 1.1)])
    w = 100 * Z95**2
    assert pooled.q == pytest.approx(2 * w, rel=1e-9) and pooled.tau == pytest.approx(math.sqrt(2 - 1 / w), rel=1e-9)
    assert pooled.mean == pytest.approx(0.0, abs=1e-12) and pooled.high == pytest.approx(Z95, rel=1e-9)
    assert pooled.p_heterogeneity < 1e-12


def test_pool_rejects_what_is_not_an_interval():
    with pytest.raises(ValueError, match="positive width"):
        pool_intervals([(0.0, 0.0, 0.0)])
    with pytest.raises(ValueError, match="positive width"):
        pool_intervals([(2.0, 0.0, 1.0)])
    with pytest.raises(ValueError, match="confidence"):
        pool_intervals([(0.0, -1.0, 1.0)], confidence=95)
