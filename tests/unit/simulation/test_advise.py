"""advise(): the decision rule on hand-made evidence, one end-to-end run on a toy problem, and the inputs refused
before anything runs."""
import dataclasses
import json

import pytest
import torch

from deepspeed_loco.config import LocoConfig
from deepspeed_loco.findings import read_map
from deepspeed_loco.simulation import TrainingSetup
from deepspeed_loco.simulation.advise import (AdviseInputError, BudgetTooSmall, Comparison, Probe, _burst_warning,
                                             advise, judge)
from deepspeed_loco.simulation.differences import ABOVE, BELOW, INCLUDES, Difference
from deepspeed_loco.simulation.train import LossCallError
from tests.extras import needs_extra
from tests.unit.simulation.toy import toy_batches, toy_loss, toy_model

WORLD, MICRO = 4, 4
SMALL, LARGE = 10_820_000, 116_430_720  # parameters of the regime map's 10.8M and 116M models


def _comparison(plain_full, loco_plain, loco_full, candidate="plain2"):
    """Differences over 3 seeds from ``(low, high)`` pairs (mean at the middle)."""
    names = ("plain - full", "LoCo - plain", "LoCo - full")
    return Comparison(candidate, 300, {}, *[Difference(name, 3, sum(lo_hi) / 2, *lo_hi)
                                            for name, lo_hi in zip(names, (plain_full, loco_plain, loco_full))])


def test_loco_is_recommended_where_it_measurably_beats_plain_and_matches_full():
    verdict = judge(Probe("plain2", 2.5, 1.0, 0.1), _comparison((0.004, 0.038), (-0.038, -0.003),
                                                                      (-0.002, 0.002)), LARGE)
    assert verdict.accepted and verdict.error_feedback and verdict.unresolved == []


def test_an_open_loco_question_at_mid_rise_2_2_turns_loco_on_by_the_map_and_says_so():
    evidence = _comparison((-0.012, 0.025), (-0.022, 0.015), (-0.012, 0.017))
    probe = Probe("plain2", 2.9, 1.0, 0.1)
    for grid in ("auto", "midrise"):
        verdict = judge(probe, evidence, SMALL, grid)
        assert (verdict.accepted, verdict.error_feedback, verdict.basis) == (True, True, "map")
        assert len(verdict.unresolved) == 1
        # a 300-step comparison at 2/2 is shorter than the map needed to resolve LoCo's gain, and says so
        assert "only over schedules of 1000 steps" in verdict.unresolved[0]
    symmetric = judge(probe, evidence, SMALL, "symmetric")  # the map's 2/2 on this grid is unresolved: plain qgZ
    assert symmetric.accepted and not symmetric.error_feedback and "no error buffers" in symmetric.unresolved[0]
    worse_than_full = judge(probe, _comparison((-0.012, 0.025), (-0.022, 0.015), (0.001, 0.030)), SMALL)
    assert worse_than_full.accepted and not worse_than_full.error_feedback  # LoCo - full above 0: plain qgZ
    # an open interval whose mean lies above 0 leans against the prior (116M at 64 ranks: +0.13 [-0.18, +0.44])
    leaning_against = judge(probe, _comparison((-0.008, 0.078), (-0.180, 0.440), (-0.185, 0.515)), SMALL)
    assert leaning_against.accepted and not leaning_against.error_feedback
    assert "against the map's prior" in leaning_against.unresolved[0]


def test_an_open_loco_question_at_116m_turns_loco_on_by_the_map_and_above_it_keeps_plain_qgz():
    """The 2/2 gain was resolved up to 116M (whole 1000-step runs): there the map's prior holds and says its window;
    above every size measured there is no prior, and plain qgZ is kept without a reading to cite."""
    evidence = _comparison((-0.012, 0.025), (-0.022, 0.015), (-0.012, 0.017))  # leans towards LoCo
    probe = Probe("plain2", 2.9, 1.0, 0.1)
    at_116m = judge(probe, evidence, LARGE)
    assert (at_116m.accepted, at_116m.error_feedback, at_116m.basis) == (True, True, "map")
    assert read_map([2, 2], False, "midrise", LARGE).summary in at_116m.reason
    assert "only over schedules of 1000 steps" in at_116m.unresolved[0]
    above = judge(probe, evidence, LARGE + 1)
    assert above.accepted and not above.error_feedback and above.basis == "measured"
    assert len(above.unresolved) == 1 and "plain qgZ is recommended" in above.unresolved[0]
    assert "this model" not in above.unresolved[0]  # no reading of the map to cite
    small = judge(probe, evidence, SMALL)
    assert small.error_feedback and "this model" not in small.unresolved[0]
    assert "up to 10.8M parameters over whole runs of 1000 steps or more at global batches of up to 64K tokens" in small.reason


