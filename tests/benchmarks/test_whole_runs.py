"""benchmarks/whole_runs.py: the whole-runs study's fixed analysis on made-up runs whose differences are known."""
import json
import math

import pytest

from deepspeed_loco.utils.stats import t_interval
from tests.extras import needs_extra

SEEDS, STEPS = (0, 1, 2, 3, 4), list(range(50, 1001, 50))


@pytest.fixture(scope="module")
def wr(benchmark_module):
    """benchmarks/whole_runs.py, whose statistics (map_statistics) import numpy and scipy."""
    needs_extra("numpy", "demo")
    needs_extra("scipy.stats", "demo")
    return benchmark_module("whole_runs")


def _gap(step):
    """LoCo - plain by step: grows to -0.004 at step 400, then shrinks to -0.001 at step 1000."""
    return -0.004 * step / 400 if step <= 400 else -0.004 + 0.003 * (step - 400) / 600


def _runs():
    """Full: a falling curve with a seed offset; plain: full + 0.002; LoCo: plain + the gap above, with a per-seed
    wobble so that intervals are finite."""
    arms = {}
    for seed in SEEDS:
        wobble = 0.0002 * (seed - 2)
        curves = {"full": {s: 1.2 + 1 / math.sqrt(s) + 0.01 * seed for s in STEPS}}
        curves["plain4"] = {s: v + 0.002 + wobble for s, v in curves["full"].items()}
        curves["loco4"] = {s: v + _gap(s) - wobble / 2 for s, v in curves["plain4"].items()}
        for key, curve in curves.items():
            arms.setdefault(key, {})[seed] = {
                "key": key, "seed": seed, "validation": sorted(curve.items()), "final_val_loss": curve[1000],
                "train_losses": [curve[1000] - 0.01] * 10}
    return arms


def test_the_fixed_families_on_runs_with_known_differences(wr):
    result = wr.analyse(_runs(), "4", tokens_per_step=262144)
    p = result["P"]["LoCo - plain"]
    expected = [_gap(1000) - 0.0001 * (s - 2) for s in SEEDS]
    assert (p["mean"], p["low"], p["high"]) == pytest.approx(t_interval(expected), rel=1e-9)
    assert p["n"] == 5 and p["reading"] == "resolved, inside +-0.003"  # -0.001 on every seed: real, small
    assert list(p["per_seed"].values()) == pytest.approx(expected, abs=1e-12)
    assert result["E"]["plain - full"]["mean"] == pytest.approx(0.002, abs=1e-12)
    assert set(result["E"]) == {"plain - full", "LoCo - full"} and all("p_holm" in c for c in result["E"].values())
    trajectory = [c for c in result["T"] if c["difference"] == "LoCo - plain"]
    assert [c["step"] for c in trajectory] == STEPS and trajectory[7]["mean"] == pytest.approx(-0.004, abs=1e-4)
    assert trajectory[-1]["tokens"] == 1000 * 262144
    assert len(result["T"]) == 40 and all("p_bh" in c for c in result["T"])
    assert result["S"]["LoCo - plain"]["reading"] == "shrinking"  # the gap closes from step 550 on
    assert result["S"]["LoCo - plain"]["mean"] == pytest.approx(0.003 / 600, rel=1e-6)
    assert result["generalization"]["full"] == pytest.approx(0.01)
    assert result["second_half_gain_full"] == pytest.approx(1 / math.sqrt(550) - 1 / math.sqrt(1000))


def test_stage_c_corrects_its_three_end_differences_together(wr):
    """Stage C's plan: LoCo - plain, plain - full and LoCo - full at the end, one family, Holm over the 3."""
    split, joint = wr.analyse(_runs(), "4"), wr.analyse(_runs(), "4", end_family="joint")
    cells = [joint["P"]["LoCo - plain"], joint["E"]["plain - full"], joint["E"]["LoCo - full"]]
    adjusted, _ = wr.holm([c["p"] for c in cells])
    assert [c["p_holm"] for c in cells] == pytest.approx(adjusted, rel=1e-12)
    assert "p_holm" not in split["P"]["LoCo - plain"]  # stage A's primary difference stands alone
    assert split["E"]["plain - full"]["p_holm"] != joint["E"]["plain - full"]["p_holm"]
    assert "| end | LoCo - plain |" in wr.markdown(joint) and "Holm over 3" in wr.markdown(joint)
    with pytest.raises(ValueError, match="end_family = 'both'"):
        wr.analyse(_runs(), "4", end_family="both")


