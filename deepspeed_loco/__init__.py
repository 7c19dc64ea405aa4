"""deepspeed-loco: LoCo error-feedback low-bit gradient communication for DeepSpeed ZeRO++ stage 3.

Two ways in:

* ``deepspeed_loco.initialize(...)``: a drop-in for ``deepspeed.initialize`` that accepts
  ``zero_optimization.zeropp_loco_param`` and runs LoCo.
* ``deepspeed_loco.install()``: afterwards plain ``deepspeed.initialize`` (and ``deepspeed.zero.Init``) accept the
  key, so unmodified scripts and frameworks calling DeepSpeed run LoCo, whatever they imported before the call
  (the engine constructor attaches it). ``python -m deepspeed_loco.run script.py`` does this for a script without
  touching it.

Importing the package alone changes nothing in DeepSpeed (a plain ``deepspeed.initialize`` still rejects the key);
it only adds a line after the traceback of a process that ends on that rejection, saying how to turn LoCo on
(:mod:`deepspeed_loco.utils.turn_on_hint`).
"""
import copy
import inspect
from typing import Optional

from deepspeed_loco.utils import turn_on_hint

__all__ = ["__version__", "initialize", "install", "uninstall", "loco_hook", "add_reduce_observer"]
__version__ = "0.1.0"
turn_on_hint.register()


def initialize(*args, **kwargs):
    """Same signature and return value as ``deepspeed.initialize``; runs LoCo when the config asks for it. Also
    registers an ``atexit`` hook that releases the process groups at a normal exit
    (:mod:`deepspeed_loco.utils.clean_exit`)."""
    import torch

    from deepspeed_loco.runtime.zero import deepspeed_seam
    from deepspeed_loco.runtime.zero import ds_config, stage3_hook
    from deepspeed_loco.utils import clean_exit

    stock = deepspeed_seam.stock_initialize()
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
        deepspeed_seam.check_deepspeed_version()
        if from_args:
            cli_args = copy.copy(cli_args)
            cli_args.deepspeed_config = None
            call["args"] = cli_args
        call.pop("config_params", None)
        call["config"] = loaded
    # zero_hpz_partition_size against the layout, before DeepSpeed builds its hpZ groups where the process group is
    # up already (launchers, zero.Init), else as soon as DeepSpeed has initialized it
    early = loco is not None and torch.distributed.is_initialized()
    if early:
        stage3_hook.check_hpz_partition(loaded, loco)
    result = stock(**call)
    clean_exit.register()  # the process groups released before finalization (docs/frameworks.md, "Clean exits")
    if loco is not None:
        if not early:
            stage3_hook.check_hpz_partition(loaded, loco)
        stage3_hook.attach(result[0], loco)
    return result


def loco_hook(engine) -> Optional["LocoHook"]:  # noqa: F821
    """The engine's :class:`~deepspeed_loco.runtime.zero.stage3_hook.LocoHook`, or None without LoCo."""
    return getattr(engine, "loco_hook", None)


def add_reduce_observer(engine, observer):
    """Calls ``observer(names, grads, partitions)`` after every bucket reduce of ``engine``'s ZeRO-3 optimizer, LoCo
    or not; returns a handle with ``.remove()``
    (:func:`~deepspeed_loco.runtime.zero.stage3_hook.add_reduce_observer`)."""
    from deepspeed_loco.runtime.zero import stage3_hook
    return stage3_hook.add_reduce_observer(engine, observer)


def install() -> None:
    """Makes stock DeepSpeed accept ``zeropp_loco_param`` and run LoCo (idempotent): ``deepspeed.initialize``
    becomes :func:`initialize`, ``DeepSpeedConfig`` (hence ``deepspeed.zero.Init``) accepts the key, and every
    engine built afterwards from a config with the key runs LoCo, also one built by a ``deepspeed.initialize`` that
    the script imported before this call (``from deepspeed import initialize``)."""
    from deepspeed_loco.runtime.zero import deepspeed_seam, ds_config, stage3_hook
    deepspeed_seam.install(initialize, ds_config.split_given_config, stage3_hook.before_engine_build,
                           stage3_hook.after_engine_build)


def uninstall() -> None:
    """Undoes :func:`install`: stock ``deepspeed.initialize``, ``DeepSpeedConfig`` and engine constructor again
    (engines already built keep LoCo; ``loco_hook(engine).detach()`` gives one back its stock reduce)."""
    from deepspeed_loco.runtime.zero import deepspeed_seam
    deepspeed_seam.uninstall()

