"""rho measured live: the quantization error power of the communicated mean over the gradient's own sampling-noise
power, from what each rank's reduce already has (``docs/config.md``, "rho measured live").

On a measured optimizer step every rank's reduces keep (:class:`ReduceSums`):

* the ops' sums (their ``stats`` outputs, :mod:`deepspeed_loco.ops.loco_reference`), over buckets and micro-steps:
  ``S_r = ||g_r||^2`` (its gradient before quantization), ``Q_r^h = ||c - deq(quant(c))||^2`` (the error its
  quantizer made at hop ``h``; ``c`` the compensated values, the input itself for plain qgZ) and ``O_r = ||out_r||^2``
  (its partitions of the communicated mean);
* a shared sample of coordinates (:mod:`deepspeed_loco.runtime.comm.error_sample`): its gradient there and, where
  it owns them, the communicated mean, from the first micro-step.

One all-reduce (sum) of these ``2H + 1`` floats and ``3`` floats per sampled coordinate per measured step gives
(:meth:`NoiseSample.from_totals`), per micro-step, with ``W`` ranks and ``b`` samples per rank and micro-step:

* the error power of the mean ``E = ||mean - exact mean||^2``, estimated on the sample, where the exact mean is known
  (the sum of the ranks' values over ``W``). It counts every rank's and hop's error as they add up in the mean,
  correlated or not: ranks' rounding errors correlate where the signal dominates (one grid, similar values), and
  the sum of ``Q_r^h / W^2``, which assumes they do not, read up to 1.7x low (``benchmarks/live_rho_check.py``).
  ``E`` is split between the hops in proportion to their quantizers' error, ``sum_r Q_r^h``;
* the sampling-noise power of the exact mean, ``N = tr(Sigma) / (W b)``, two ways combined by inverse variance:
  on the sample, as the ranks' variance per coordinate over ``W``; and from the full sums, with ``s = mean_r S_r``
  and ``m = ||exact mean||^2``, ``E[s] = ||G||^2 + tr(Sigma) / b`` and ``E[m] = ||G||^2 + tr(Sigma) / (W b)``
  (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training", appendix A), so ``N = (s - m) / (W - 1)``,
  ``m`` being ``sum_r O_r`` less the sampled excess ``||mean||^2 - ||exact mean||^2``. The full sums win where the
  error is small against the noise, the sample where it is large (there the excess swamps ``s - m``);
* ``||G||^2 = m - N`` and the noise scale ``B_noise = tr(Sigma) / ||G||^2 = W b N / ||G||^2`` in samples (sequences);
* ``rho_h = E_h / N`` and ``rho = E / N``.

Gradient accumulation: each micro-step's reduce carries one micro-batch of ``b`` samples per rank; the sums run over
the ``A`` micro-steps of the optimizer step and are divided by ``A``, the sample is of one micro-step. The
accumulated gradient's error and noise are sums of ``A`` micro-step terms, so rho per micro-step is rho of the
accumulated step. Absolute powers are in the units of the reduced gradient (an fp16 loss scale and DeepSpeed's
``1 / A`` included); rho and ``B_noise`` are ratios and free of them.

Single steps are noisy: :class:`RhoEstimator` averages numerator and denominator over a window of measured steps
before dividing (as McCandlish et al. do) and gives the ratio estimator's standard error. :class:`LiveRho` runs it in
a real run: on every ``rho_every``-th step it begins a measured step of the reducer (:func:`begin_measured_step`,
a :class:`ReduceSums` as the reducer's probe), after it ends it and makes the one all-reduce, whose result it copies
to the host without waiting (:class:`~deepspeed_loco.utils.host_copy.HostCopy`) and reads on the first later step
at which the copy has landed (on a GPU usually the next; no host synchronization), and it logs a line every
``rho_log_every`` steps.

With ``exact_own_block`` each rank's own block of a hop is not quantized: ``in_h`` still counts every row of the
hop's input (the own block's, exact, included; ``S_r`` is the whole gradient's power as without the key) and ``Q_r^h``
only the rows the quantizer rounded, the own block making no error. ``E`` is measured on the mean, so it is the error
that remains; its split follows the error each hop's quantizer made. rho means what it means without the key.

With error feedback, ``E`` is the communicated mean's own error: the quantizer's error on the compensated values and
the remembered error those carry (about ``(1 - beta) / (1 + beta)`` more power than the quantizer's error alone in a
steady state), what reaches the optimizer. rho answers "is the error large against the sampling noise", so it tells
a plain-qgZ user whether error feedback could matter.
"""
import math
from collections import deque
from dataclasses import dataclass
from typing import Deque, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from deepspeed_loco.runtime.comm.error_sample import FIELDS, MeanErrorSample, SampledPowers
from deepspeed_loco.utils.host_copy import HostCopy, Landing
from deepspeed_loco.utils.logging import log_rank0, logger

