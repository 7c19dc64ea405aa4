"""benchmarks/map_statistics.py: Benjamini-Hochberg against a hand-computed example, the two one-sided tests
against SciPy's one-sided t-tests, and the seed-blocked model on made-up runs with known regime and seed effects
(seeded, so every run of this file draws the same data)."""
import pytest

from deepspeed_loco.utils.stats import t_interval
from tests.extras import needs_extra


@pytest.fixture(scope="module")
def np():
    return needs_extra("numpy", "demo")


@pytest.fixture(scope="module")
def stats():
    return needs_extra("scipy.stats", "demo")


@pytest.fixture(scope="module")
def ms(benchmark_module, np, stats):
    """benchmarks/map_statistics.py, which imports numpy and scipy itself."""
    return benchmark_module("map_statistics")


def test_benjamini_hochberg_matches_a_hand_computed_example(ms):
    """m = 6, thresholds k * 0.05 / 6 = .0083, .0167, .025, .0333, .0417, .05: sorted p .001 passes, .02 fails its
    own threshold but .022 passes the third, so step-up rejects the three smallest; adjusted p_(i) = min over j >= i
    of 6 p_(j) / j."""
    p = [0.04, 0.001, 0.3, 0.022, 0.045, 0.02]
    adjusted, rejected = ms.benjamini_hochberg(p)
    assert adjusted == pytest.approx([0.054, 0.006, 0.3, 0.044, 0.054, 0.044], rel=1e-12)
    assert rejected == [False, True, False, True, False, True]
    assert ms.benjamini_hochberg([0.001, 0.02, 0.022], rate=0.01)[1] == [True, False, False]
    with pytest.raises(ValueError, match="p-values must lie in"):
        ms.benjamini_hochberg([0.5, 1.2])


def test_tost_is_the_larger_of_two_shifted_one_sided_t_tests(ms, np, stats):
    rng = np.random.default_rng(7)
    for mean, sd, n in ((0.0, 0.004, 8), (0.006, 0.004, 5), (0.0, 0.05, 3), (0.02, 0.002, 6)):
        values = list(rng.normal(mean, sd, n))
        p, low, high = ms.tost(values, margin=0.01)
        upper = stats.ttest_1samp(values, 0.01, alternative="less").pvalue  # H0: mean >= margin
        lower = stats.ttest_1samp(values, -0.01, alternative="greater").pvalue  # H0: mean <= -margin
        assert p == pytest.approx(max(upper, lower), rel=1e-9)
        assert (low, high) == pytest.approx(t_interval(values, 0.90)[1:], rel=1e-12)
        assert (p < 0.05) == (-0.01 < low and high < 0.01)  # equivalence iff the 90% interval lies in the margin
    assert ms.tost(list(rng.normal(0.0, 0.003, 10)), margin=0.01)[0] < 0.05  # equal arms, tight: equivalent
    assert ms.tost(list(rng.normal(0.0, 0.05, 3)), margin=0.01)[0] > 0.05  # within noise is not equivalent
    assert ms.tost(list(rng.normal(0.02, 0.001, 10)), margin=0.01)[0] > 0.99  # a resolved difference beyond it


def test_a_resolved_difference_inside_the_margin_is_not_called_equivalent(ms, stats):
    """The stage-3 8/2 + H cost (+0.0071 on every seed, 95% interval above 0) passes the two one-sided tests at
    +-0.01 but is a real difference: "resolved, inside", not "equivalent"; a tight difference around 0 is
    equivalent; a wide one is not shown."""
    cost = [0.0068, 0.0071, 0.0074]
    p, tost_p = stats.ttest_1samp(cost, 0.0).pvalue, ms.tost(cost)[0]
    assert p < 0.05 and tost_p < 0.05
    assert ms.equivalence_label(p, tost_p) == "resolved, inside +-0.01"
    tight = [-0.0004, 0.0003, 0.0001, -0.0002]
    assert ms.equivalence_label(stats.ttest_1samp(tight, 0.0).pvalue, ms.tost(tight)[0]) == "equivalent within +-0.01"
    wide = [-0.03, 0.04, 0.01]
    assert ms.equivalence_label(stats.ttest_1samp(wide, 0.0).pvalue, ms.tost(wide)[0]) == "not shown"


def _draw(rng, regime_effects, seeds=8, effect=-0.01, seed_sd=0.01, noise=0.003, drop=0.3):
    """Made-up paired differences: ``effect + regime effect + seed effect + noise`` over ``seeds`` seeds, each
    (regime, seed) cell kept with probability 1 - drop (seed 0 always runs every regime, so they stay connected)."""
    seed_effect = rng.normal(0, seed_sd, seeds)
    return [(r, s, effect + a + seed_effect[s] + rng.normal(0, noise))
            for r, a in enumerate(regime_effects) for s in range(seeds) if s == 0 or rng.random() > drop]


