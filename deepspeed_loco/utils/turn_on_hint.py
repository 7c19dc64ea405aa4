"""The pointer to the fix when DeepSpeed rejects ``zeropp_loco_param`` in a process that imported deepspeed_loco but
did not turn LoCo on.

Importing ``deepspeed_loco`` changes nothing in DeepSpeed: LoCo is turned on by ``deepspeed_loco.install()``, by
calling ``deepspeed_loco.initialize``, or by launching through ``python -m deepspeed_loco.run``. Without one of them
DeepSpeed >= 0.19.8 rejects the key with its own error ("LoCo-Zero++ has been removed ... Remove this key ..."),
which sends the user the wrong way. :func:`register` (run once, at ``import deepspeed_loco``) chains a hook onto
``sys.excepthook``: when the process ends on an uncaught exception whose chain holds that rejection, the traceback
is followed by :data:`HINT`, one line on stderr. Nothing else changes: the hook calls the one it found first.
"""
import sys

HINT = ("deepspeed-loco: DeepSpeed rejected zero_optimization.zeropp_loco_param because LoCo is not turned on in this "
        "process (importing deepspeed_loco changes nothing in DeepSpeed): call deepspeed_loco.install() before "
        "deepspeed.initialize, or call deepspeed_loco.initialize instead, or launch with "
        "python -m deepspeed_loco.run train.py")

_previous = None  # the sys.excepthook that register() found


def register() -> None:
    """Chains :func:`excepthook` onto ``sys.excepthook`` (idempotent)."""
    global _previous
    if _previous is None:
        _previous, sys.excepthook = sys.excepthook, excepthook


def excepthook(exc_type, exc, tb) -> None:
    """The hook found first, then :data:`HINT` on stderr if the exception's chain holds DeepSpeed's rejection of the
    key (:func:`rejects_loco_key`)."""
    _previous(exc_type, exc, tb)
    if rejects_loco_key(exc):
        print(HINT, file=sys.stderr, flush=True)


def rejects_loco_key(exc) -> bool:
    """True if ``exc``, or an exception it was raised from or while handling, is DeepSpeed's
    ``DeepSpeedConfigError`` about ``zeropp_loco_param``."""
    config = sys.modules.get("deepspeed.runtime.config")  # not imported: DeepSpeed raised nothing of its config
    error_type = getattr(config, "DeepSpeedConfigError", None)
    if error_type is None:
        return False
    from deepspeed_loco.config import CONFIG_KEY
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, error_type) and CONFIG_KEY in str(exc):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False