WINDOW = 10  # measured steps a live estimate averages over


class ReduceSums:
    """One rank's noise statistics of one optimizer step's reduces, the reducer's
    :class:`~deepspeed_loco.runtime.comm.loco_reduce.ReduceProbe` on a measured step: the ops' sums, fp64
    ``(2H + 1,)`` on the gradients' device, ``[in_1, Q_1, in_2, Q_2, ..., ||out||^2]`` summed over buckets and
    micro-steps (``in_h``: sum of squares of hop ``h``'s input, ``in_1 = S_r``; allocated as zeros by the first
    reduce that uses them), and ``sample``, the shared sample of coordinates
    (:class:`~deepspeed_loco.runtime.comm.error_sample.MeanErrorSample`). Nothing here synchronizes with the host."""

    def __init__(self, hops: int, sample: MeanErrorSample):
        self.hops, self.sample = hops, sample
        self.tensor: Optional[torch.Tensor] = None

    def stats(self, device) -> Tuple[List[torch.Tensor], torch.Tensor]:
        """``(per hop the (2,) view [in_h, Q_h], the (1,) view of ||out||^2)``, the ops' ``stats`` arguments."""
        if self.tensor is None:
            self.tensor = torch.zeros(2 * self.hops + 1, dtype=torch.float64, device=device)
        return [self.tensor[2 * h:2 * h + 2] for h in range(self.hops)], self.tensor[2 * self.hops:]

    def inputs(self, names: Sequence[str], grads: Sequence[torch.Tensor], gather) -> Optional[list]:
        """Takes the sampled gradient values of a bucket; returns the bucket's picks for :meth:`outputs`."""
        picks = self.sample.pick(names, [g.numel() for g in grads])
        self.sample.take_inputs(picks, grads, gather)
        return picks

    def outputs(self, picks, means: Sequence[torch.Tensor]) -> None:
        """Takes the sampled mean values of the bucket whose :meth:`inputs` gave ``picks``."""
        self.sample.take_outputs(picks, means)

    def take(self, device) -> torch.Tensor:
        """The sums (zeros if no reduce ran) followed by the sample's vector, one fp64 tensor on ``device`` that
        the caller owns (what the all-reduce sums); this object starts empty."""
        tensor, self.tensor = self.tensor, None
        sums = torch.zeros(2 * self.hops + 1, dtype=torch.float64, device=device) if tensor is None else tensor
        return torch.cat([sums.to(device), self.sample.vector(device).double()])


def begin_measured_step(reducer, step: int) -> None:
    """Begins ``reducer``'s measured step for the live rho of optimizer step ``step`` (1-based; it picks the shared
    sample of coordinates, :class:`MeanErrorSample`): a fresh :class:`ReduceSums` as its probe."""
    reducer.begin_measured_step(ReduceSums(len(reducer.plan.hops), MeanErrorSample(step, reducer.rank)))


