"""LoCo's early update burst: window means and the window-by-window ratio, exact on made-up series."""
import pytest

from deepspeed_loco.simulation.burst import BURST_WINDOW, BURST_WINDOWS, update_burst, window_means


def test_window_means_are_the_means_of_consecutive_windows_the_last_one_shorter():
    assert window_means([1.0, 2.0, 3.0, 4.0, 5.0], 2) == [1.5, 3.5, 5.0]
    assert window_means(list(range(25)))[:2] == [4.5, 14.5] and len(window_means(list(range(25)))) == 3
    assert window_means([]) == [] and BURST_WINDOW * BURST_WINDOWS == 100


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
