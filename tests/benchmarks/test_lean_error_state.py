"""benchmarks/lean_error_state.py: the lean-error-state study's fixed analysis on made-up runs whose differences are
known, and Fieller's interval against its defining inequality."""
import math

import pytest

from tests.extras import needs_extra

SEEDS, STEPS = (0, 1, 2, 3, 4), list(range(100, 1001, 100))
OFFSETS = {  # arm -> loss above plain 2/2 at every step (a per-seed wobble added below)
    "le_base:plain2": 0.0, "le_base:loco2": -0.010, "le_e4:loco2": -0.008, "le_inter:loco2": -0.002,
    "le_base:plain8-2h": -0.015, "le_inter:loco8-2h": -0.016, "le_zero500:loco2": -0.010}


@pytest.fixture(scope="module")
def les(benchmark_module):
    needs_extra("numpy", "demo")
    needs_extra("scipy.stats", "demo")
    return benchmark_module("lean_error_state")


def _arms():
    arms = {}
    for seed in SEEDS:
        wobble = 0.0005 * (seed - 2)
        for arm, offset in OFFSETS.items():
            extra = wobble * (1 if arm.endswith("loco2") else 0.5)
            curve = {s: 1.5 + 1 / math.sqrt(s) + 0.01 * seed + offset + extra for s in STEPS}
            tag, key = arm.split(":")
            arms.setdefault(arm, {})[seed] = {"tag": tag, "key": key, "seed": seed,
                                              "validation": sorted(curve.items()), "final_val_loss": curve[1000]}
    return arms


def test_the_families_read_the_known_differences(les):
    result = les.analyse(_arms())
    gain = result["gain"]
    assert gain["LoCo 2/2 (int8, both hops)"]["mean"] == pytest.approx(-0.010, abs=1e-12)
    assert gain["LoCo 2/2, error_bits 4"]["mean"] == pytest.approx(-0.008, abs=1e-12)
    assert all("p_holm" in cell for cell in gain.values()) and len(gain) == 5
    share = result["shares"]["LoCo 2/2, error_bits 4"]
    assert share["share"] == pytest.approx(0.8, abs=1e-9) and share["low"] < 0.8 < share["high"]
    inter = result["shares"]["LoCo 2/2, error_feedback inter_node"]
    assert inter["share"] == pytest.approx(0.2, abs=1e-9) and not inter["keeps_80"]
    assert result["kept"]["LoCo 2/2, error_bits 4"]["mean"] == pytest.approx(0.002, abs=1e-12)
    assert result["zeroed"]["mean"] == pytest.approx(0.0, abs=1e-12) and result["zeroed"]["equivalent"]
    assert [c["step"] for c in result["zeroed_trajectory"]] == list(range(600, 1001, 100))
    text = les.markdown(result)
    assert "Holm over 5" in text and "| LoCo 2/2, error_bits 4 | 0.80 (n=5) |" in text


def test_fieller_bounds_are_where_the_t_statistic_equals_its_quantile(les):
    """At each end R of the interval, (mean(a) - R mean(b))^2 = t^2 var(mean(a) - R mean(b)), the interval's
    definition; a denominator not resolved from 0 gives an unbounded interval."""
    from deepspeed_loco.utils.stats import t_quantile_two_sided
    a, b = [-0.008, -0.009, -0.005, -0.011, -0.007], [-0.010, -0.011, -0.007, -0.012, -0.009]
    ratio, low, high = les.fieller(a, b)
    assert ratio == pytest.approx(sum(a) / sum(b)) and low < ratio < high
    t2 = t_quantile_two_sided(0.95, len(a) - 1) ** 2
    for r in (low, high):
        d = [x - r * y for x, y in zip(a, b)]
        mean = sum(d) / len(d)
        var = sum((v - mean) ** 2 for v in d) / (len(d) - 1) / len(d)
        assert mean * mean == pytest.approx(t2 * var, rel=1e-9)
    assert les.fieller([1.0, 2.0, 3.0], [0.1, -0.1, 0.05])[1:] == (None, None)