def end_measured_step(reducer, device) -> torch.Tensor:
    """Ends ``reducer``'s measured step: its sums (zeros if no reduce ran) followed by its sampled values, one fp64
    tensor on ``device`` that the caller owns (:meth:`ReduceSums.take`: what the live rho's all-reduce sums)."""
    return reducer.end_measured_step().take(device)


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
    def from_totals(cls, totals: torch.Tensor, hops: int, world_size: int,
                    micro_steps: int) -> Optional["NoiseSample"]:
        """From the sum over ranks of :meth:`ReduceSums.take` (``2H + 1`` sums of ``micro_steps`` micro-steps, then the
        sample's values) on ``world_size >= 2`` ranks; None when a value is not finite (an fp16 overflow step)."""
        if world_size < 2 or micro_steps < 1 or hops < 1 or totals.numel() < 2 * hops + 1 or (
                totals.numel() - 2 * hops - 1) % FIELDS:
            raise ValueError(f"NoiseSample: {totals.numel()} totals (must be 2H + 1 = {2 * hops + 1} sums and "
                             f"{FIELDS} values per sampled coordinate), world_size {world_size} (>= 2), micro_steps "
                             f"{micro_steps} (>= 1)")
        if not bool(torch.isfinite(totals).all()):
            return None
        sums = (totals[:2 * hops + 1].double() / micro_steps).tolist()
        p = SampledPowers.of(totals[2 * hops + 1:], world_size)
        quantizer = [sums[2 * h + 1] for h in range(hops)]
        total = sum(quantizer)
        shares = [q / total if total > 0 else 1 / hops for q in quantizer]
        # N from the full sums, (s - m) / (W - 1) with m = ||mean||^2 less the sampled excess (its variance the
        # excess's over (W - 1)^2), and on the sample: combined by inverse variance (module docstring)
        exact_sq = sums[2 * hops] - p.excess_sq
        full = (sums[0] / world_size - exact_sq) / (world_size - 1)
        full_var = p.excess_var / (world_size - 1)**2
        if full_var == 0 or p.noise_var == 0:  # one of them exact: no error on the wire, or one sampled value
            noise = full if full_var == 0 else p.noise_sq
        else:
            noise = (full / full_var + p.noise_sq / p.noise_var) / (1 / full_var + 1 / p.noise_var)
        return cls(tuple(p.error_sq * share for share in shares), noise, exact_sq - noise)


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
    :meth:`on_step` after every optimizer step, so that all make the same all-reduce). :attr:`fresh` is the estimate
    the last :meth:`on_step` updated, and :attr:`fresh_step` the measured step it adds (the same step on the CPU; on
    a GPU the estimate arrives at a later step, once its totals have landed on the host).

    ``every``: measure the ``every``-th optimizer steps (1-based; 0: never, and the reducer never measures);
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
        self.fresh: Optional[RhoEstimate] = None
        self.fresh_step: Optional[int] = None
        self._landing = Landing()  # measured steps' totals on their way to the host
        self._begin(next_step)

    def _begin(self, step: int) -> None:
        """Begins the reducer's measured step if optimizer step ``step`` is one to measure."""
        if self.enabled and step % self.every == 0:
            begin_measured_step(self.reducer, step)

    def on_step(self, step: int, cleared: bool) -> None:
        """After optimizer step ``step`` (1-based; a step listener of the hook, ``cleared`` is not used: a step that
        cleared the error buffers is measured like any other): if it was measured, one all-reduce of its sums and
        their copy to the host started; every measured step whose copy has landed is added, :attr:`fresh` the
        updated estimate (else None); the log line when due; begins step ``step + 1``'s measurement if it is one to
        measure. No host synchronization: a copy still on its way waits for a later step (at most one measured step
        stays in flight: an older one is waited for)."""
        if self.reducer.measuring:
            totals = end_measured_step(self.reducer, self.device)
            dist.all_reduce(totals, group=self.group)
            self._landing.add(step, HostCopy(totals))
        fresh = fresh_step = None
        for measured, totals in self._landing.landed():
            sample = NoiseSample.from_totals(totals, len(self.reducer.plan.hops), self.world_size, self.micro_steps)
            if sample is None:
                logger.debug(f"deepspeed-loco: live rho: step {measured}'s sums are not finite (overflow); skipped")
            else:
                self.estimator.add(sample)
                fresh, fresh_step = self.estimator.estimate(), measured
        if self.enabled and self.log_every and step % self.log_every == 0:
            estimate = fresh or self.estimator.estimate()
            if estimate is not None:
                log_rank0(describe(estimate, self.bits, self.world_size, self.estimator.rank_batch,
                                   self.error_feedback))
        self.fresh, self.fresh_step = fresh, fresh_step
        self._begin(step + 1)