def test_above_the_largest_batch_the_map_measured_2_2_at_an_open_question_keeps_plain_qgz():
    """With the global batch known, the map's prior for LoCo at 2/2 holds only up to the 64K tokens a step it was
    measured at: above, the reading is "unproven" and the sentence names the batch; unknown, the prior holds."""
    evidence = _comparison((-0.012, 0.025), (-0.022, 0.015), (-0.012, 0.017))
    probe = Probe("plain2", 2.9, 1.0, 0.1)
    assert judge(probe, evidence, SMALL, "auto", 65_536).error_feedback
    large = judge(probe, evidence, SMALL, "auto", 1_048_576)
    assert large.accepted and not large.error_feedback and large.basis == "measured"
    assert "at 1M tokens a step plain qgZ lost loss" in large.unresolved[0]
    assert "(this model: 10.8M parameters, 1048576 tokens a step)" in large.unresolved[0]
    with pytest.raises(ValueError, match="tokens_per_step = 0 is invalid: it must be an integer >= 1"):
        advise(TrainingSetup(toy_model, toy_batches), 1.0, tokens_per_step=0)


def test_plain_is_recommended_where_it_matches_full_and_the_map_has_no_loco_prior():
    for candidate in ("plain4", "plain8-2h"):
        verdict = judge(Probe(candidate, 0.08, 0.17, 0.1), _comparison(*[(-0.01, 0.01)] * 3, candidate), SMALL)
        assert verdict.accepted and not verdict.error_feedback
        assert len(verdict.unresolved) == 1 and "includes 0" in verdict.unresolved[0]
        assert "only over" not in verdict.unresolved[0]  # the schedule caveat is for 2/2 only


def test_loco_within_noise_of_full_where_plain_departs_is_recommended_with_a_caveat():
    verdict = judge(Probe("plain2", 2.8, 1.0, 0.1), _comparison((0.006, 0.045), (-0.037, 0.005),
                                                                      (-0.002, 0.021)), LARGE)
    assert verdict.accepted and verdict.error_feedback and "not by a resolved gain" in verdict.unresolved[0]


def test_a_setting_that_costs_loss_either_way_is_rejected():
    verdict = judge(Probe("plain2", 3.1, 1.0, 0.1), _comparison((0.001, 0.029), (-0.033, 0.027),
                                                                      (0.010, 0.090)), SMALL)
    assert not verdict.accepted


def test_without_a_comparison_only_rho_below_one_is_accepted():
    assert judge(Probe("plain4", 0.08, 0.17, 0.1), None, SMALL).accepted
    assert not judge(Probe("plain2", 2.5, 1.0, 0.1), None, SMALL).accepted
    assert not judge(Probe("plain2", None, 1.0, 0.1), None, SMALL).accepted


_loss = toy_loss


def _model():
    return toy_model(hidden=32)


def _data():
    return toy_batches(WORLD * MICRO)


SETUP = TrainingSetup(_model, _data, loss_fn=_loss, loco={"group_size": 32})


