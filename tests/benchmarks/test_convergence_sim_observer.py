"""benchmarks/convergence_sim.py's experiments (error feedback on some hops only, from a later step, the released
share) as a StepObserver, each checked against a run of the same process: what it zeroes, that it changes LoCo
alone, and that the diagnostics only observe."""
import json

import pytest
import torch

from deepspeed_loco.simulation import SimulationSpec, TrainingSetup, simulate
from tests.unit.simulation.toy import toy_batches, toy_loss, toy_model

STEPS = 30


@pytest.fixture(scope="module")
def sim(benchmark_module):
    return benchmark_module("convergence_sim")


@pytest.fixture(scope="module")
def run(sim):
    """``run(arms, loco=..., **experiments)``: the arms over 30 steps at 2 x 2 ranks, 4 samples per rank."""

    def run(arms, loco=None, **experiments):
        return simulate(_spec(arms, loco), sim.Experiments(4, 2, **experiments))

    return run


def _spec(arms, loco=None, steps=STEPS):
    setup = TrainingSetup(toy_model, lambda: toy_batches(16), nodes=2, local=2, loss_fn=toy_loss,
                          loco={"group_size": 32, **(loco or {})})
    return SimulationSpec(setup, arms, steps)


def _small_model():
    return toy_model(16)


def _tiny(experiments):
    """Arms plain2 and loco2 on the toy MLP with 16 hidden units, 2 x 2 ranks, global batch 8, 8 steps, seed 1, as
    JSON records (``wall_s`` zeroed)."""
    torch.set_num_threads(1)
    setup = TrainingSetup(_small_model, lambda: toy_batches(8), nodes=2, local=2, loco={"group_size": 32},
                          loss_fn=toy_loss, grad_mode="loop")
    results = simulate(SimulationSpec(setup, ["plain2", "loco2"], 8, seed=1), experiments)
    return [json.loads(json.dumps(dict(r.to_dict(), wall_s=0.0))) for r in results]


def test_the_experiments_change_loco_alone_and_the_diagnostics_change_nothing(sim):
    """Zeroing buffers changes LoCo's run, never plain's; the diagnostics leave every figure of both runs as it is."""
    default = _tiny(None)
    for experiments in (dict(kept_hops=("inter_node", )), dict(from_step=4)):
        plain, loco = _tiny(sim.Experiments(4, 2, **experiments))
        assert plain == default[0]
        assert loco["train_losses"] != default[1]["train_losses"]
    diagnosed = sim.Experiments(4, 2, diagnostics=True)
    assert _tiny(diagnosed) == default
    assert list(diagnosed.released) == ["loco2"] and len(diagnosed.released["loco2"]) == 8


def test_kept_hops_keep_their_buffers_from_the_step_on_and_the_others_are_zero_after_every_reduce(sim):
    """``kept_hops=("inter_node",)`` from step 3: after each reduce of the LoCo arm, which hops' buffers hold
    anything, seen by an observer running after the experiment's."""
    held = []

    class Watched(sim.Experiments):

        def after_reduce(self, reduced):
            super().after_reduce(reduced)
            if reduced.arm.kind == "loco":
                nonzero = {}
                for state in reduced.cluster.states:
                    for _, hop, buffer in state.named_buffers():
                        nonzero[hop] = nonzero.get(hop, False) or bool(buffer.dequantize().any())
                held.append(nonzero)

    simulate(_spec(["plain2", "loco2"], steps=6), Watched(4, 2, kept_hops=("inter_node", ), from_step=3))
    plain = {"intra_node": False, "inter_node": False}
    assert held == [plain] * 2 + [{"intra_node": False, "inter_node": True}] * 4


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


def test_diagnostics_record_what_error_feedback_released(sim, run):
    # the symmetric 2-bit grid has a zero level that plain qgZ leaves many coordinates at ("auto" would pick mid-rise)
    symmetric = {"loco": {"quant_grid": "symmetric"}}
    diagnosed = sim.Experiments(4, 2, diagnostics=True)
    plain, loco = simulate(_spec(["plain2", "loco2"], symmetric["loco"]), diagnosed)
    released = diagnosed.released["loco2"]
    assert list(diagnosed.released) == ["loco2"] and len(released) == STEPS
    # released coordinates are nonzero in LoCo's mean: their share is at most the nonzero share, and some exist
    assert all(0 <= r <= n for r, n in zip(released, loco.nonzero_fractions))
    assert max(released) > 0
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
