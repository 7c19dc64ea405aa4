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


@pytest.fixture(scope="module")
def recorded():
    with open(RECORDED) as f:
        return json.load(f)


def _small_model():
    return toy_model(16)


def _run(experiments):
    torch.set_num_threads(1)
    setup = TrainingSetup(_small_model, lambda: toy_batches(8), nodes=2, local=2, loco={"group_size": 32},
                          loss_fn=toy_loss, grad_mode="loop")
    results = simulate(SimulationSpec(setup, ["plain2", "loco2"], 8, seed=1), experiments)
    return [json.loads(json.dumps(dict(r.to_dict(), wall_s=0.0))) for r in results]  # tuples as the file has them


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_the_observer_gives_the_bits_the_parameters_gave(benchmark_module, recorded, name):
    sim = benchmark_module("convergence_sim")
    assert _run(sim.Experiments(4, 2, **EXPERIMENTS[name])) == recorded[name]


def test_the_experiments_change_loco_alone_and_the_diagnostics_change_nothing(recorded):
    """The recorded runs are not all the library's default: zeroing buffers changes LoCo's run, never plain's;
    the released share is recorded for LoCo only and leaves training as it is."""
    default = _run(None)
    assert recorded["diagnostics"][1]["released_fractions"] and not recorded["diagnostics"][0]["released_fractions"]
    assert [dict(r, released_fractions=[]) for r in recorded["diagnostics"]] == default
    for name in ("ef_hops_inter", "ef_from_4"):
        assert recorded[name][0] == default[0]
        assert recorded[name][1]["train_losses"] != default[1]["train_losses"]


def test_a_hop_the_layout_lacks_is_refused(benchmark_module):
    with pytest.raises(ValueError, match=r"--ef-hops: \['inter'\] are not hops of this layout"):
        benchmark_module("convergence_sim").Experiments(4, 2, kept_hops=("inter", ))
