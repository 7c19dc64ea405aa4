"""The one module that touches DeepSpeed: install() / uninstall() and the per-optimizer patch, in real engines;
restore() under a wrapper installed after LoCo's, on a stand-in optimizer."""
import logging

import torch

from deepspeed_loco.runtime.zero.deepspeed_seam import REDUCE_METHOD, OptimizerPatch
from tests.unit.runtime.zero.test_stage3_hook import WORLD, _ds_config, _model


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

    stock_initialize, stock_config_init = deepspeed.initialize, DeepSpeedConfig.__init__
    cfg = _ds_config("loco")
    facts = {"stock_rejects": _rejected(deepspeed.initialize, cfg)}
    deepspeed_loco.install()
    deepspeed_loco.install()  # idempotent
    facts["patched"] = deepspeed.initialize is deepspeed_loco.initialize
    facts["config_accepts"] = _rejected(lambda **kw: DeepSpeedConfig(kw["config"]), cfg) == ""
    model = _model()
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    hook = deepspeed_loco.loco_hook(engine)
    facts["hooked"] = hook is not None and getattr(optimizer, deepspeed_seam.REDUCE_METHOD).__wrapped__ == \
        hook.patch._avg_scatter_grads
    x = torch.randn(8, 13)
    engine.backward(engine(x).sum())
    engine.step()
    facts["loco_step"] = hook.state.step == 1 and hook.reducer.stats.reduces > 0
    hook.detach()
    facts["detached"] = deepspeed_seam.REDUCE_METHOD not in vars(optimizer) and all(
        getattr(optimizer, name).__func__ is getattr(type(optimizer), name)
        for name in ("step", "state_dict", "load_state_dict"))
    deepspeed_loco.uninstall()
    deepspeed_loco.uninstall()  # a no-op the second time
    facts["restored"] = deepspeed.initialize is stock_initialize and DeepSpeedConfig.__init__ is stock_config_init
    facts["stock_rejects_again"] = _rejected(deepspeed.initialize, cfg)
    return facts


def test_install_uninstall_and_detach_restore_stock_deepspeed(process_pool):
    for facts in process_pool(WORLD).run(install_detach_uninstall):
        assert "zeropp_loco_param" in facts["stock_rejects"], facts["stock_rejects"]
        assert facts["patched"] and facts["config_accepts"] and facts["hooked"] and facts["loco_step"]
        assert facts["detached"]
        assert facts["restored"] and "zeropp_loco_param" in facts["stock_rejects_again"]


class DeepSpeedZeroOptimizer_Stage3:  # the class name gives __avg_scatter_grads DeepSpeed's mangled name
    """A stand-in for DeepSpeed's ZeRO-3 optimizer: the methods OptimizerPatch wraps, each recording its call."""

    def __init__(self):
        self.calls, self.loss_scale, self.overflow = [], 1.0, False

    def __avg_scatter_grads(self, params, communication_data_type):
        self.calls.append("stock reduce")
        return params

    def reduce_bucket(self, params):
        """How DeepSpeed calls its reduce: through the instance, by the mangled name."""
        return self.__avg_scatter_grads(params, torch.float32)

    def step(self):
        self.calls.append("stock step")

    def state_dict(self):
        return {}

    def load_state_dict(self, state_dict_list, load_optimizer_states=True, checkpoint_folder=None, load_serial=None):
        self.calls.append("stock load")


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
    optimizer, steps = DeepSpeedZeroOptimizer_Stage3(), []
    patch = _patched(optimizer, steps)
    optimizer.step()
    assert optimizer.calls == ["stock step"] and steps == [1.0] and optimizer.state_dict() == {"loco": "loco entry"}
    patch.restore()
    assert not {REDUCE_METHOD, "step", "state_dict", "load_state_dict"} & set(vars(optimizer))  # the class's again
    optimizer.step()
    assert optimizer.reduce_bucket(["g"]) == ["g"] and optimizer.state_dict() == {} and steps == [1.0]
    patch.restore()  # a second call does nothing
    assert not {REDUCE_METHOD, "step"} & set(vars(optimizer))


def test_restore_under_a_later_wrapper_keeps_that_wrapper_and_passes_calls_through(caplog):
    optimizer, steps, seen = DeepSpeedZeroOptimizer_Stage3(), [], []
    patch = _patched(optimizer, steps)
    lower_step = _wrap(optimizer, "step", seen)
    _wrap(optimizer, REDUCE_METHOD, seen)
    outer_step, outer_reduce = optimizer.step, getattr(optimizer, REDUCE_METHOD)
    optimizer.step()
    assert seen == ["outer step"] and steps == [1.0]  # the stack: outer, then LoCo, then DeepSpeed's step
    with caplog.at_level(logging.INFO, logger="deepspeed_loco"):
        patch.restore()
    assert "wrapped again after LoCo" in caplog.text and "step" in caplog.text
    assert optimizer.step is outer_step and getattr(optimizer, REDUCE_METHOD) is outer_reduce  # the later wrappers
    assert "state_dict" not in vars(optimizer) and optimizer.state_dict() == {}  # not stacked: restored
    seen.clear()
    optimizer.step()
    assert optimizer.reduce_bucket(["g"]) == ["g"]
    assert seen == ["outer step", f"outer {REDUCE_METHOD}"] and steps == [1.0]  # LoCo only passed the calls on
    assert optimizer.calls == ["stock step", "stock step", "stock reduce"]
    optimizer.step = lower_step  # the later tool unwraps: what it finds underneath still reaches DeepSpeed's step
    optimizer.step()
    assert optimizer.calls[-1] == "stock step" and steps == [1.0]