@pytest.mark.slow
def test_advise_end_to_end_gives_a_valid_block_with_its_evidence(tmp_path):
    stages, updates = [], []
    advice = advise(SETUP, 5, candidates=("plain2", "plain4"), steps=50, seeds=2, probe_steps=5,
                    on_progress=lambda stage, done, total: stages.append(stage),
                    on_update=lambda partial: updates.append((partial.finished, len(partial.comparisons))))
    LocoConfig.from_dict(advice.config)  # a valid zeropp_loco_param block
    assert advice.config["group_size"] == 32
    assert "local_world_size" not in advice.config  # the block pastes into a multi-node job: the launcher's count
    assert [p.candidate for p in advice.probes] == ["plain2", "plain4"] and stages[0] == "probe"
    # the 2-bit candidate was trained three ways over both seeds (steps given, so the budget does not decide)
    first = advice.comparisons[0]
    assert first.candidate == "plain2" and set(first.losses) == {"full", "plain2", "loco2"}
    assert all(set(by_seed) == {0, 1} for by_seed in first.losses.values())
    assert first.loco_minus_plain.n == 2 and first.loco_minus_plain.low <= first.loco_minus_plain.high
    # one noise scale for the model at this layout, from every probe run, shared by both candidates' rho
    assert advice.noise_scale.runs == 2 and advice.noise_scale.low < advice.noise_scale.mean < advice.noise_scale.high
    ratio = [p.rho / p.step_error**2 for p in advice.probes]  # rho = err^2 (1 + B/b) / (B/b): the same B, same ratio
    assert ratio[0] == pytest.approx(ratio[1], rel=1e-12)
    assert updates[0] == (False, 0) and advice.finished  # the probe's evidence went out before any comparison
    assert all(p.step_error > 0 for p in advice.probes)
    assert advice.probes[0].step_error > advice.probes[1].step_error  # 2 bits err more than 4
    assert json.loads(json.dumps(advice.to_dict()))["comparisons"][0]["loco_minus_plain"]["n"] == 2
    rows = [line for line in advice.table().splitlines() if line.startswith("| ") and "bit" in line.split("|")[1]]
    assert [row.split("|")[1].strip() for row in rows] == ["2-bit", "4-bit"]  # one row per candidate
    needs_extra("matplotlib", "report")  # the PNG; everything above ran without it
    advice.plot(str(tmp_path / "advise.png"))
    assert (tmp_path / "advise.png").stat().st_size > 0


@pytest.mark.parametrize("kwargs, match", [({"candidates": ("loco2", )}, "must be plain qgZ arms"),
                                           ({"candidates": ("plain5", )}, "candidates: "),
                                           ({"seeds": 1}, "seeds = 1"), ({"budget_minutes": 0}, "budget_minutes = 0"),
                                           ({"budget_minutes": -1}, "budget_minutes = -1"),
                                           ({"budget_minutes": float("inf")}, "budget_minutes = inf"),
                                           ({"probe_steps": 1}, "probe_steps = 1"), ({"steps": 0}, "steps = 0"),
                                           ({"max_steps": 0}, "max_steps = 0"),
                                           ({"seeds": 3, "max_seeds": 2}, "max_seeds = 2"),
                                           ({"parallel": 0}, "parallel = 0"), ({"parallel": 1.5}, "parallel = 1.5"),
                                           ({"tokens_per_step": 0}, "tokens_per_step = 0")])
def test_bad_arguments_are_one_line_input_errors_before_anything_runs(kwargs, match, monkeypatch):
    def never(*args):
        raise AssertionError("the model was built before the numbers were checked")

    args = dict(budget_minutes=1)
    args.update(kwargs)
    with pytest.raises(AdviseInputError, match=match) as err:
        advise(dataclasses.replace(SETUP, model_fn=never), **args)
    assert "\n" not in str(err.value)


def _logits(batch_as_tuple: bool):
    """A model whose forward returns logits: (x) -> (n, 1), with batches (x, y) or x alone."""
    def model_fn():
        return torch.nn.Linear(3, 1)

    def data_fn():
        while True:
            x = torch.randn(8, 3)
            yield (x, x.sum(1)) if batch_as_tuple else x

    return TrainingSetup(model_fn, data_fn)


