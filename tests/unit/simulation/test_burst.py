"""LoCo's early update burst: window means and the window-by-window ratio, exact on made-up series."""
import pytest

from deepspeed_loco.simulation.burst import update_burst, window_means


def test_window_means_are_the_means_of_consecutive_windows_the_last_one_shorter():
    assert window_means([1.0, 2.0, 3.0, 4.0, 5.0], 2) == [1.5, 3.5, 5.0]
    assert window_means(list(range(25)))[:2] == [4.5, 14.5] and len(window_means(list(range(25)))) == 3
    assert window_means([]) == []


@pytest.mark.parametrize("step,counted", [(99, True), (100, True), (101, False)])
def test_by_default_the_burst_covers_per_step_series_up_to_step_100_and_no_further(step, counted):
    plain = [0.2] * 120  # per-step update RMS; LoCo's one larger step at ``step`` (1-based)
    loco = [0.2] * 120
    loco[step - 1] = 2.2
    burst = update_burst(window_means(loco), window_means(plain))  # the defaults: 10-step windows, the first 10
    assert burst == (pytest.approx((0.2 + 2.0 / 10) / 0.2) if counted else 1.0)  # the window mean: 0.4


def test_the_burst_is_window_by_window_not_the_ratio_of_the_two_maxima():
    plain = [0.48, 0.20, 0.16, 0.16] + [0.16] * 6
    loco = [0.48, 0.37, 0.25, 0.21] + [0.15] * 6
    assert update_burst(loco, plain) == pytest.approx(0.37 / 0.20)  # max(loco) / max(plain) would read 1.0
    assert update_burst(plain, plain) == 1.0


def test_only_the_first_windows_count_and_an_empty_series_is_an_error():
    plain, loco = [0.2] * 12, [0.2] * 10 + [0.9, 0.9]  # windows 11-12: past the first 100 steps
    assert update_burst(loco, plain) == 1.0 and update_burst(loco, plain, windows=12) == pytest.approx(4.5)
    with pytest.raises(ValueError, match="no window to compare"):
        update_burst([], [0.2])
