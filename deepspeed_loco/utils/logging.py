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

A line that concerns every rank is printed once: :func:`log_rank0` for one that rank 0 can say alone,
:func:`log_rank0_for_ranks` for one each rank may say differently (rank 0 names the ranks of each).
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


def describe_ranks(ranks) -> str:
    """``rank 2``, ``ranks 0-3``, ``ranks 0, 2, 5-7``: sorted ``ranks`` with runs of consecutive ranks joined."""
    ordered = sorted(set(ranks))
    runs = []
    for rank in ordered:
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    text = ", ".join(f"{first}-{last}" if last > first + 1 else ", ".join(map(str, range(first, last + 1)))
                     for first, last in runs)
    return f"rank {text}" if len(ordered) == 1 else f"ranks {text}"


def log_rank0_for_ranks(message, level: int = logging.WARNING, group=None) -> None:
    """A collective over ``group`` (None: every rank): each rank passes its ``message`` (None: nothing to say), and
    the group's first rank logs each distinct message once, naming the (global) ranks that passed it:
    ``deepspeed-loco: ranks 0-3: <message>``. Outside a distributed run, ``message`` as from rank 0."""
    if not dist.is_initialized():
        said = {message: [0]} if message is not None else {}
    else:
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, message, group=group)
        said = {}
        for rank, text in zip(dist.get_process_group_ranks(group or dist.group.WORLD), everyone):
            if text is not None:
                said.setdefault(text, []).append(rank)
        if dist.get_rank(group) != 0:
            return
    for text, ranks in said.items():
        logger.log(level, f"deepspeed-loco: {describe_ranks(ranks)}: {text}", stacklevel=2)