@pytest.mark.parametrize("setup, said", [
    (_logits(batch_as_tuple=True), "model(*micro_batch), the default loss_fn, raised TypeError: Linear.forward() "),
    (_logits(batch_as_tuple=False), "model(micro_batch), the default loss_fn, returned a tensor of shape (2, 1)"),
    (dataclasses.replace(SETUP, loss_fn=lambda model, batch: model(batch[0]).sum().item()),
     "loss_fn(model, micro_batch) returned a float"),
    (dataclasses.replace(SETUP, loss_fn=lambda model, batch: torch.tensor(1.0)),
     "returned a tensor that does not depend on the model's parameters"),
])
def test_a_loss_that_is_not_computed_as_training_needs_it_is_refused_before_the_probe(setup, said, monkeypatch):
    import deepspeed_loco.simulation.advise as advise_module
    monkeypatch.setattr(advise_module, "_side_by_side", lambda *args: pytest.fail("the probe started"))
    with pytest.raises(AdviseInputError) as err:
        advise(setup, 1)
    message = str(err.value)
    assert message.startswith("advise: one micro-batch before the probe: ") and said in message and "\n" not in message
    assert "it must return the micro-batch's scalar loss" in message and "--loss module:function" in message
    assert isinstance(err.value.__cause__, LossCallError)  # what the caller's code raised stays chained


def test_an_error_inside_the_callers_model_is_said_with_where_it_arose():
    def loss_fn(model, batch):
        return model(batch[0].t()).sum()  # the wrong shape, in the caller's own code

    with pytest.raises(AdviseInputError, match=r"raised RuntimeError: mat1 and mat2 shapes cannot be multiplied .* "
                                               r"\(at test_advise.py:\d+, in loss_fn\)$"):
        advise(dataclasses.replace(SETUP, loss_fn=loss_fn), 1)


@pytest.mark.slow
def test_runs_side_by_side_give_the_same_evidence_as_runs_one_at_a_time():
    args = dict(budget_minutes=5, candidates=("plain2", ), steps=50, seeds=2, probe_steps=3)
    alone = advise(SETUP, **args)
    side_by_side = advise(SETUP, parallel=2, **args)
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
        advise(TrainingSetup(lambda: toy_model(), _data, loss_fn=_loss), 1, parallel=2)


def test_a_measurable_loss_from_loco_closes_the_question_with_plain_qgz():
    verdict = judge(Probe("plain2", 2.5, 1.0, 0.1), _comparison((-0.010, 0.020), (0.001, 0.003),
                                                                      (-0.005, 0.030)), SMALL)
    assert verdict.accepted and not verdict.error_feedback and not verdict.unresolved


@pytest.mark.slow
def test_an_open_question_gets_more_seeds_while_the_budget_lasts():
    args = dict(budget_minutes=5, candidates=("plain2", ), steps=50, seeds=2, probe_steps=3)
    two = advise(SETUP, **args)
    assert two.unresolved and set(two.comparisons[0].losses["loco2"]) == {0, 1}  # 2 seeds leave it open
    more = advise(SETUP, max_seeds=6, **args)
    seeds = set(more.comparisons[0].losses["loco2"])
    assert seeds == {0, 1, 2, 3} and not more.unresolved  # seeds were added until LoCo - plain excluded 0
    assert more.comparisons[0].losses["loco2"][0] == two.comparisons[0].losses["loco2"][0]  # the same first runs
    assert more.comparisons[0].loco_minus_plain.worse and more.recommended == "qgZ 2-bit"


def test_a_verdict_turning_loco_on_warns_of_an_update_burst_above_the_maps_line():
    calm = Comparison("plain2", 300, {}, update_bursts={0: 1.05, 1: 1.3})
    assert _burst_warning(calm) == "" and _burst_warning(None) == ""
    warned = _burst_warning(Comparison("plain2", 300, {}, update_bursts={0: 1.05, 1: 1.89, 2: 1.97}))
    assert "seed 1 (1.89x), 2 (1.97x)" in warned and "more than 1.3x" in warned and "0 (1.05x)" not in warned


SIDES = {BELOW: (-0.0368, -0.0167), INCLUDES: (-0.012, 0.017), ABOVE: (0.004, 0.038)}


