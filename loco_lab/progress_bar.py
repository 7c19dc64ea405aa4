"""The demo's tqdm progress bar over simulated steps, with the ``deepspeed_loco`` logger's lines printed above it while
it is open (its console handler swapped for one that writes through the bar, given back on close). Needs tqdm (the
``demo`` extra)."""
import logging
import sys

from deepspeed_loco.simulation.arm_result import ArmResult
from deepspeed_loco.utils.logging import HANDLER_NAME, logger


class _BarLog(logging.Handler):
    """Stands in for the ``deepspeed_loco`` logger's console handler while a bar is open: the same format, filters
    and stream, written through ``tqdm.write`` so that a line never lands inside the bar."""

    def __init__(self, bar, console: logging.StreamHandler):
        super().__init__(console.level)
        self.bar, self.stream = bar, console.stream
        self.setFormatter(console.formatter)
        for log_filter in console.filters:
            self.addFilter(log_filter)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.bar.write(self.format(record), file=self.stream)
        except Exception:
            self.handleError(record)


class ProgressBar:
    """A tqdm bar over ``total`` steps (all arms and seeds) on stdout; while it is open the ``deepspeed_loco``
    logger prints through it. Pass the instance as ``simulate(..., on_step=bar)`` (it takes ``(result, step,
    loss)``), or call :meth:`step`; :meth:`write` prints a line above the bar; :meth:`close` when done.
    ``enabled=False``: no bar, lines are printed."""

    def __init__(self, total: int, enabled: bool = True, desc: str = "starting"):
        self.bar = None
        self.handlers = list(logger.handlers)
        if enabled:
            from tqdm import tqdm
            self.bar = tqdm(total=total, unit="step", dynamic_ncols=True, desc=desc, file=sys.stdout)
            logger.handlers = [_BarLog(self.bar, h) if h.get_name() == HANDLER_NAME else h for h in self.handlers]

    def __call__(self, result: ArmResult, step: int, loss: float) -> None:
        self.step(f"seed {result.seed}: {result.label}", loss)

    def step(self, desc: str, loss: float) -> None:
        """One step done, of the run described by ``desc``, at training loss ``loss``."""
        if self.bar is not None:
            self.bar.set_description(desc, refresh=False)
            self.bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
            self.bar.update(1)

    def write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=sys.stdout)
        else:
            print(text, flush=True)

    def close(self) -> None:
        """Closes the bar and gives the logger its handlers back."""
        if self.bar is not None:
            self.bar.close()
        logger.handlers = self.handlers
