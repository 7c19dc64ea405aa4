"""A paired difference of final losses over seeds, with its 95% interval: :class:`Difference`. Where its interval
lies against 0 (:attr:`Difference.side`) decides every predicate and writes every sentence, so a sentence cannot
say other than the decision."""
import statistics
from dataclasses import dataclass
from typing import Dict, Optional

from deepspeed_loco.utils.stats import t_interval

BELOW, INCLUDES, ABOVE = "lies below 0", "includes 0", "lies above 0"


@dataclass(frozen=True)
class Difference:
    """``name`` (e.g. ``"LoCo - full"``): the mean over ``n`` seeds of the paired differences of final loss, and
    its 95% t-interval ``[low, high]`` (None below two seeds). Negative: the first arm reached the lower loss."""
    name: str
    n: int
    mean: float
    low: Optional[float] = None
    high: Optional[float] = None

    @classmethod
    def paired(cls, name: str, first: Dict[int, float], second: Dict[int, float]) -> "Difference":
        """``first[seed] - second[seed]`` over the seeds of ``first`` (each must be in ``second``)."""
        diffs = [first[seed] - second[seed] for seed in sorted(first)]
        interval = t_interval(diffs)
        if interval is None:
            return cls(name, len(diffs), statistics.fmean(diffs))
        return cls(name, len(diffs), *interval)

    @property
    def side(self) -> Optional[str]:
        """Where the interval lies: ``BELOW``, ``INCLUDES`` or ``ABOVE`` 0; None without an interval."""
        if self.low is None:
            return None
        return BELOW if self.high < 0 else ABOVE if self.low > 0 else INCLUDES

    @property
    def better(self) -> bool:
        """The interval lies below 0: the first arm measurably reached the lower loss."""
        return self.side == BELOW

    @property
    def worse(self) -> bool:
        """The interval lies above 0: the first arm measurably lost loss."""
        return self.side == ABOVE

    @property
    def not_worse(self) -> bool:
        """The interval includes 0 or lies below it: no measured loss for the first arm."""
        return self.side in (BELOW, INCLUDES)

    def value(self) -> str:
        """``-0.0268 [-0.0368, -0.0167]``, or ``+0.0010 (1 seed)``."""
        return f"{self.mean:+.4f}" + (f" [{self.low:+.4f}, {self.high:+.4f}]" if self.low is not None
                                      else f" ({self.n} seed{'s' if self.n != 1 else ''})")

    def said(self) -> str:
        """The difference in words from :attr:`side`: ``LoCo - full -0.0268 [-0.0368, -0.0167] lies below 0``."""
        return f"{self.name} {self.value()} " + (self.side or "has no interval")
