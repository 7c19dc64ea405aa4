"""benchmarks/convergence_sim.py's experiments (error feedback on some hops only, from a later step, the released
share) as a StepObserver: the same bits as when they were simulate()'s own parameters.

``data/observer_experiments_before.json`` was recorded by ``simulate(..., error_feedback_hops=("inter_node", ))``,
``simulate(..., error_feedback_from_step=4)`` and ``simulate(..., diagnostics=True)`` at commit 1446a8a, before the
parameters moved into the observer (arms plain2 and loco2, the toy MLP with 16 hidden units, 2 x 2 ranks, global
batch 8, 8 steps, seed 1, group_size 32, grad_mode "loop")."""
import json
import os

import pytest
import torch

from deepspeed_loco.simulation import SimulationSpec, TrainingSetup, simulate
from tests.unit.simulation.toy import toy_batches, toy_loss, toy_model

RECORDED = os.path.join(os.path.dirname(__file__), "data", "observer_experiments_before.json")
EXPERIMENTS = {"ef_hops_inter": dict(kept_hops=("inter_node", )), "ef_from_4": dict(from_step=4),
               "diagnostics": dict(diagnostics=True)}


STEPS = 30


@pytest.fixture(scope="module")
def sim(benchmark_module):
    return benchmark_module("convergence_sim")


@pytest.fixture(scope="module")
def run(sim):
    """``run(arms, loco=..., **experiments)``: the arms over 30 steps at 2 x 2 ranks, 4 samples per rank."""

    def run(arms, loco=None, **experiments):
        setup = TrainingSetup(toy_model, lambda: toy_batches(16), nodes=2, local=2, loss_fn=toy_loss,
                              loco={"group_size": 32, **(loco or {})})
        return simulate(SimulationSpec(setup, arms, STEPS), sim.Experiments(4, 2, **experiments))

    return run


@pytest.fixture(scope="module")
def recorded():
    with open(RECORDED) as f:
        return json.load(f)


def _small_model():
    return toy_model(16)


def _tiny(experiments):
    torch.set_num_threads(1)
    setup = TrainingSetup(_small_model, lambda: toy_batches(8), nodes=2, local=2, loco={"group_size": 32},
                          loss_fn=toy_loss, grad_mode="loop")
    results = simulate(SimulationSpec(setup, ["plain2", "loco2"], 8, seed=1), experiments)
    return [json.loads(json.dumps(dict(r.to_dict(), wall_s=0.0))) for r in results]  # tuples as the file has them


def _as_recorded(runs, recorded_runs):
    """``runs`` cut to the fields the recording has; the fields added since (the live rho's, all ``live_*``) must be
    empty here: 8 steps never reach the default ``rho_every`` of 10."""
    for run in runs:
        assert all(not value for key, value in run.items() if key.startswith("live_"))
    return [{key: run[key] for key in old} for run, old in zip(runs, recorded_runs)]


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_the_observer_gives_the_bits_the_parameters_gave(sim, recorded, name):
    assert _as_recorded(_tiny(sim.Experiments(4, 2, **EXPERIMENTS[name])), recorded[name]) == recorded[name]


def test_the_experiments_change_loco_alone_and_the_diagnostics_change_nothing(recorded):
    """The recorded runs are not all the library's default: zeroing buffers changes LoCo's run, never plain's;
    the released share is recorded for LoCo only and leaves training as it is."""
    default = _as_recorded(_tiny(None), recorded["diagnostics"])
    assert recorded["diagnostics"][1]["released_fractions"] and not recorded["diagnostics"][0]["released_fractions"]
    assert [dict(r, released_fractions=[]) for r in recorded["diagnostics"]] == default
    for name in ("ef_hops_inter", "ef_from_4"):
        assert recorded[name][0] == default[0]
        assert recorded[name][1]["train_losses"] != default[1]["train_losses"]


def test_a_hop_the_layout_lacks_is_refused(sim):
    with pytest.raises(ValueError, match=r"--ef-hops: \['inter'\] are not hops of this layout"):
        sim.Experiments(4, 2, kept_hops=("inter", ))


def test_error_feedback_on_no_hop_is_plain_qgz_and_on_every_hop_is_loco(run):
    plain, loco = run(["plain2", "loco2"])
    none, = run(["loco2"], kept_hops=())
    both, = run(["loco2"], kept_hops=("intra_node", "inter_node"))
    assert none.train_losses == plain.train_losses
    assert both.train_losses == loco.train_losses != plain.train_losses
    inter, = run(["loco2"], kept_hops=("inter_node", ))
    assert inter.train_losses not in (plain.train_losses, loco.train_losses)


def test_diagnostics_record_what_error_feedback_released(run):
    # the symmetric 2-bit grid has a zero level that plain qgZ leaves many coordinates at ("auto" would pick mid-rise)
    symmetric = {"loco": {"quant_grid": "symmetric"}}
    plain, loco = run(["plain2", "loco2"], diagnostics=True, **symmetric)
    assert plain.released_fractions == [] and len(loco.released_fractions) == STEPS
    # released coordinates are nonzero in LoCo's mean: their share is at most the nonzero share, and some exist
    assert all(0 <= r <= n for r, n in zip(loco.released_fractions, loco.nonzero_fractions))
    assert max(loco.released_fractions) > 0
    assert all(u > 0 for u in plain.update_rms) and len(plain.update_rms) == STEPS
    # diagnostics only observe: the arm trains exactly as without them
    again, = run(["loco2"], **symmetric)
    assert again.train_losses == loco.train_losses




def test_error_feedback_from_a_later_step_is_plain_qgz_until_then(run):
    plain, loco = run(["plain2", "loco2"])
    never, = run(["loco2"], from_step=STEPS + 1)
    first, = run(["loco2"], from_step=1)
    late, = run(["loco2"], from_step=11)
    assert never.train_losses == plain.train_losses and first.train_losses == loco.train_losses
    # plain qgZ for steps 1-10 (the loss of step 11 is computed before its reduce), LoCo's buffers from step 11 on
    assert late.train_losses[:11] == plain.train_losses[:11] and late.train_losses != plain.train_losses
    with pytest.raises(ValueError, match=r"--ef-from 0: it must be an optimizer step >= 1"):
        run(["loco2"], from_step=0)
