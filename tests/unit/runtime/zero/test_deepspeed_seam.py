"""The one module that touches DeepSpeed: install() / uninstall() and the per-optimizer patch, in real engines;
restore() under a wrapper installed after LoCo's, on a stand-in optimizer."""
import dataclasses
import logging

import pytest
import torch

from deepspeed_loco.config import LocoConfigError
from deepspeed_loco.runtime.zero import deepspeed_seam
from deepspeed_loco.runtime.zero.deepspeed_seam import PRIVATE_NAMES, OptimizerPatch, PrivateNames, private_names
from tests.unit.runtime.zero.test_stage3_hook import WORLD, _ds_config, _model

NAMES = private_names()  # the installed DeepSpeed's row of the seam's table


def _rejected(initialize, cfg) -> str:
    """The error ``initialize`` raises for ``cfg``, or "" if it builds an engine."""
    model = _model()
    try:
        initialize(model=model, model_parameters=model.parameters(), config=cfg)
    except Exception as err:  # DeepSpeed's own config error, whatever its class
        return f"{type(err).__name__}: {err}"
    return ""


def install_detach_uninstall():
    """Facts about each stage, collected (no assert inside a rank)."""
    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfig

    import deepspeed_loco
    from deepspeed_loco.runtime.zero import deepspeed_seam

    from deepspeed.runtime.engine import DeepSpeedEngine

    stock = deepspeed.initialize, DeepSpeedConfig.__init__, DeepSpeedEngine.__init__
    cfg = _ds_config("loco")
    facts = {"stock_rejects": _rejected(deepspeed.initialize, cfg)}
    deepspeed_loco.install()
    deepspeed_loco.install()  # idempotent
    facts["patched"] = deepspeed.initialize is deepspeed_loco.initialize
    facts["config_accepts"] = _rejected(lambda **kw: DeepSpeedConfig(kw["config"]), cfg) == ""
    model = _model()
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    hook = deepspeed_loco.loco_hook(engine)
    facts["hooked"] = hook is not None and getattr(optimizer, deepspeed_seam.private_names().reduce).__wrapped__ == \
        hook.patch._avg_scatter_grads
    x = torch.randn(8, 13)
    engine.backward(engine(x).sum())
    engine.step()
    facts["loco_step"] = hook.state.step == 1 and hook.reducer.stats.reduces > 0
    hook.detach()
    facts["detached"] = deepspeed_seam.private_names().reduce not in vars(optimizer) and all(
        getattr(optimizer, name).__func__ is getattr(type(optimizer), name)
        for name in ("step", "state_dict", "load_state_dict"))
    deepspeed_loco.uninstall()
    deepspeed_loco.uninstall()  # a no-op the second time
    facts["restored"] = (deepspeed.initialize, DeepSpeedConfig.__init__, DeepSpeedEngine.__init__) == stock
    facts["stock_rejects_again"] = _rejected(deepspeed.initialize, cfg)
    return facts


def test_install_uninstall_and_detach_restore_stock_deepspeed(process_pool):
    for facts in process_pool(WORLD).run(install_detach_uninstall):
        assert "zeropp_loco_param" in facts["stock_rejects"], facts["stock_rejects"]
        assert facts["patched"] and facts["config_accepts"] and facts["hooked"] and facts["loco_step"]
        assert facts["detached"]
        assert facts["restored"] and "zeropp_loco_param" in facts["stock_rejects_again"]


def _trained_output(initialize, steps: int = 2) -> torch.Tensor:
    """The model's output on a fixed input after ``steps`` LoCo steps of an engine built by ``initialize``; raises
    unless LoCo is attached to it and reduced every bucket."""
    import deepspeed_loco

    model = _model()
    engine, _, _, _ = initialize(model=model, model_parameters=model.parameters(), config=_ds_config("loco"))
    hook = deepspeed_loco.loco_hook(engine)
    if hook is None or "zeropp_loco_param" in engine.config["zero_optimization"]:
        raise AssertionError(f"LoCo not attached ({hook}) or the engine kept the block")
    torch.manual_seed(1 + torch.distributed.get_rank())
    for _ in range(steps):
        engine.backward(engine(torch.randn(8, 13)).sum())
        engine.step()
    if hook.state.step != steps or hook.reducer.stats.reduces == 0:
        raise AssertionError(f"LoCo took {hook.state.step} steps, {hook.reducer.stats.reduces} reduces")
    with torch.no_grad():
        return engine(torch.ones(2, 13))


def initialize_imported_before_install():
    """``from deepspeed import initialize`` first, then ``install()``: the early name is stock DeepSpeed's, and the
    engine it builds trains exactly as ``deepspeed_loco.initialize``'s."""
    from deepspeed import initialize

    import deepspeed_loco

    deepspeed_loco.install()
    try:
        early = _trained_output(initialize)
        ours = _trained_output(deepspeed_loco.initialize)
    finally:
        deepspeed_loco.uninstall()
    return {"stock_name": initialize is not deepspeed_loco.initialize, "same": torch.equal(early, ours)}