def test_item_7_reads_the_116m_differences_and_says_a_missing_lean_arm_is_not_run(les):
    """LoCo 2/2 0.004 above plain at every step, the lean arm 0.001 above LoCo: the family, the equivalence and the
    trajectory every 50 steps read them; without the lean arm's runs its cell is reported as not run, and with the
    arm left out by the plan the family is LoCo 2/2 - plain 2/2 alone (Holm over 1: its own p)."""
    steps = list(range(50, 1001, 50))
    arms = {}
    for seed in (0, 1, 2):
        for arm, offset in {"le116:plain2": 0.0, "le116:loco2": 0.004, "le116_lean:loco2": 0.005}.items():
            curve = {s: 3.0 - s / 1000 + 0.02 * seed + offset + 0.0002 * seed * (arm != "le116:plain2")
                     for s in steps}
            tag, key = arm.split(":")
            arms.setdefault(arm, {})[seed] = {"tag": tag, "key": key, "seed": seed,
                                              "validation": sorted(curve.items()), "final_val_loss": curve[1000]}
    result = les.analyse_116m(arms)
    assert result["family"]["LoCo 2/2 - plain 2/2"]["mean"] == pytest.approx(0.0042, abs=1e-12)
    assert result["lean_minus_loco"]["mean"] == pytest.approx(0.001, abs=1e-12)
    assert result["lean_minus_loco"]["equivalent"]
    assert [c["step"] for c in result["trajectory"]][:2] == [50, 100] and len(result["trajectory"]) == 40
    assert "Holm over 2" in les.markdown_116m(result)
    without_lean = les.analyse_116m({k: v for k, v in arms.items() if not k.startswith("le116_lean")})
    assert "not run yet" in les.markdown_116m(without_lean).splitlines()[6]
    left_out = les.analyse_116m(arms, "loco")
    assert list(left_out["family"]) == ["LoCo 2/2 - plain 2/2"] and left_out["lean_minus_loco"] is None
    assert left_out["family"]["LoCo 2/2 - plain 2/2"]["p_holm"] == left_out["family"]["LoCo 2/2 - plain 2/2"]["p"]
    assert len(left_out["trajectory"]) == 20 and "Holm over 1" in les.markdown_116m(left_out)
    # item 7b: the lean option alone, and the share of LoCo's gain it keeps (lean - plain 0.005 + 0.0002 seed,
    # LoCo - plain 0.004 + 0.0002 seed: by the means 0.0052 / 0.0042)
    alone = les.analyse_116m(arms, "lean")
    assert list(alone["family"]) == ["lean - plain 2/2"] and alone["lean_minus_loco"]["equivalent"]
    assert alone["share"]["share"] == pytest.approx(0.0052 / 0.0042, rel=1e-9)
    assert "Share of LoCo 2/2's gain" in les.markdown_116m(alone) and len(alone["trajectory"]) == 20


def test_the_zeroed_arm_and_its_step_are_arguments_and_its_trajectory_follows_the_runs(les):
    """A 600-step preview whose buffers were zeroed after step 300: its cell and every evaluation after 300."""
    arms = {arm: {seed: dict(run, validation=[(s, v) for s, v in run["validation"] if s <= 600],
                             final_val_loss=dict(run["validation"])[600])
                  for seed, run in runs.items()} for arm, runs in _arms().items()}
    arms["le_zero300:loco2"] = arms.pop("le_zero500:loco2")
    result = les.analyse(arms, zeroed="le_zero300:loco2", zero_step=300)
    assert [c["step"] for c in result["zeroed_trajectory"]] == [400, 500, 600]
    assert result["zeroed"]["mean"] == pytest.approx(0.0, abs=1e-12)
    assert "zeroed after step 300" in les.markdown(result)
