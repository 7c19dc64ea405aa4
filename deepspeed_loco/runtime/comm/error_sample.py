"""The communicated mean's error and the gradient's sampling noise on a shared sample of coordinates: the live rho's
measurement of what independent per-rank sums cannot see (ranks' quantization errors that correlate).

On a measured step every rank picks the same coordinates of each parameter (:func:`sample_indices`: systematic
sampling, ``PER_TENSOR`` coordinates at a random offset drawn from the parameter's name and the step, so every rank
draws the same) and keeps, scaled by ``sqrt(w)`` with ``w = numel / picked`` (the stratum's weight):

* ``g``: its own gradient there, before quantization, and ``g^2``;
* ``out``: the communicated mean there where this rank owns the coordinate's partition, zero elsewhere.

Summed over ranks (the live rho's one all-reduce), with ``W`` ranks: the exact mean is ``g_sum / W``, so per
coordinate the mean's error is ``out - g_sum / W`` and the sampling-noise power of the exact mean is
``(sum_r g_r^2 - g_sum^2 / W) / (W (W - 1))`` (the unbiased variance of the ranks' values over ``W``). Weighted sums
over the sample estimate, without bias, ``||mean - exact mean||^2`` (every rank's and hop's error together, however
they correlate, and for LoCo the remembered error it carries), ``tr(Sigma) / (W b)`` and ``||exact mean||^2``.
"""
import math
import zlib
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

PER_TENSOR = 256  # coordinates sampled per parameter tensor (all of a smaller one)
FIELDS = 3  # g, g^2 and out, each one value per sampled coordinate


def sample_indices(name: str, numel: int, step: int) -> Tuple[torch.Tensor, float]:
    """The coordinates of parameter ``name`` (``numel`` elements) sampled on optimizer step ``step``, int64 CPU
    ``(min(numel, PER_TENSOR),)`` in increasing order, and their weight ``numel / picked``; the same on every rank."""
    return sample_many([name], [numel], step)[0]


def sample_many(names: Sequence[str], numels: Sequence[int], step: int) -> List[Tuple[torch.Tensor, float]]:
    """:func:`sample_indices` of each parameter, the large ones' coordinates computed together: every tensor of more
    than ``PER_TENSOR`` elements gets ``PER_TENSOR`` coordinates a stride ``numel / PER_TENSOR`` apart from an offset
    uniform in ``[0, stride)`` drawn from ``crc32(name:step)``."""
    picks: List[Optional[Tuple[torch.Tensor, float]]] = [
        (torch.arange(numel), 1.0) if numel <= PER_TENSOR else None for numel in numels]
    large = [i for i, pick in enumerate(picks) if pick is None]
    if large:
        strides = torch.tensor([numels[i] / PER_TENSOR for i in large], dtype=torch.float64)
        generator = torch.Generator()
        offsets = torch.cat([torch.rand(1, generator=generator.manual_seed(zlib.crc32(f"{names[i]}:{step}".encode())),
                                        dtype=torch.float64) for i in large]) * strides
        grid = offsets[:, None] + torch.arange(PER_TENSOR, dtype=torch.float64) * strides[:, None]
        rows = torch.minimum(grid.long(), torch.tensor([numels[i] - 1 for i in large])[:, None])
        for row, i, stride in zip(rows, large, strides.tolist()):
            picks[i] = (row, stride)
    return picks