def test_initialize_imported_before_install_trains_with_loco(process_pool):
    for facts in process_pool(WORLD).run(initialize_imported_before_install):
        assert facts == {"stock_name": True, "same": True}


class StandInStage3:
    """A stand-in for DeepSpeed's ZeRO-3 optimizer: the methods OptimizerPatch wraps, each recording its call; its
    bucket reduce stands under the private name of the seam's table (set below the class)."""

    def __init__(self):
        self.calls, self.loss_scale, self.overflow = [], 1.0, False

    def _stock_reduce(self, params, communication_data_type):
        self.calls.append("stock reduce")
        return params

    def reduce_bucket(self, params):
        """How DeepSpeed calls its reduce: through the instance, by its private name."""
        return getattr(self, NAMES.reduce)(params, torch.float32)

    def step(self):
        self.calls.append("stock step")

    def state_dict(self):
        return {}

    def load_state_dict(self, state_dict_list, load_optimizer_states=True, checkpoint_folder=None, load_serial=None):
        self.calls.append("stock load")


setattr(StandInStage3, NAMES.reduce, StandInStage3._stock_reduce)


def _patched(optimizer, steps):
    """An OptimizerPatch whose after-step hook counts into ``steps``; its reduce must not be reached."""
    def reduce(params, grads):
        raise AssertionError("LoCo's reduce was called")

    return OptimizerPatch(optimizer, reduce=reduce, after_step=lambda overflow, ratio: steps.append(ratio),
                          save=lambda: "loco entry", decide=None, apply=None, state_key="loco", missing=None)


def _wrap(optimizer, name, seen):
    """Wraps ``optimizer.<name>`` the way a later tool would (a profiler, a debugger); returns what it replaced."""
    inner = getattr(optimizer, name)

    def outer(*args, **kwargs):
        seen.append(f"outer {name}")
        return inner(*args, **kwargs)

    setattr(optimizer, name, outer)
    return inner


def test_restore_gives_back_exactly_what_was_there():
    optimizer, steps = StandInStage3(), []
    patch = _patched(optimizer, steps)
    optimizer.step()
    assert optimizer.calls == ["stock step"] and steps == [1.0] and optimizer.state_dict() == {"loco": "loco entry"}
    patch.restore()
    assert not {NAMES.reduce, "step", "state_dict", "load_state_dict"} & set(vars(optimizer))  # the class's again
    optimizer.step()
    assert optimizer.reduce_bucket(["g"]) == ["g"] and optimizer.state_dict() == {} and steps == [1.0]
    patch.restore()  # a second call does nothing
    assert not {NAMES.reduce, "step"} & set(vars(optimizer))


def test_restore_under_a_later_wrapper_keeps_that_wrapper_and_passes_calls_through(caplog):
    optimizer, steps, seen = StandInStage3(), [], []
    patch = _patched(optimizer, steps)
    lower_step = _wrap(optimizer, "step", seen)
    _wrap(optimizer, NAMES.reduce, seen)
    outer_step, outer_reduce = optimizer.step, getattr(optimizer, NAMES.reduce)
    optimizer.step()
    assert seen == ["outer step"] and steps == [1.0]  # the stack: outer, then LoCo, then DeepSpeed's step
    with caplog.at_level(logging.INFO, logger="deepspeed_loco"):
        patch.restore()
    assert "wrapped again after LoCo" in caplog.text and "step" in caplog.text
    assert optimizer.step is outer_step and getattr(optimizer, NAMES.reduce) is outer_reduce  # the later wrappers
    assert "state_dict" not in vars(optimizer) and optimizer.state_dict() == {}  # not stacked: restored
    seen.clear()
    optimizer.step()
    assert optimizer.reduce_bucket(["g"]) == ["g"]
    assert seen == ["outer step", f"outer {NAMES.reduce}"] and steps == [1.0]  # LoCo only passed the calls on
    assert optimizer.calls == ["stock step", "stock step", "stock reduce"]
    optimizer.step = lower_step  # the later tool unwraps: what it finds underneath still reaches DeepSpeed's step
    optimizer.step()
    assert optimizer.calls[-1] == "stock step" and steps == [1.0]


def test_the_installed_deepspeed_has_every_private_name_of_its_row():
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    assert private_names().missing_from(DeepSpeedZeroOptimizer_Stage3) == []
    assert dataclasses.replace(NAMES, reduce="_gone").missing_from(DeepSpeedZeroOptimizer_Stage3) == [
        "_gone"]