def test_an_arm_not_yet_run_reads_as_such_and_leaves_the_others_whole(wr):
    """Stage A's first lease: plain and LoCo of 4 seeds, no full precision."""
    arms = {key: {seed: run for seed, run in runs.items() if seed < 4}
            for key, runs in _runs().items() if key != "full"}
    result = wr.analyse(arms, "4")
    assert result["P"]["LoCo - plain"]["n"] == 4 and result["S"]["LoCo - plain"]["reading"] == "shrinking"
    assert result["S"]["plain - full"]["reading"] == "not run yet"
    assert all("p_holm" not in c and c["n"] == 0 for c in result["E"].values())
    text = wr.markdown(result)
    assert "| E | plain - full | - | not run yet |" in text and "nan" not in text
    arms["full"] = {0: _runs()["full"][0]}  # one seed of full precision: +0.002 - 0.0004 (its wobble), no interval
    text = wr.markdown(wr.analyse(arms, "4"))
    assert "| E | plain - full | +0.0016 (1 seed) | 1 seed: no interval yet |" in text


def test_a_family_with_members_not_yet_run_gets_holms_upper_bound(wr):
    """Stage C's plain and LoCo runs before its full ones: LoCo - plain is corrected as if the two differences not
    yet run had the largest p-values (x 3), which no later run can raise; equivalence is judged at x 3 too."""
    arms = {key: runs for key, runs in _runs().items() if key != "full"}
    result = wr.analyse(arms, "4", end_family="joint")
    p = result["P"]["LoCo - plain"]
    assert p["holm_untested"] == 2 and p["p_holm"] == pytest.approx(min(1.0, 3 * p["p"]), rel=1e-12)
    assert p["tost_p_family"] == pytest.approx(min(1.0, 3 * p["tost_p"]), rel=1e-12)
    assert "Holm over 3 (2 not run yet): adjusted p at most" in wr.markdown(result)
    for others in ([0.9, 0.95], [1e-6, 1e-5]):  # whatever the missing p-values turn out to be, Holm is at most the bound
        assert wr.holm([p["p"], *others])[0][0] <= p["p_holm"] + 1e-15
    assert "holm_untested" not in wr.analyse(_runs(), "4", end_family="joint")["P"]["LoCo - plain"]


def test_holm_refuses_a_family_smaller_than_its_p_values(wr):
    with pytest.raises(ValueError, match="of = 1 is smaller than the 2 p-values"):
        wr.holm([0.01, 0.02], of=1)


def test_holm_matches_a_hand_computed_example(wr):
    """p = (0.01, 0.04, 0.03): sorted 0.01 x 3 = 0.03, 0.03 x 2 = 0.06, 0.04 x 1 = 0.04 -> kept monotone 0.06."""
    adjusted, rejected = wr.holm([0.01, 0.04, 0.03])
    assert adjusted == pytest.approx([0.03, 0.06, 0.06]) and rejected == [True, False, False]


def test_a_run_recorded_twice_is_refused(wr, tmp_path):
    line = '{"tag": "t", "key": "full", "seed": 0, "validation": [], "final_val_loss": 1.0}\n'
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text(line)
    second.write_text(line)
    with pytest.raises(SystemExit, match="full seed 0 of t is in .*a.jsonl and in .*b.jsonl"):
        wr.load([str(first), str(second)], "t")


