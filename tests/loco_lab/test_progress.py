"""The demo's progress bar: while it is open, the deepspeed_loco logger prints through tqdm.write (a line never
lands inside the bar), in its own format; closing it gives the logger its handlers back."""
import re

from deepspeed_loco.simulation import SimulationSpec, TrainingSetup, simulate
from deepspeed_loco.utils.logging import HANDLER_NAME, logger
from loco_lab.arms import RunSpec
from loco_lab.model import SIZES
from loco_lab.progress_bar import ProgressBar
from loco_lab.run import _Progress
from tests.extras import needs_extra
from tests.unit.simulation.toy import toy_batches, toy_loss, toy_model

tqdm = needs_extra("tqdm", "demo")  # the bar (a DeepSpeed requirement too)


def test_log_lines_go_through_the_bar(monkeypatch):
    written = []
    monkeypatch.setattr(tqdm.tqdm, "write", classmethod(lambda cls, text, file=None, **kw: written.append(text)))
    monkeypatch.setattr(logger, "propagate", False)  # as in the demo, where the root logger has no handler
    before = list(logger.handlers)
    bar = _Progress(RunSpec(model=SIZES["tiny"], arms=()), runs=1)
    try:
        assert HANDLER_NAME not in [h.get_name() for h in logger.handlers]
        logger.info("deepspeed_loco: a line while the bar is open")
    finally:
        bar.close()
    assert logger.handlers == before
    assert len(written) == 1
    assert re.fullmatch(r"\[.*\] \[INFO\] \[test_progress.py:\d+\] deepspeed_loco: a line while the bar is open",
                        written[0])
    quiet = _Progress(RunSpec(model=SIZES["tiny"], arms=()), runs=1, enabled=False)
    assert logger.handlers == before
    quiet.close()
    assert logger.handlers == before


def test_progress_bar_counts_the_steps_and_gives_the_logger_back():
    handlers = list(logger.handlers)
    bar = ProgressBar(24)
    setup = TrainingSetup(toy_model, lambda: toy_batches(16), loss_fn=toy_loss)
    simulate(SimulationSpec(setup, ["full", "plain4"], 12), on_step=bar)
    assert bar.bar.n == 24 and bar.bar.desc.startswith("seed 0: qgZ 4-bit")
    bar.close()
    assert logger.handlers == handlers
