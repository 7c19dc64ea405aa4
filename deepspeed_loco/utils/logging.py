"""deepspeed-loco's logger, ``deepspeed_loco``: every module of the package logs through :data:`logger`.

A plain standard-library logger, not one from DeepSpeed's ``LoggerFactory`` (which switches propagation off):
records propagate to the root logger, so an application's logging configuration and pytest's ``caplog`` see them
whatever was imported first.

Level INFO unless a level was set before this module was imported (DeepSpeed's own logger shows WARNING and up),
so the one start-up line saying what LoCo does is visible; lower it with
``logging.getLogger("deepspeed_loco").setLevel(logging.WARNING)``.

Printing: one stderr handler of ours (:data:`HANDLER_NAME`, attached once: a re-import or
``importlib.reload`` finds it by name) prints a record only while no handler above this logger would: as long as
the root logger has no handler. Once the application configures logging (``logging.basicConfig``, a framework,
pytest), records reach its handlers by propagation instead, in its format. Either way a record is printed once.
(Python's own ``logging.lastResort`` would not do: it prints WARNING and up only.)
"""
import logging

import torch.distributed as dist

LOGGER_NAME = "deepspeed_loco"
HANDLER_NAME = "deepspeed_loco.stderr"
FORMAT = "[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d] %(message)s"

logger = logging.getLogger(LOGGER_NAME)


def _not_printed_above(record: logging.LogRecord) -> bool:
    """Our handler's filter: true unless the record also propagates to a handler of the root logger."""
    return not (logger.propagate and logging.getLogger().handlers)


def _configure() -> None:
    """Sets :data:`logger` to INFO if it has no level, and adds our stderr handler unless one (found by name) is
    attached already."""
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    if any(handler.get_name() == HANDLER_NAME for handler in logger.handlers):
        return
    handler = logging.StreamHandler()
    handler.set_name(HANDLER_NAME)
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.addFilter(_not_printed_above)
    logger.addHandler(handler)


_configure()


def log_rank0(message: str, level: int = logging.INFO) -> None:
    """Logs ``message`` on global rank 0 only (or always, outside a distributed run), as from the caller's line."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.log(level, message, stacklevel=2)
