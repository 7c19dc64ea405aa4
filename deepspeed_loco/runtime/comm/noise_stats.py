"""rho measured live: the quantization error power of the communicated mean over the gradient's own sampling-noise
power, from a few scalars each rank's reduce already has (``docs/config.md``, "rho measured live").

Per measured optimizer step every rank's reduces add, on the device (:class:`ReduceSums`, filled by the ops'
``stats`` outputs, :mod:`deepspeed_loco.ops.loco_reference`):

* ``S_r = ||g_r||^2``, its own gradient before quantization (hop 1's input);
* ``Q_r^h = ||c - deq(quant(c))||^2``, the error its quantizer made at hop ``h`` (``c`` the compensated values;
  the input itself for plain qgZ);
* ``O_r = ||out_r||^2``, its partitions of the communicated mean (their sum over ranks is ``||mean||^2``).

One all-reduce (sum) of these ``2H + 1`` floats per measured step gives (:meth:`NoiseSample.from_totals`), per
micro-step, with ``W`` ranks and ``b`` samples per rank and micro-step:

* error power of the mean from hop ``h``: ``E_h = sum_r Q_r^h / W^2``. Every hop's error enters the mean with the
  factor ``1/W``: the final sum adds hop 1's dequantized rows of all ranks (and hop 2's re-quantized node sums, which
  carry hop 1's errors and add hop 2's) and divides by ``W`` once (``loco_reference.final_mean``); errors of
  different ranks and hops are independent, so they add in power;
* sampling-noise power of the exact mean, ``N = tr(Sigma) / (W b)``: with ``s = mean_r S_r`` and ``m = ||exact
  mean||^2 = ||mean||^2 - sum_h E_h``, ``E[s] = ||G||^2 + tr(Sigma) / b`` and ``E[m] = ||G||^2 + tr(Sigma) / (W b)``
  (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training", appendix A), so ``N = (s - m) / (W - 1)``,
  which is exactly ``sum_r ||g_r - mean||^2 / (W (W - 1))`` when ``m`` is the exact mean's norm;
* ``||G||^2 = m - N`` and the noise scale ``B_noise = tr(Sigma) / ||G||^2 = W b N / ||G||^2`` in samples (sequences);
* ``rho_h = E_h / N`` and ``rho = sum_h E_h / N``.

Gradient accumulation: each micro-step's reduce carries one micro-batch of ``b`` samples per rank, and the sums run
over the ``A`` micro-steps of the optimizer step, then are divided by ``A``. The accumulated gradient's error and
noise are sums of ``A`` independent micro-step terms, so both powers grow ``A``-fold and rho per micro-step is rho of
the accumulated step. Absolute powers are in the units of the reduced gradient (an fp16 loss scale and DeepSpeed's
``1 / A`` included); rho and ``B_noise`` are ratios and free of them.

Single steps are noisy (``N`` is a difference): :class:`RhoEstimator` averages numerator and denominator over a
window of measured steps before dividing (as McCandlish et al. do) and gives the ratio estimator's standard error.
:class:`LiveRho` runs it in a real run: arms the reducer on every ``rho_every``-th step, makes the one all-reduce,
logs a line every ``rho_log_every`` steps.

With error feedback, ``Q`` is the quantizer's error on the compensated values, what plain qgZ's error would be at the
same state; the communicated mean's own error also carries the remembered error (about ``(1 - beta) / (1 + beta)``
more power in a steady state). rho answers "is the quantizer's error large against the sampling noise", so it tells a
plain-qgZ user whether error feedback could matter.
"""
import math
from collections import deque
from dataclasses import dataclass
from typing import Deque, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from deepspeed_loco.utils.logging import log_rank0, logger

WINDOW = 10  # measured steps a live estimate averages over


class ReduceSums:
    """One rank's noise statistics of one optimizer step's reduces, summed over buckets and micro-steps: fp32
    ``(2H + 1,)`` on the gradients' device, ``[in_1, Q_1, in_2, Q_2, ..., ||out||^2]`` (``in_h``: sum of squares of
    hop ``h``'s input, ``in_1 = S_r``). Allocated as zeros by the first reduce that uses it."""

    def __init__(self, hops: int):
        self.hops = hops
        self.tensor: Optional[torch.Tensor] = None

    def views(self, device) -> Tuple[List[torch.Tensor], torch.Tensor]:
        """``(per hop the (2,) view [in_h, Q_h], the (1,) view of ||out||^2)``, the ops' ``stats`` arguments."""
        if self.tensor is None:
            self.tensor = torch.zeros(2 * self.hops + 1, dtype=torch.float32, device=device)
        return [self.tensor[2 * h:2 * h + 2] for h in range(self.hops)], self.tensor[2 * self.hops:]

    def take(self, device) -> torch.Tensor:
        """The sums (zeros on ``device`` if no reduce ran), as a tensor the caller owns; this object starts empty."""
        tensor, self.tensor = self.tensor, None
        return torch.zeros(2 * self.hops + 1, dtype=torch.float32, device=device) if tensor is None else tensor


