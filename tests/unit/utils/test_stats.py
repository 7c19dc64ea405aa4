"""The statistics of repeated runs: exact values of mean / sd, the t-interval (its quantile against tabled values
and, where SciPy is installed, against SciPy's) and the EMA on short series."""
import math

import pytest

from deepspeed_loco.utils.stats import ema, format_mean_sd, mean_sd, noise_ratio, t_interval, t_quantile_two_sided
from tests.extras import needs_extra


def test_mean_and_sample_sd_of_a_known_list():
    mean, sd, n = mean_sd([2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0])
    assert (mean, n) == (5.0, 8) and sd == pytest.approx(math.sqrt(32 / 7), rel=1e-15)  # divisor n - 1
    assert mean_sd([3.5]) == (3.5, 0.0, 1)
    mean, sd, n = mean_sd([])
    assert math.isnan(mean) and math.isnan(sd) and n == 0


def test_none_is_rejected_and_nan_propagates():
    with pytest.raises(ValueError, match="None"):
        mean_sd([1.0, None])
    with pytest.raises(ValueError, match="None"):
        ema([1.0, None], 0.9)
    mean, sd, n = mean_sd([1.0, math.nan])
    assert math.isnan(mean) and math.isnan(sd) and n == 2
    assert math.isnan(t_interval([1.0, 2.0, math.inf])[1])


def test_format_mean_sd():
    assert format_mean_sd([2.20, 2.21, 2.22]) == "2.2100 +- 0.0100"
    assert format_mean_sd([2.2], digits=2) == "2.20"
    assert format_mean_sd([]) == "-"


def test_t_interval_uses_the_student_t_quantile():
    mean, low, high = t_interval([1.0, 2.0, 3.0])  # sd 1, n 3: half width t_{0.975, 2} / sqrt(3)
    assert mean == 2.0 and high - mean == pytest.approx(4.302653 / math.sqrt(3), abs=1e-6)
    assert mean - low == pytest.approx(high - mean, rel=1e-15)
    mean, low, high = t_interval([0.0, 2.0])  # sd sqrt(2), n 2: half width t_{0.975, 1} = 12.706205
    assert high - mean == pytest.approx(12.706205, abs=1e-6)
    _, low, high = t_interval([1.0, 2.0, 3.0], confidence=0.90)  # t_{0.95, 2} = 2.919986
    assert high - 2.0 == pytest.approx(2.919986 / math.sqrt(3), abs=1e-6)
    _, low, high = t_interval([float(v) for v in range(12)])  # 11 degrees of freedom: t = 2.200985, not 1.96
    assert high - low == pytest.approx(2 * 2.200985 * math.sqrt(13) / math.sqrt(12), abs=1e-5)


@pytest.mark.parametrize("confidence", [0.5, 0.9, 0.95, 0.99, 0.999])
def test_t_quantile_agrees_with_scipy_to_1e_12(confidence):
    student_t = needs_extra("scipy.stats", "test").t
    for df in [*range(1, 41), 100, 1000, 5000]:
        assert t_quantile_two_sided(confidence, df) == pytest.approx(student_t.ppf(0.5 + confidence / 2, df), rel=1e-12)


def test_t_quantile_rejects_what_has_no_quantile():
    for confidence, df in ((1.0, 3), (0.0, 3), (0.95, 0), (0.95, 2.5)):
        with pytest.raises(ValueError, match="whole df"):
            t_quantile_two_sided(confidence, df)


def test_t_interval_needs_two_values():
    assert t_interval([1.0]) is None and t_interval([]) is None
    with pytest.raises(ValueError, match="confidence"):
        t_interval([1.0, 2.0], confidence=95)


def test_ema_is_bias_corrected():
    assert ema([3.0] * 5, 0.9) == pytest.approx([3.0] * 5, rel=1e-15)  # a constant from the first point on
    # m1 = 0.5 * 1 = 0.5, / 0.5 = 1; m2 = 0.25 + 1.5 = 1.75, / 0.75 = 7/3; m3 = 0.875 + 3 = 3.875, / 0.875 = 31/7
    assert ema([1.0, 3.0, 6.0], 0.5) == pytest.approx([1.0, 7 / 3, 31 / 7], rel=1e-15)
    assert ema([1.0, 3.0, 6.0], 0.0) == [1.0, 3.0, 6.0]
    assert ema([], 0.9) == []
    with pytest.raises(ValueError, match="beta"):
        ema([1.0], 1.0)


def test_noise_ratio_is_error_power_over_sampling_noise_power():
    assert noise_ratio(1.0, 64, 64) == 2.0  # share 1: e^2 (1 + 1) / 1
    assert noise_ratio(0.5, 16, 64) == pytest.approx(0.25 * 1.25 / 0.25, rel=1e-15)  # share 1/4
