"""One simulated arm's run as :func:`~deepspeed_loco.simulation.simulate` returns it: :class:`ArmResult`."""
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Tuple


@dataclass
class ArmResult:
    """One arm's run; every per-step list has one entry per optimizer step.

    ``train_losses``: means over the ``W`` micro-batches. ``validation``: ``(step, loss)`` from ``eval_fn``.
    ``grad_rel_errors[t]``: ``||g_comm - g_exact|| / ||g_exact||`` at step ``t + 1``; ``sum_rel_errors[t]``: the
    same for the running sums of both up to step ``t + 1`` (where error feedback shows). ``nonzero_fractions``:
    share of coordinates whose communicated mean is nonzero. ``update_rms``: root mean square of the parameter
    change divided by the step's learning rate (first param group): how far the optimizer moved the replica
    (AdamW moves a coordinate with a steady gradient by about one learning rate, one that gets zeros by less).
    ``bytes_per_step``: what one rank sends per step on all hops; ``full`` sends a fp32 reduce-scatter, so its ``bytes_per_step`` is ``full_precision_bytes_per_step``,
    ``(W - 1) / W * N * 4`` (a ratio of 1.0). ``loco``: the ``zeropp_loco_param`` block the arm ran with (None for
    ``full``). ``rank_grad_sq[t]`` / ``mean_grad_sq[t]``: the mean over ranks of ``||g_rank||^2`` and
    ``||g_exact||^2`` (the exact fp32 gradients, before any quantization), from which :func:`gradient_noise_scale`
    estimates the gradient noise scale; ``rank_batch``: the leading size of one rank's micro-batch; ``world_size``:
    ``W``. The live rho of a qgZ arm (:mod:`deepspeed_loco.runtime.comm.noise_stats`, on the steps its
    ``rho_every`` measures): ``live_rho_steps`` the steps, and per such step ``live_hop_error_sq`` (error power of the
    mean per hop), ``live_noise_sq`` (``tr(Sigma) / (W b)``) and ``live_grad_sq`` (``||G||^2``), estimated from the
    ranks' sums and shared sample of coordinates alone, as a real run does.
    """
    key: str
    label: str
    seed: int
    loco: Optional[Dict[str, Any]] = None
    train_losses: List[float] = field(default_factory=list)
    validation: List[Tuple[int, float]] = field(default_factory=list)
    grad_rel_errors: List[float] = field(default_factory=list)
    sum_rel_errors: List[float] = field(default_factory=list)
    nonzero_fractions: List[float] = field(default_factory=list)
    update_rms: List[float] = field(default_factory=list)
    rank_grad_sq: List[float] = field(default_factory=list)
    mean_grad_sq: List[float] = field(default_factory=list)
    live_rho_steps: List[int] = field(default_factory=list)
    live_hop_error_sq: List[List[float]] = field(default_factory=list)
    live_noise_sq: List[float] = field(default_factory=list)
    live_grad_sq: List[float] = field(default_factory=list)
    rank_batch: int = 0
    world_size: int = 0
    bytes_per_step: float = 0.0
    full_precision_bytes_per_step: float = 0.0
    wall_s: float = 0.0

    @property
    def final_val_loss(self) -> Optional[float]:
        return self.validation[-1][1] if self.validation else None

    def to_dict(self) -> Dict[str, Any]:
        """Every field plus ``final_val_loss``; JSON-serialisable."""
        return dict(asdict(self), final_val_loss=self.final_val_loss)