def _branches():
    """Stage B's made-up runs, 3 seeds, branches evaluated at steps 150-400 after a trunk saved at step 100: plain =
    full + 0.002; LoCo cold = plain - 0.001; on the LoCo trunk plain warm = plain, LoCo warm = plain warm - 0.005
    (warm buffers gain 0.004 more than cold ones), with a per-seed wobble."""
    steps, runs = list(range(50, 401, 50)), []
    for seed in (0, 1, 2):
        wobble = 0.0003 * (seed - 1)
        full = {s: 1.5 + 1 / math.sqrt(s) + 0.01 * seed for s in steps}
        curves = {("lbF_b4096", "full", 0): full,
                  ("lbF_b4096", "plain4", 100): {s: v + 0.002 + wobble for s, v in full.items()},
                  ("lbF_b4096", "loco4", 100): {s: v + 0.001 for s, v in full.items()},
                  ("lbL_b4096", "plain4", 100): {s: v + 0.002 for s, v in full.items()},
                  ("lbL_b4096", "loco4", 0): {s: v - 0.003 - wobble for s, v in full.items()}}
        for (tag, key, resumed), curve in curves.items():
            validation = sorted((s, v) for s, v in curve.items() if s > resumed)
            runs.append({"tag": tag, "key": key, "seed": seed, "validation": validation, "final_val_loss": curve[400],
                         "setup": {"resumed_from": resumed}})
    return runs


def test_stage_b_pairs_branches_within_their_trunk_and_tests_warm_against_cold(wr, tmp_path):
    path = tmp_path / "b.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _branches()))
    result = wr.analyse_branches(wr.branch_arms([str(path)]))
    end = result["end"]
    assert set(end) == {"LoCo cold - plain", "LoCo warm - plain", "plain - full", "LoCo cold - full"}
    assert end["plain - full"]["mean"] == pytest.approx(0.002, abs=1e-12)
    assert end["LoCo cold - plain"]["per_seed"] == pytest.approx({0: -0.0007, 1: -0.001, 2: -0.0013}, abs=1e-12)
    assert end["LoCo warm - plain"]["per_seed"] == pytest.approx({0: -0.0047, 1: -0.005, 2: -0.0053}, abs=1e-12)
    adjusted, _ = wr.holm([end[n]["p"] for n in end])
    assert [end[n]["p_holm"] for n in end] == pytest.approx(adjusted, rel=1e-12)
    gap = result["warm_minus_cold"]  # -0.004 on every seed: below -0.003, resolved
    assert gap["per_seed"] == pytest.approx({0: -0.004, 1: -0.004, 2: -0.004}, abs=1e-12) and gap["refutes"]
    assert sorted({c["step"] for c in result["T"]}) == [150, 200, 250, 300, 350, 400]  # the branches' evaluations
    assert len(result["T"]) == 24 and all("p_bh" in c for c in result["T"])
    assert "refuted" in wr.markdown_branches(result) and "nan" not in wr.markdown_branches(result)


def test_a_difference_whose_arms_ran_on_different_cards_is_marked_and_the_gain_bound_stated(wr):
    """Stage A's confound: full precision on another card than plain and LoCo for some seeds."""
    arms = _runs()
    for key, runs in arms.items():
        for seed, run in runs.items():
            run["setup"] = {"device": "card B" if key == "full" and seed < 4 else "card A"}
    result = wr.analyse(arms, "4")
    assert set(result["cards"]["plain - full"]) == {0, 1, 2, 3} and result["cards"]["LoCo - plain"] == {}
    text = wr.markdown(result)
    assert "| E | plain - full (arms on different cards for seeds 0, 1, 2, 3: card A vs card B) |" in text
    assert "| P | LoCo - plain | " in text
    p = result["P"]["LoCo - plain"]  # -0.001 on every seed: a resolved gain, so no bound is stated
    assert p["gain_excluded"] is None and "As a bound" not in text
    assert wr.gain_excluded({"low": -0.0039, "high": 0.007}) == pytest.approx(0.0039)
    assert wr.gain_excluded({"low": 0.001, "high": 0.007}) == 0.0