def test_the_seed_blocked_effect_covers_the_true_effect_and_the_f_test_finds_an_injected_regime_effect(ms, np):
    rng = np.random.default_rng(2026)
    none, injected = [0.0] * 4, [0.012, -0.012, 0.0, 0.0]  # regime effects summing to 0: the mean stays -0.01
    covered, found, false_alarms, reps = 0, 0, 0, 300
    for _ in range(reps):
        flat, shifted = ms.blocked_effect(_draw(rng, none)), ms.blocked_effect(_draw(rng, injected))
        covered += flat["low"] <= -0.01 <= flat["high"]
        covered += shifted["low"] <= -0.01 <= shifted["high"]
        false_alarms += flat["p_regime"] < 0.05
        found += shifted["p_regime"] < 0.05
    assert 0.92 <= covered / (2 * reps) <= 0.98
    assert false_alarms / reps <= 0.09
    assert found / reps >= 0.95
    single = ms.blocked_effect(_draw(np.random.default_rng(1), injected))
    assert single["low"] <= -0.01 <= single["high"] and single["p_regime"] < 0.01
    assert single["df"] == single["seeds"] - 1 == 7 and single["df_regime"] == 3
    assert ms.blocked_effect(_draw(np.random.default_rng(1), none))["p_regime"] > 0.05


def test_one_regime_is_its_paired_t_interval_and_a_balanced_design_the_t_interval_of_seed_means(ms, np):
    rng = np.random.default_rng(3)
    values = list(rng.normal(-0.01, 0.01, 5))
    one = ms.blocked_effect([("a", s, v) for s, v in enumerate(values)])
    assert (one["mean"], one["low"], one["high"]) == pytest.approx(t_interval(values), rel=1e-9)
    assert one["p"] == pytest.approx(ms.paired_t_test(values)[2], rel=1e-9) and one["p_regime"] is None
    cells = rng.normal(0, 0.01, (3, 4))  # 3 regimes x 4 seeds
    balanced = ms.blocked_effect([(r, s, cells[r, s]) for r in range(3) for s in range(4)])
    assert (balanced["mean"], balanced["low"], balanced["high"]) == pytest.approx(
        t_interval(list(cells.mean(axis=0))), rel=1e-9)
    assert (balanced["df_regime"], balanced["df_residual"]) == (2, 6)


def test_regimes_without_shared_seeds_are_not_told_apart_and_a_cell_counts_once(ms):
    apart = ms.blocked_effect([("a", 0, 0.01), ("a", 1, 0.02), ("b", 2, 0.0), ("b", 3, 0.01)])
    assert not apart["connected"] and apart["mean"] is None and apart["p_regime"] is None
    with pytest.raises(ValueError, match="two differences for one"):
        ms.blocked_effect([("a", 0, 0.01), ("a", 0, 0.02)])


def test_the_burst_rule_is_counted_apart_in_and_out_of_its_sample(ms):
    line = ms.UPDATE_BURST_WARNING
    bursts = [{"tag": "old", "arm": "loco2", "seed": 0, "update_burst": line + 0.2, "loco_minus_plain": 0.05},
              {"tag": "old", "arm": "loco2", "seed": 1, "update_burst": line - 0.2, "loco_minus_plain": 0.001},
              {"tag": "new", "arm": "loco4", "seed": 0, "update_burst": line + 0.1, "loco_minus_plain": 0.01},
              {"tag": "new", "arm": "loco4", "seed": 1, "update_burst": line, "loco_minus_plain": 0.04},
              {"tag": "new", "arm": "loco4", "seed": 2, "update_burst": line + 0.3, "loco_minus_plain": 0.031}]
    counts = ms.burst_rule_counts(bursts, {("old", "loco2", 0), ("old", "loco2", 1)})
    assert counts["in_sample"] == {"hits": 1, "false_alarms": 0, "misses": 0, "quiet": 1}
    assert counts["out_of_sample"] == {"hits": 1, "false_alarms": 1, "misses": 1, "quiet": 0}  # 1.3 itself: quiet
    assert [b["seed"] for b in counts["out_of_sample_runs"]] == [0, 1, 2]


def test_the_burst_rule_s_sample_is_the_map_s_loco_runs_before_it_was_fixed(ms):
    sample = ms.load_burst_sample()
    assert len(sample) == 111 and ("map125m_w64", "loco2", 0) in sample
    assert ("map125m_w16", "loco2", 0) not in sample and ("map125m_w64", "loco4", 0) not in sample