class MeanErrorSample:
    """One rank's sampled values of one measured optimizer step: :meth:`pick` before a reduce, :meth:`take_inputs`
    with its gradients, :meth:`take_outputs` with its mean partitions; :meth:`vector` for the all-reduce. Only each
    parameter's first reduce of the step is sampled (one micro-step: rho per micro-step is rho of the step).

    A reduce's sampled parameters are handled together: their coordinates are worked out on the host and copied to
    the device once, and the gathered values are scaled and placed with one kernel each, so that a measured step
    costs one small gather per sampled tensor and no host synchronization."""

    def __init__(self, step: int, rank: int):
        self.step, self.rank = step, rank
        self._seen: set = set()
        self._values: List[torch.Tensor] = []  # per sampled reduce fp32 (FIELDS, picked), sqrt(w)-scaled
        self._pending: Optional[_PendingReduce] = None  # the reduce whose inputs are taken, until its outputs come

    def pick(self, names: Sequence[str], numels: Sequence[int]) -> List[Optional[Tuple[torch.Tensor, float]]]:
        """Per parameter of a reduce, ``(indices, weight)`` if it is sampled in it, else None."""
        fresh = []
        for i, name in enumerate(names):
            if name not in self._seen:
                fresh.append(i)
                self._seen.add(name)
        picks: List[Optional[Tuple[torch.Tensor, float]]] = [None] * len(names)
        for i, pick in zip(fresh, sample_many([names[i] for i in fresh], [numels[i] for i in fresh], self.step)):
            picks[i] = pick
        return picks

    def take_inputs(self, picks, grads: Sequence[torch.Tensor]) -> None:
        """Keeps ``sqrt(w) g`` at the picked coordinates of each gradient (one float dtype and device for all, flat
        or not), on their device."""
        chosen = [(position, pick) for position, pick in enumerate(picks) if pick is not None]
        if not chosen:
            return
        device = grads[chosen[0][0]].device
        positions = [position for position, _ in chosen]
        counts = [pick[0].numel() for _, pick in chosen]
        indices = torch.cat([pick[0] for _, pick in chosen])
        roots = _to_device(torch.tensor([math.sqrt(pick[1]) for _, pick in chosen], dtype=torch.float32)
                           .repeat_interleave(torch.tensor(counts)), device)
        picked = torch.cat([grads[position].reshape(-1).index_select(0, at) for position, at in
                            zip(positions, _to_device(indices, device).split(counts))]).float() * roots
        self._pending = _PendingReduce(positions, indices, counts, roots, picked)

    def take_outputs(self, picks, outputs: Sequence[torch.Tensor]) -> None:
        """Adds ``sqrt(w) out`` at the picked coordinates this rank owns: ``outputs[i]`` is parameter ``i``'s
        partition of the mean, ``ceil(numel / W)`` elements from global index ``rank * ceil(numel / W)``."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        counts = torch.tensor(pending.counts)
        widths = torch.tensor([outputs[position].numel() for position in pending.positions]).repeat_interleave(counts)
        local = pending.indices - self.rank * widths
        owned = (local >= 0) & (local < widths)
        at = owned.nonzero().squeeze(1)  # positions in the reduce's sample that this rank owns, parameter by parameter
        per_parameter = torch.arange(len(pending.counts)).repeat_interleave(counts)[at].bincount(
            minlength=len(pending.counts)).tolist()
        moved = _to_device(torch.cat([at, local[at]]), pending.picked.device)
        places, sources = moved[:at.numel()], moved[at.numel():].split(per_parameter)
        gathered = [outputs[position].index_select(0, source) for position, source in zip(pending.positions, sources)]
        out = torch.zeros_like(pending.picked).index_copy_(0, places, torch.cat(gathered).float())
        g = pending.picked
        self._values.append(torch.stack([g, g * g, out * pending.roots]))

    def vector(self, device) -> torch.Tensor:
        """fp32 ``(FIELDS * picked,)``: the ``g`` values, then ``g^2``, then ``out``, of every sampled parameter."""
        if self._pending is not None:
            raise RuntimeError("MeanErrorSample: a reduce took its inputs but not its outputs")
        if not self._values:
            return torch.zeros(0, dtype=torch.float32, device=device)
        return torch.cat([v.to(device) for v in self._values], dim=1).reshape(-1)


@dataclass(frozen=True)
class _PendingReduce:
    """A reduce's sample between its inputs and its outputs: ``positions`` its sampled parameters' places in the
    reduce, ``indices`` their picked coordinates concatenated (int64, CPU), ``counts`` how many each, ``roots`` fp32
    ``sqrt(w)`` per picked coordinate and ``picked`` fp32 ``sqrt(w) g`` (both on the gradients' device)."""
    positions: List[int]
    indices: torch.Tensor
    counts: List[int]
    roots: torch.Tensor
    picked: torch.Tensor


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on ``device``: through pinned memory without waiting, when that is a CUDA device."""
    if torch.device(device).type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class SampledPowers:
    """Estimates from the sum over ranks of :meth:`MeanErrorSample.vector` (module docstring): ``error_sq``
    ``||mean - exact mean||^2``, ``noise_sq`` ``tr(Sigma) / (W b)``, ``mean_sq`` ``||exact mean||^2`` and
    ``excess_sq`` ``||mean||^2 - ||exact mean||^2``; ``noise_var`` and ``excess_var``, the sampling variances of
    ``noise_sq`` and ``excess_sq`` (the spread of the coordinates' terms times their number)."""
    error_sq: float
    noise_sq: float
    mean_sq: float
    excess_sq: float
    noise_var: float
    excess_var: float

    @classmethod
    def of(cls, totals: torch.Tensor, world_size: int) -> "SampledPowers":
        g_sum, g_sq, out = totals.double().reshape(FIELDS, -1)
        exact = g_sum / world_size
        noise = (g_sq - g_sum * exact) / (world_size * (world_size - 1))
        excess = out.pow(2) - exact.pow(2)
        count = noise.numel()
        spread = (lambda x: count * x.var().item()) if count > 1 else (lambda x: 0.0)
        return cls((out - exact).pow(2).sum().item(), noise.sum().item(), exact.pow(2).sum().item(),
                   excess.sum().item(), spread(noise), spread(excess))
