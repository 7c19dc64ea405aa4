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
import hashlib
import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from deepspeed_loco.ops.loco_reference import gather_sample

PER_TENSOR = 256  # coordinates sampled per parameter tensor (all of a smaller one)
FIELDS = 3  # g, g^2 and out, each one value per sampled coordinate
# (tensors, owners, coords, scales) -> fp32 values: loco_reference.gather_sample's contract (Kernels.gather_sample)
Gather = Callable[[Sequence[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def sample_indices(name: str, numel: int, step: int) -> Tuple[torch.Tensor, float]:
    """The coordinates of parameter ``name`` (``numel`` elements) sampled on optimizer step ``step``, int64 CPU
    ``(min(numel, PER_TENSOR),)`` in increasing order, and their weight ``numel / picked``; the same on every rank."""
    return sample_many([name], [numel], step)[0]


def _uniform(key: str) -> float:
    """A number uniform in ``[0, 1)`` drawn from ``key`` (53 bits of its BLAKE2b hash): the same on every rank."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) / 2**53


def sample_many(names: Sequence[str], numels: Sequence[int], step: int) -> List[Tuple[torch.Tensor, float]]:
    """:func:`sample_indices` of each parameter, the large ones' coordinates computed together: every tensor of more
    than ``PER_TENSOR`` elements gets ``PER_TENSOR`` coordinates a stride ``numel / PER_TENSOR`` apart from an offset
    uniform in ``[0, stride)`` drawn from ``name:step`` (:func:`_uniform`)."""
    picks: List[Optional[Tuple[torch.Tensor, float]]] = [
        (torch.arange(numel), 1.0) if numel <= PER_TENSOR else None for numel in numels]
    large = [i for i, pick in enumerate(picks) if pick is None]
    if large:
        strides = torch.tensor([numels[i] / PER_TENSOR for i in large], dtype=torch.float64)
        offsets = torch.tensor([_uniform(f"{names[i]}:{step}") for i in large], dtype=torch.float64) * strides
        grid = offsets[:, None] + torch.arange(PER_TENSOR, dtype=torch.float64) * strides[:, None]
        rows = torch.minimum(grid.long(), torch.tensor([numels[i] - 1 for i in large])[:, None])
        for row, i, stride in zip(rows, large, strides.tolist()):
            picks[i] = (row, stride)
    return picks


class MeanErrorSample:
    """One rank's sampled values of one measured optimizer step: :meth:`pick` before a reduce, :meth:`take_inputs`
    with its gradients, :meth:`take_outputs` with its mean partitions; :meth:`vector` for the all-reduce. Only each
    parameter's first reduce of the step is sampled (one micro-step: rho per micro-step is rho of the step).

    A reduce's sampled parameters are handled together: their coordinates are worked out on the host and gathered
    from all of them at once (``Kernels.gather_sample``: one launch and one copy to the device on CUDA), for the
    gradients and again for the mean partitions, with no host synchronization."""

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

    def take_inputs(self, picks, grads: Sequence[torch.Tensor], gather: Gather = gather_sample) -> None:
        """Keeps ``sqrt(w) g`` at the picked coordinates of each gradient (one float dtype and device for all, flat
        or not), on their device. ``gather``: the kernels' sample gather (``Kernels.gather_sample``; default the
        PyTorch reference), used again for the outputs."""
        chosen = [(position, pick) for position, pick in enumerate(picks) if pick is not None]
        if not chosen:
            return
        positions = [position for position, _ in chosen]
        counts = torch.tensor([pick[0].numel() for _, pick in chosen])
        indices = torch.cat([pick[0] for _, pick in chosen])
        owners = torch.arange(len(chosen), dtype=torch.int32).repeat_interleave(counts)
        roots = torch.tensor([math.sqrt(pick[1]) for _, pick in chosen], dtype=torch.float32)
        picked = gather([grads[position] for position in positions], owners, indices, roots)
        self._pending = _PendingReduce(positions, indices, owners, roots, picked, gather)

    def take_outputs(self, picks, outputs: Sequence[torch.Tensor]) -> None:
        """Adds ``sqrt(w) out`` at the picked coordinates this rank owns: ``outputs[i]`` is parameter ``i``'s
        partition of the mean, ``ceil(numel / W)`` elements from global index ``rank * ceil(numel / W)``."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        widths = torch.tensor([outputs[position].numel() for position in pending.positions])[pending.owners.long()]
        local = pending.indices - self.rank * widths
        owned = (local >= 0) & (local < widths)
        out = pending.gather([outputs[position] for position in pending.positions], pending.owners,
                             torch.where(owned, local, -1), pending.roots)
        g = pending.picked
        self._values.append(torch.stack([g, g * g, out]))

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
    reduce, ``indices`` their picked coordinates concatenated (int64, CPU), ``owners`` the place in ``positions``
    of each (int32, CPU), ``roots`` fp32 ``sqrt(w)`` per sampled parameter (CPU), ``picked`` fp32 ``sqrt(w) g`` (on
    the gradients' device) and ``gather`` the sample gather that took it."""
    positions: List[int]
    indices: torch.Tensor
    owners: torch.Tensor
    roots: torch.Tensor
    picked: torch.Tensor
    gather: Gather


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
