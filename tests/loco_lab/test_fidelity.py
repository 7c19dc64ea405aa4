"""The demo's gradient-fidelity probe, a reduce observer: 4 gloo processes, 2 nodes x 2 ranks, 3 optimizer steps
of the full-precision, plain 4-bit and LoCo 4-bit arms."""
import pytest
import torch

from tests.unit.runtime.zero.test_stage3_hook import WORLD, _batch, _ds_config, _model

STEPS = 3


def measure(arm):
    import deepspeed_loco
    from loco_lab.fidelity import GradientFidelity
    model = _model()
    engine, _, _, _ = deepspeed_loco.initialize(model=model, model_parameters=model.parameters(),
                                                config=_ds_config(arm, loco={"inter_node_bits": 4}))
    probe = GradientFidelity.attach(engine)
    rank = torch.distributed.get_rank()
    for step in range(STEPS):
        x, y = _batch(rank, step, "fp32")
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
        probe.after_step()
    hook = deepspeed_loco.loco_hook(engine)
    return {**probe.summary(), "reduces": hook.reducer.stats.reduces if hook else None}


@pytest.fixture(scope="module")
def arms(process_pool):
    return {arm: process_pool(WORLD).run(measure, arm) for arm in ("full", "plain", "loco")}


def test_every_arm_is_measured_every_step_the_same_on_every_rank(arms):
    for arm, ranks in arms.items():
        assert all(len(r["grad_rel_errors"]) == len(r["sum_rel_errors"]) == STEPS for r in ranks), arm
        assert all(r["grad_rel_errors"] == ranks[0]["grad_rel_errors"] for r in ranks), arm  # all-reduced figures
    for arm in ("plain", "loco"):
        assert all(r["reduce_calls"] == r["reduces"] for r in arms[arm])  # one measurement per LoCo reduce


def test_full_precision_is_exact_and_loco_keeps_the_running_sum_closer_than_plain_qgz(arms):
    full, plain, loco = (arms[arm][0] for arm in ("full", "plain", "loco"))
    assert full["grad_rel_error_mean"] < 1e-5 < plain["grad_rel_error_mean"]
    assert loco["sum_rel_error_final"] < plain["sum_rel_error_final"]
