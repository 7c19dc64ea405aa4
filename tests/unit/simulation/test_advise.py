"""advise(): the decision rule on hand-made evidence, and one end-to-end run on a toy problem."""
import json

import pytest

from deepspeed_loco.config import LocoConfig
from deepspeed_loco.simulation.advise import Comparison, Probe, _burst_warning, advise, judge
from tests.unit.simulation.toy import toy_batches, toy_loss, toy_model

WORLD, MICRO = 4, 4
SMALL, LARGE = 10_820_000, 116_430_720  # parameters of the regime map's 10.8M and 116M models


def _comparison(plain_full, loco_plain, loco_full):
    """Paired cells ``(n, mean, low, high)`` from ``(low, high)`` pairs (mean at the middle)."""
    cell = lambda lo_hi: (3, sum(lo_hi) / 2, *lo_hi)  # noqa: E731
    return Comparison("plain2", 300, {}, cell(plain_full), cell(loco_plain), cell(loco_full))


def test_loco_is_recommended_where_it_measurably_beats_plain_and_matches_full():
    verdict = judge(Probe("plain2", 2.5, 1.0, 38.0, 0.1), _comparison((0.004, 0.038), (-0.038, -0.003),
                                                                      (-0.002, 0.002)), LARGE)
    assert verdict.accepted and verdict.error_feedback and verdict.unresolved == []


def test_an_open_loco_question_at_mid_rise_2_2_turns_loco_on_by_the_map_and_says_so():
    evidence = _comparison((-0.012, 0.025), (-0.022, 0.015), (-0.012, 0.017))
    probe = Probe("plain2", 2.9, 1.0, 38.0, 0.1)
    for grid in ("auto", "midrise"):
        verdict = judge(probe, evidence, SMALL, grid)
        assert verdict.accepted and verdict.error_feedback and "regime map's prior" in verdict.reason
        assert len(verdict.unresolved) == 1 and "not by a gain measured here" in verdict.unresolved[0]
        # a 300-step comparison at 2/2 is shorter than the map needed to resolve LoCo's gain, and says so
        assert "only over 1000 steps" in verdict.unresolved[0]
    symmetric = judge(probe, evidence, SMALL, "symmetric")  # the map's 2/2 on this grid is unresolved: plain qgZ
    assert symmetric.accepted and not symmetric.error_feedback and "no error buffers" in symmetric.unresolved[0]
    worse_than_full = judge(probe, _comparison((-0.012, 0.025), (-0.022, 0.015), (0.001, 0.030)), SMALL)
    assert worse_than_full.accepted and not worse_than_full.error_feedback  # LoCo - full above 0: plain qgZ
    # an open interval whose mean lies above 0 leans against the prior (116M at 64 ranks: +0.13 [-0.18, +0.44])
    leaning_against = judge(probe, _comparison((-0.008, 0.078), (-0.180, 0.440), (-0.185, 0.515)), SMALL)
    assert leaning_against.accepted and not leaning_against.error_feedback
    assert "against the map's prior" in leaning_against.unresolved[0]


def test_an_open_loco_question_above_the_map_s_resolved_sizes_keeps_plain_qgz_and_says_why():
    evidence = _comparison((-0.012, 0.025), (-0.022, 0.015), (-0.012, 0.017))  # leans towards LoCo
    verdict = judge(Probe("plain2", 2.9, 1.0, 38.0, 0.1), evidence, LARGE)
    assert verdict.accepted and not verdict.error_feedback and "regime map's prior" not in verdict.reason
    assert len(verdict.unresolved) == 1 and "plain qgZ is recommended" in verdict.unresolved[0]
    assert "up to 10.8M parameters (this one: 116.4M)" in verdict.unresolved[0]
    small = judge(Probe("plain2", 2.9, 1.0, 38.0, 0.1), evidence, SMALL)
    assert small.error_feedback and "10.8M parameters (this one" not in small.unresolved[0]


def test_plain_is_recommended_where_it_matches_full_and_the_map_has_no_loco_prior():
    for candidate in ("plain4", "plain8-2h"):
        verdict = judge(Probe(candidate, 0.08, 0.17, 38.0, 0.1), Comparison(candidate, 300, {}, *[
            (3, 0.0, -0.01, 0.01)] * 3), SMALL)
        assert verdict.accepted and not verdict.error_feedback
        assert len(verdict.unresolved) == 1 and "includes 0" in verdict.unresolved[0]
        assert "only over" not in verdict.unresolved[0]  # the schedule caveat is for 2/2 only


def test_loco_within_noise_of_full_where_plain_departs_is_recommended_with_a_caveat():
    verdict = judge(Probe("plain2", 2.8, 1.0, 38.0, 0.1), _comparison((0.006, 0.045), (-0.037, 0.005),
                                                                      (-0.002, 0.021)), LARGE)
    assert verdict.accepted and verdict.error_feedback and "not by a resolved gain" in verdict.unresolved[0]


def test_a_setting_that_costs_loss_either_way_is_rejected():
    verdict = judge(Probe("plain2", 3.1, 1.0, 30.0, 0.1), _comparison((0.001, 0.029), (-0.033, 0.027),
                                                                      (0.010, 0.090)), SMALL)
    assert not verdict.accepted


def test_without_a_comparison_only_rho_below_one_is_accepted():
    assert judge(Probe("plain4", 0.08, 0.17, 38.0, 0.1), None, SMALL).accepted
    assert not judge(Probe("plain2", 2.5, 1.0, 38.0, 0.1), None, SMALL).accepted
    assert not judge(Probe("plain2", None, 1.0, None, 0.1), None, SMALL).accepted


