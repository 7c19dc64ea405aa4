"""deepspeed-loco: LoCo error-feedback low-bit gradient communication for DeepSpeed ZeRO++ stage 3.

Two ways in:

* ``deepspeed_loco.initialize(...)``: a drop-in for ``deepspeed.initialize`` that accepts
  ``zero_optimization.zeropp_loco_param`` and runs LoCo.
* ``deepspeed_loco.install()``: afterwards plain ``deepspeed.initialize`` (and ``deepspeed.zero.Init``) accept the
  key, so unmodified scripts and frameworks calling DeepSpeed run LoCo. ``python -m deepspeed_loco.run script.py``
  does this for a script without touching it.
"""
import copy
import functools
import inspect
from typing import Optional

__version__ = "0.1.0"

_STOCK = {}


def _stock_initialize():
    import deepspeed
    return _STOCK.get("initialize", deepspeed.initialize)


def initialize(*args, **kwargs):
    """Same signature and return value as ``deepspeed.initialize``; runs LoCo when the config asks for it."""
    from deepspeed_loco.runtime.zero import ds_config, stage3_hook

    stock = _stock_initialize()
    bound = inspect.signature(stock).bind(*args, **kwargs)
    call = bound.arguments
    source = "config" if call.get("config") is not None else "config_params" if call.get(
        "config_params") is not None else None
    cli_args = call.get("args")
    from_args = source is None and getattr(cli_args, "deepspeed_config", None) is not None
    raw = call[source] if source else (cli_args.deepspeed_config if from_args else None)
    loaded = ds_config.load_config(raw)
    loco = None
    if loaded is not None:
        loaded, loco = ds_config.split_loco_config(loaded)
    if loco is not None:
        stage3_hook.check_deepspeed_version()
        if from_args:
            cli_args = copy.copy(cli_args)
            cli_args.deepspeed_config = None
            call["args"] = cli_args
        call.pop("config_params", None)
        call["config"] = loaded
    result = stock(**call)
    if loco is not None:
        stage3_hook.attach(result[0], loco)
    return result


def loco_hook(engine) -> Optional["LocoHook"]:  # noqa: F821
    """The engine's :class:`~deepspeed_loco.runtime.zero.stage3_hook.LocoHook`, or None without LoCo."""
    return getattr(engine, "loco_hook", None)


def install() -> None:
    """Makes stock DeepSpeed accept ``zeropp_loco_param`` and run LoCo (idempotent)."""
    import deepspeed
    from deepspeed.runtime import config as ds_runtime_config

    from deepspeed_loco.runtime.zero import ds_config

    if "initialize" in _STOCK:
        return
    _STOCK["initialize"] = deepspeed.initialize
    deepspeed.initialize = initialize
    stock_init = ds_runtime_config.DeepSpeedConfig.__init__

    @functools.wraps(stock_init)
    def config_init(self, config, *args, **kwargs):
        if isinstance(config, (str, dict)):
            loaded = ds_config.load_config(config)
            stripped, loco = ds_config.split_loco_config(loaded)
            if loco is not None:
                config = stripped
        stock_init(self, config, *args, **kwargs)

    ds_runtime_config.DeepSpeedConfig.__init__ = config_init