@dataclass(frozen=True)
class NoiseSample:
    """One measured optimizer step, per micro-step: ``hop_error_sq[h]`` the error power of the mean from hop ``h``,
    ``noise_sq`` the sampling-noise power of the exact mean ``tr(Sigma) / (W b)``, ``grad_sq`` the estimate of
    ``||G||^2`` (module docstring)."""
    hop_error_sq: Tuple[float, ...]
    noise_sq: float
    grad_sq: float

    @property
    def error_sq(self) -> float:
        return sum(self.hop_error_sq)

    @classmethod
    def from_totals(cls, totals: Sequence[float], world_size: int, micro_steps: int) -> Optional["NoiseSample"]:
        """From the sums over ranks of :class:`ReduceSums` (``2H + 1`` floats) of ``micro_steps`` micro-steps on
        ``world_size >= 2`` ranks; None when a sum is not finite (an fp16 overflow step)."""
        if world_size < 2 or micro_steps < 1 or len(totals) % 2 != 1:
            raise ValueError(f"NoiseSample: {len(totals)} totals (must be 2H + 1), world_size {world_size} (>= 2), "
                             f"micro_steps {micro_steps} (>= 1)")
        if not all(math.isfinite(t) for t in totals):
            return None
        hops = len(totals) // 2
        per_step = [t / micro_steps for t in totals]
        hop_error = tuple(per_step[2 * h + 1] / world_size**2 for h in range(hops))
        rank_sq = per_step[0] / world_size  # mean over ranks of ||g_r||^2
        exact_sq = per_step[2 * hops] - sum(hop_error)  # ||exact mean||^2
        noise = (rank_sq - exact_sq) / (world_size - 1)
        return cls(hop_error, noise, exact_sq - noise)


@dataclass(frozen=True)
class RhoEstimate:
    """Averages over ``steps`` measured steps (numerators and denominators averaged first): ``rho`` (total) with
    ``rho_spread`` (its standard error, None below 2 steps), ``hop_rho`` by hop name, the powers per micro-step
    (``hop_error_sq``, ``noise_sq`` = ``tr(Sigma) / (W b)``, ``grad_sq`` = ``||G||^2``) and ``noise_scale``, the
    gradient noise scale ``tr(Sigma) / ||G||^2`` in samples (None while the ``||G||^2`` estimate is not positive).
    ``rho`` and ``hop_rho`` are NaN while the noise estimate is not positive."""
    rho: float
    rho_spread: Optional[float]
    hop_rho: Dict[str, float]
    hop_error_sq: Dict[str, float]
    noise_sq: float
    grad_sq: float
    noise_scale: Optional[float]
    steps: int


class RhoEstimator:
    """Moving averages over the last ``window`` :class:`NoiseSample` of a run with hops ``hop_names`` (intra-node
    first), ``world_size`` ranks and ``rank_batch`` samples per rank and micro-step."""

    def __init__(self, hop_names: Sequence[str], world_size: int, rank_batch: int, window: int = WINDOW):
        if window < 1 or rank_batch < 1:
            raise ValueError(f"RhoEstimator: window {window} and rank_batch {rank_batch} must be >= 1")
        self.hop_names, self.world_size, self.rank_batch = tuple(hop_names), world_size, rank_batch
        self.samples: Deque[NoiseSample] = deque(maxlen=window)

    def add(self, sample: NoiseSample) -> None:
        if len(sample.hop_error_sq) != len(self.hop_names):
            raise ValueError(f"RhoEstimator: a sample of {len(sample.hop_error_sq)} hops for {self.hop_names}")
        self.samples.append(sample)

    def estimate(self) -> Optional[RhoEstimate]:
        """The estimate over the samples in the window; None before the first."""
        n = len(self.samples)
        if not n:
            return None
        hop_error = [sum(s.hop_error_sq[h] for s in self.samples) / n for h in range(len(self.hop_names))]
        noise = sum(s.noise_sq for s in self.samples) / n
        grad = sum(s.grad_sq for s in self.samples) / n
        ratio = (lambda x: x / noise) if noise > 0 else (lambda x: math.nan)
        rho = ratio(sum(hop_error))
        spread = None
        if n >= 2 and noise > 0:  # the ratio estimator's standard error (delta method)
            spread = math.sqrt(sum((s.error_sq - rho * s.noise_sq)**2 for s in self.samples) / (n * (n - 1))) / noise
        scale = self.world_size * self.rank_batch * noise / grad if grad > 0 and noise > 0 else None
        return RhoEstimate(rho, spread, {name: ratio(e) for name, e in zip(self.hop_names, hop_error)},
                           dict(zip(self.hop_names, hop_error)), noise, grad, scale, n)