_loss = toy_loss


def _model():
    return toy_model(hidden=32)


def _data():
    return toy_batches(WORLD * MICRO)


def test_advise_end_to_end_gives_a_valid_block_with_its_evidence(tmp_path):
    stages = []
    advice = advise(_model, _data, 2, 2, budget_minutes=5, candidates=("plain2", "plain4"), steps=50, seeds=2,
                    probe_steps=5, loss_fn=_loss, loco={"group_size": 32},
                    on_progress=lambda stage, done, total: stages.append(stage))
    LocoConfig.from_dict(advice.config)  # a valid zeropp_loco_param block
    assert advice.config["group_size"] == 32 and advice.config["local_world_size"] == 2
    assert [p.candidate for p in advice.probes] == ["plain2", "plain4"] and stages[0] == "probe"
    # the 2-bit candidate was trained three ways over both seeds (steps given, so the budget does not decide)
    first = advice.comparisons[0]
    assert first.candidate == "plain2" and set(first.losses) == {"full", "plain2", "loco2"}
    assert all(set(by_seed) == {0, 1} for by_seed in first.losses.values())
    assert first.loco_minus_plain[0] == 2 and first.loco_minus_plain[2] <= first.loco_minus_plain[3]
    assert all(p.step_error > 0 for p in advice.probes)
    assert advice.probes[0].step_error > advice.probes[1].step_error  # 2 bits err more than 4
    json.dumps(advice.to_dict())
    rows = [line for line in advice.table().splitlines() if line.startswith("| ") and "bit" in line.split("|")[1]]
    assert [row.split("|")[1].strip() for row in rows] == ["2-bit", "4-bit"]  # one row per candidate
    advice.plot(str(tmp_path / "advise.png"))
    assert (tmp_path / "advise.png").stat().st_size > 0


@pytest.mark.parametrize("kwargs, match", [({"candidates": ("loco2", )}, "must be plain qgZ arms"),
                                           ({"seeds": 1}, "seeds = 1"), ({"budget_minutes": 0}, "budget_minutes = 0"),
                                           ({"probe_steps": 1}, "probe_steps = 1"),
                                           ({"seeds": 3, "max_seeds": 2}, "max_seeds = 2")])
def test_bad_arguments_are_clear_errors(kwargs, match):
    args = dict(budget_minutes=1, loss_fn=_loss)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        advise(_model, _data, 2, 2, **args)


def test_runs_side_by_side_give_the_same_evidence_as_runs_one_at_a_time():
    args = dict(budget_minutes=5, candidates=("plain2", ), steps=50, seeds=2, probe_steps=3, loss_fn=_loss,
                loco={"group_size": 32})
    alone = advise(_model, _data, 2, 2, **args)
    side_by_side = advise(_model, _data, 2, 2, parallel=2, **args)
    assert side_by_side.parallel == 2 and len(side_by_side.probes) == 1
    assert side_by_side.comparisons[0].losses == alone.comparisons[0].losses  # bit-identical final losses
    assert side_by_side.comparisons[0].update_bursts == alone.comparisons[0].update_bursts
    assert set(alone.comparisons[0].update_bursts) == {0, 1} and all(
        b > 0 for b in alone.comparisons[0].update_bursts.values())
    row = next(line for line in alone.table().splitlines() if line.startswith("| 2-bit"))
    assert row.split("|")[-2].strip() == f"{max(alone.comparisons[0].update_bursts.values()):.2f}"
    assert set(alone.comparisons[0].losses["loco2"]) == {0, 1}


def test_side_by_side_needs_callables_that_pickle():
    with pytest.raises(ValueError, match="model_fn = .* does not pickle"):
        advise(lambda: toy_model(), _data, 2, 2, budget_minutes=1, loss_fn=_loss, parallel=2)


def test_a_measurable_loss_from_loco_closes_the_question_with_plain_qgz():
    verdict = judge(Probe("plain2", 2.5, 1.0, 38.0, 0.1), _comparison((-0.010, 0.020), (0.001, 0.003),
                                                                      (-0.005, 0.030)), SMALL)
    assert verdict.accepted and not verdict.error_feedback and not verdict.unresolved
    assert "LoCo cost loss" in verdict.reason


def test_an_open_question_gets_more_seeds_while_the_budget_lasts():
    args = dict(budget_minutes=5, candidates=("plain2", ), steps=50, seeds=2, probe_steps=3, loss_fn=_loss,
                loco={"group_size": 32})
    two = advise(_model, _data, 2, 2, **args)
    assert two.unresolved and set(two.comparisons[0].losses["loco2"]) == {0, 1}  # 2 seeds leave it open
    more = advise(_model, _data, 2, 2, max_seeds=6, **args)
    seeds = set(more.comparisons[0].losses["loco2"])
    assert seeds == {0, 1, 2, 3} and not more.unresolved  # seeds were added until LoCo - plain excluded 0
    assert more.comparisons[0].losses["loco2"][0] == two.comparisons[0].losses["loco2"][0]  # the same first runs
    assert "LoCo cost loss" in more.reasons[0]


def test_a_verdict_turning_loco_on_warns_of_an_update_burst_above_the_maps_line():
    calm = Comparison("plain2", 300, {}, update_bursts={0: 1.05, 1: 1.3})
    assert _burst_warning(calm) == "" and _burst_warning(None) == ""
    warned = _burst_warning(Comparison("plain2", 300, {}, update_bursts={0: 1.05, 1: 1.89, 2: 1.97}))
    assert "seed 1 (1.89x), 2 (1.97x)" in warned and "more than 1.3x" in warned and "0 (1.05x)" not in warned