@pytest.mark.parametrize("plain_full", SIDES)
@pytest.mark.parametrize("loco_plain", SIDES)
@pytest.mark.parametrize("loco_full", SIDES)
def test_every_verdict_states_each_difference_as_the_rule_read_it(plain_full, loco_plain, loco_full):
    """The issue's case among them: LoCo - full -0.0268 [-0.0368, -0.0167] was called "does not exclude" 0. Every
    difference a verdict names is written by the Difference itself, from the side the rule decided on."""
    comparison = _comparison(SIDES[plain_full], SIDES[loco_plain], SIDES[loco_full])
    verdict = judge(Probe("plain2", 2.5, 1.0, 0.1), comparison, SMALL)
    text = " ".join([verdict.reason] + verdict.unresolved)
    differences = (comparison.plain_minus_full, comparison.loco_minus_plain, comparison.loco_minus_full)
    named = [d for d in differences if f"{d.name} {d.value()}" in text]
    assert named and all(d.said() in text for d in named)
    assert not any(f"{d.name} {d.value()} {side}" in text for d in differences for side in SIDES if side != d.side)
    # the decision follows the rule of judge's docstring
    loco_ok = comparison.loco_minus_full.not_worse and (comparison.loco_minus_plain.better
                                                        or comparison.plain_minus_full.worse)
    assert verdict.accepted == (loco_ok or comparison.plain_minus_full.not_worse)
    if loco_ok:
        assert verdict.error_feedback


def test_the_difference_s_side_decides_its_predicates():
    below = Difference("LoCo - full", 3, -0.0268, -0.0368, -0.0167)
    assert below.said() == "LoCo - full -0.0268 [-0.0368, -0.0167] lies below 0"
    assert (below.better, below.not_worse, below.worse) == (True, True, False)
    straddles, above = Difference("d", 3, 0.0, -0.01, 0.01), Difference("d", 3, 0.02, 0.01, 0.03)
    assert (straddles.better, straddles.not_worse, straddles.worse) == (False, True, False)
    assert (above.better, above.not_worse, above.worse) == (False, False, True)
    one = Difference.paired("d", {0: 1.0}, {0: 0.5})
    assert one.side is None and not (one.better or one.not_worse or one.worse)
    assert one.said() == "d +0.5000 (1 seed) has no interval"
    assert Difference.paired("d", {0: 1.0, 1: 2.0}, {0: 0.5, 1: 1.0}).mean == 0.75


@pytest.mark.slow
def test_a_budget_smaller_than_the_probe_is_refused_with_the_smallest_that_answers():
    with pytest.raises(BudgetTooSmall, match=r"budget_minutes = 1e-06 is too small: the probe alone needs about "
                                              r"[0-9.e-]+ minutes") as refused:
        advise(SETUP, 1e-6, candidates=("plain2", ), probe_steps=3)
    assert 1e-6 < refused.value.needed_minutes < 1  # a few seconds on any machine; 5 minutes answer (the
    # comparison held at the shortest one, 50 steps over 2 seeds: the budget would otherwise buy minutes of steps)
    answered = advise(SETUP, 5, candidates=("plain2", ), probe_steps=3, steps=50, seeds=2)
    assert answered.probes[0].candidate == "plain2" and answered.comparisons[0].steps == 50


def test_the_advice_states_the_blocks_error_memory_per_gpu_and_the_leanest_options():
    from deepspeed_loco.runtime.comm.error_feedback import error_bytes_per_parameter
    from deepspeed_loco.simulation.advise import error_memory_lines
    block = {"intra_node_bits": 2, "inter_node_bits": 2, "error_feedback": True, "quant_grid": "auto"}
    (line, ) = error_memory_lines(block, 10_000_000, 8, 8)
    mine = error_bytes_per_parameter(64, 8, LocoConfig.from_dict(block)) * 1e7
    lean = error_bytes_per_parameter(64, 8, LocoConfig(error_feedback="inter_node", error_bits=4)) * 1e7
    assert f"{mine / 2**20:.1f} MiB per GPU for this model at 8 x 8 ranks" in line
    assert f"would hold {lean / 2**20:.1f} MiB" in line and mine / lean > 17
    assert error_memory_lines(dict(block, error_feedback=False), 10_000_000, 8, 8) == []
