"""A hook into every simulated step: :class:`StepObserver` sees each step's reduce and may act on the cluster
before the optimizer steps (experiments that are not the library's behaviour live in the observer, not in
:func:`~deepspeed_loco.simulation.simulate`)."""
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import torch

from deepspeed_loco.simulation.arm_result import ArmResult
from deepspeed_loco.simulation.arms import Arm
from deepspeed_loco.simulation.cluster import SimulatedCluster


@dataclass(frozen=True)
class ReducedStep:
    """Optimizer step ``step`` (1-based) of ``arm`` right after its reduce, before clipping and the optimizer.

    ``result``: the arm's run so far (this step not yet recorded). ``cluster``: the cluster that reduced (its
    ``states`` hold every virtual rank's error buffers); None for ``full``. ``exact`` / ``communicated``: the exact
    fp32 mean and the mean the arm communicated, one tensor per trained parameter (``communicated is exact`` for
    ``full``). ``shadows[k]``: the mean of the same rank gradients through the observer's ``k``-th shadow block."""
    step: int
    arm: Arm
    result: ArmResult
    cluster: Optional[SimulatedCluster]
    exact: List[torch.Tensor]
    communicated: List[torch.Tensor]
    shadows: List[List[torch.Tensor]]


class StepObserver:
    """Called by :func:`~deepspeed_loco.simulation.simulate` at every step of every arm; this base does nothing.

    :meth:`shadow_blocks` (once per arm): ``zeropp_loco_param`` blocks of extra clusters that reduce the same rank
    gradients as the arm, in the same stream (so no extra gradients are kept alive); their means reach
    :meth:`after_reduce` in ``ReducedStep.shadows`` and never reach training. :meth:`after_reduce` (every step):
    may read the step, and may act on ``cluster`` (e.g. zero some hops' error buffers).
    """

    def shadow_blocks(self, arm: Arm, block: Optional[Dict[str, Any]]) -> Sequence[Dict[str, Any]]:
        """The blocks of shadow clusters for ``arm`` (``block``: its own, None for ``full``); none by default."""
        return ()

    def after_reduce(self, reduced: ReducedStep) -> None:
        """Sees one step's reduce; does nothing by default."""
