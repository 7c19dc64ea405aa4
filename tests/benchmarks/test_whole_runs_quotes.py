"""benchmarks/whole_runs_quotes.py: every number the whole-runs study quotes, recomputed from the committed raw
records, stands in its passage; a changed number is caught; the TOST power behaves as power does."""
import pytest

from tests.extras import needs_extra


@pytest.fixture(scope="module")
def quotes(benchmark_module):
    """benchmarks/whole_runs_quotes.py (its statistics import numpy and scipy)."""
    needs_extra("numpy", "demo")
    needs_extra("scipy.stats", "demo")
    return benchmark_module("whole_runs_quotes")


def test_every_quoted_passage_matches_the_committed_records(quotes):
    rows = quotes.check()
    missing = [f"{path}: {passage}" for path, passage, found in rows if not found]
    assert not missing, "\n".join(missing)
    assert len(rows) == len(quotes.QUOTES)


def test_a_number_off_by_its_last_digit_is_caught(quotes):
    values = quotes.numbers()
    values["A"]["bound"] = f"{float(values['A']['bound']) + 0.0001:.4f}"
    assert any(not found for _, _, found in quotes.check(values=values))


def test_the_bound_is_minus_the_lower_end_of_the_interval(quotes):
    values = quotes.numbers()
    for stage in ("A", "C"):
        low = values[stage]["result"]["P"]["LoCo - plain"]["low"]
        assert low < 0 and values[stage]["bound"] == f"{-low:.4f}"


def test_tost_power_grows_with_seeds_and_reaches_the_goal_where_it_says(quotes):
    powers = [quotes.tost_power(n, 0.0044, 0.003) for n in (5, 9, 20, 40)]
    assert powers == sorted(powers) and 0 < powers[0] < powers[-1] < 1
    n = quotes.seeds_for_power(0.0044, 0.003)
    assert quotes.tost_power(n, 0.0044, 0.003) >= quotes.POWER_GOAL > quotes.tost_power(n - 1, 0.0044, 0.003)
    assert quotes.tost_power(5, 0.0001, 0.003) > 0.99  # a tight spread shows equivalence almost surely


def test_the_main_exits_non_zero_on_a_misquote(quotes, tmp_path, monkeypatch):
    assert quotes.main([]) == 0
    real = quotes.numbers

    def shifted(root=quotes.ROOT):
        values = real(root)
        values["C"]["P"] = values["C"]["P"].replace("-0.", "-1.", 1)
        return values

    monkeypatch.setattr(quotes, "numbers", shifted)
    assert quotes.main([]) == 1