def test_a_release_takes_the_row_of_the_newest_tested_release_not_newer_than_it(monkeypatch):
    later = PrivateNames("_renamed_reduce", "_same", "_group", "_averaging")
    monkeypatch.setitem(PRIVATE_NAMES, "0.21.0", later)
    oldest = deepspeed_seam.MIN_DEEPSPEED
    assert deepspeed_seam.names_for("0.20.9") == PRIVATE_NAMES[oldest] == deepspeed_seam.names_for(oldest)
    assert deepspeed_seam.names_for("0.21.0") is later and deepspeed_seam.names_for("0.22.1") is later
    with pytest.raises(RuntimeError, match=f"needs DeepSpeed >= {deepspeed_seam.MIN_DEEPSPEED}, found 0.19.7"):
        deepspeed_seam.names_for("0.19.7")


def test_start_up_names_the_private_methods_a_release_lacks_and_warns_for_an_untested_one(monkeypatch, caplog):
    import deepspeed
    monkeypatch.setitem(PRIVATE_NAMES, "0.21.0", dataclasses.replace(NAMES, reduce="_renamed_reduce"))
    monkeypatch.setattr(deepspeed, "__version__", "0.21.2")
    with pytest.raises(RuntimeError, match="cannot hook DeepSpeed 0.21.2: its ZeRO-3 optimizer has no _renamed_reduce"):
        deepspeed_seam.check_deepspeed_version()
    monkeypatch.setattr(deepspeed, "__version__", "0.20.1")  # the 0.19.8 row, whose names it has
    with caplog.at_level(logging.WARNING, logger="deepspeed_loco"):
        deepspeed_seam.check_deepspeed_version()
    assert "DeepSpeed 0.20.1 is untested" in caplog.text


def deepspeeds_own_refusal(top_level):
    """The error DeepSpeed's own ``deepspeed.initialize`` raises for a qgZ config with the DeepSpeed config keys
    ``top_level``, or "" if it builds an engine (then: the scaling the seam reads off its optimizer)."""
    import deepspeed
    cfg = _ds_config("plain")
    del cfg["zero_optimization"]["zeropp_loco_param"]
    cfg.update(top_level)
    model = _model()
    try:
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    except AssertionError as err:
        return str(err)
    return deepspeed_seam.reduce_scaling_not_applied(engine.optimizer)


@pytest.mark.parametrize("top_level,expected", [
    ({}, {}),
    ({"gradient_predivide_factor": 2.0}, "gradient_predivide_factor != 1.0 is not yet supported"),
    ({"prescale_gradients": True}, "pre-scale gradients is not yet supported"),
])
def test_deepspeed_itself_refuses_the_scaling_loco_skips_under_qgz(process_pool, top_level, expected):
    """The premise of skipping the scaling: with qgZ, DeepSpeed runs reduce-scatter and asserts both defaults. A
    release that stops asserting them fails here, and LoCo's own check at attach (below) is then the guard."""
    results = process_pool(WORLD).run(deepspeeds_own_refusal, top_level)
    if isinstance(expected, str):  # refused by DeepSpeed's own assertion
        assert all(isinstance(result, str) and expected in result for result in results), results
    else:  # built: the seam reads the defaults off the real optimizer
        assert results == [expected] * WORLD


class _Scaled:
    """An optimizer as far as the seam reads its gradient scaling."""

    def __init__(self, gradient_predivide_factor=1.0, postscale_gradients=True):
        self.gradient_predivide_factor, self.postscale_gradients = gradient_predivide_factor, postscale_gradients


@pytest.mark.parametrize("optimizer,expected", [
    (_Scaled(), None),
    (_Scaled(gradient_predivide_factor=2.0), "zero_optimization.zeropp_loco_param does not apply DeepSpeed's "
     "gradient_predivide_factor (this run has gradient_predivide_factor = 2.0; LoCo's reduce would leave it out): "
     "set \"gradient_predivide_factor\": 1.0 (the default), or remove zeropp_loco_param"),
    (_Scaled(4.0, postscale_gradients=False), "does not apply DeepSpeed's gradient_predivide_factor or "
     "prescale_gradients (this run has gradient_predivide_factor = 4.0, prescale_gradients = True; LoCo's reduce "
     "would leave it out): set \"gradient_predivide_factor\": 1.0, \"prescale_gradients\": false (the default)"),
])
def test_a_gradient_scaling_the_loco_reduce_would_skip_is_refused_at_attach(optimizer, expected):
    from deepspeed_loco.runtime.zero.stage3_hook import check_reduce_scaling
    if expected is None:
        check_reduce_scaling(optimizer)
    else:
        with pytest.raises(LocoConfigError) as err:
            check_reduce_scaling(optimizer)
        assert expected in str(err.value)