def describe(estimate: RhoEstimate, bits: str, world_size: int, rank_batch: int, error_feedback: bool) -> str:
    """The log line: rho, per hop, and what it means in words (``docs/config.md``, "rho measured live")."""
    hops = ", ".join(f"{name.replace('_', '-')} {value:.3g}" for name, value in estimate.hop_rho.items())
    spread = f" +- {estimate.rho_spread:.2g}" if estimate.rho_spread is not None else ""
    scale = (f"; gradient noise scale {estimate.noise_scale:.3g} samples" if estimate.noise_scale is not None
             else "; gradient noise scale not resolved yet")
    if not estimate.rho == estimate.rho:  # NaN: no positive noise estimate yet
        meaning = "the sampling noise is not resolved yet (too few measured steps or noise too small to see)"
    else:
        verdict = ("above 1 the error dominates the noise" + (": error feedback (on) is what can repair it"
                                                              if error_feedback else
                                                              ": error feedback (error_feedback: true) can matter")
                   if estimate.rho > 1 else "below 1 the error hides in the noise")
        meaning = (f"the {bits}-bit quantization error of the averaged gradient has {estimate.rho:.3g}x the power of "
                   f"the gradient's own sampling noise at this batch ({world_size} ranks x {rank_batch} samples per "
                   f"micro-step); {verdict}")
    return (f"deepspeed-loco: live rho {estimate.rho:.3g}{spread} ({hops}) over the last {estimate.steps} measured "
            f"steps: {meaning}{scale}")


class LiveRho:
    """The live rho of one reducer in a real run (every rank of the data-parallel ``group`` holds one and calls
    :meth:`on_step` after every optimizer step, so that all make the same all-reduce).

    ``every``: measure the ``every``-th optimizer steps (1-based; 0: never, and nothing is armed);
    ``log_every``: rank-0 log line every so many steps (0: never). ``rank_batch``: samples per rank and micro-step
    (DeepSpeed's ``train_micro_batch_size_per_gpu``); ``micro_steps``: micro-steps per optimizer step;
    ``device``: where the all-reduce runs (the accelerator's for NCCL).
    """

    def __init__(self, reducer, group, every: int, log_every: int, rank_batch: int, micro_steps: int, device,
                 next_step: int = 1, window: int = WINDOW):
        self.reducer, self.group, self.device = reducer, group, device
        self.every, self.log_every, self.micro_steps = every, log_every, micro_steps
        hops = reducer.plan.hops
        self.world_size = reducer.plan.world_size
        self.enabled = every > 0 and bool(hops) and self.world_size > 1
        self.bits = "/".join(str(hop.bits) for hop in hops)
        self.error_feedback = reducer.state.error_feedback
        self.estimator = RhoEstimator([hop.name for hop in hops], self.world_size, rank_batch, window)
        self._arm(next_step)

    def _arm(self, step: int) -> None:
        """Gives the reducer a fresh :class:`ReduceSums` if optimizer step ``step`` is measured, else none."""
        measured = self.enabled and step % self.every == 0
        self.reducer.noise = ReduceSums(len(self.reducer.plan.hops)) if measured else None

    def on_step(self, step: int) -> Optional[RhoEstimate]:
        """After optimizer step ``step`` (1-based): if it was measured, one all-reduce of its sums and the updated
        estimate (returned); the log line when due; arms the reducer for step ``step + 1``."""
        sums, fresh = self.reducer.noise, None
        if sums is not None:
            totals = sums.take(self.device)
            dist.all_reduce(totals, group=self.group)
            sample = NoiseSample.from_totals(totals.tolist(), self.world_size, self.micro_steps)
            if sample is None:
                logger.debug(f"deepspeed-loco: live rho: step {step}'s sums are not finite (overflow); skipped")
            else:
                self.estimator.add(sample)
                fresh = self.estimator.estimate()
        if self.enabled and self.log_every and step % self.log_every == 0:
            estimate = fresh or self.estimator.estimate()
            if estimate is not None:
                log_rank0(describe(estimate, self.bits, self.world_size, self.estimator.rank_batch,
                                   self.error_feedback))
        self._arm(step + 1)
        return fresh
