"""The one module that touches DeepSpeed: install() / uninstall() and the per-optimizer patch, in real engines."""
import torch

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
    facts["hooked"] = hook is not None and getattr(optimizer, deepspeed_seam.REDUCE_METHOD) == \
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
