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
from typing import Dict, List, Optional, Sequence, Tuple

import torch

PER_TENSOR = 256  # coordinates sampled per parameter tensor (all of a smaller one)
FIELDS = 3  # g, g^2 and out, each one value per sampled coordinate


def sample_indices(name: str, numel: int, step: int) -> Tuple[torch.Tensor, float]:
    """The coordinates of parameter ``name`` (``numel`` elements) sampled on optimizer step ``step``, int64 CPU
    ``(min(numel, PER_TENSOR),)`` in increasing order, and their weight ``numel / picked``; the same on every rank."""
    if numel <= PER_TENSOR:
        return torch.arange(numel), 1.0
    stride = numel / PER_TENSOR
    seed = zlib.crc32(f"{name}:{step}".encode())
    offset = torch.rand(1, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).item() * stride
    indices = (offset + torch.arange(PER_TENSOR, dtype=torch.float64) * stride).long().clamp_(max=numel - 1)
    return indices, stride


class MeanErrorSample:
    """One rank's sampled values of one measured optimizer step: :meth:`pick` before a reduce, :meth:`take_inputs`
    with its gradients, :meth:`take_outputs` with its mean partitions; :meth:`vector` for the all-reduce. Only each
    parameter's first reduce of the step is sampled (one micro-step: rho per micro-step is rho of the step)."""

    def __init__(self, step: int, rank: int):
        self.step, self.rank = step, rank
        self._seen: set = set()
        self._values: List[torch.Tensor] = []  # per sampled parameter fp32 (FIELDS, picked), sqrt(w)-scaled
        self._pending: Dict[int, torch.Tensor] = {}  # position in the reduce: sqrt(w) g, until its outputs come

    def pick(self, names: Sequence[str], numels: Sequence[int]) -> List[Optional[Tuple[torch.Tensor, float]]]:
        """Per parameter of a reduce, ``(indices, weight)`` if it is sampled in it, else None."""
        picks = []
        for name, numel in zip(names, numels):
            picks.append(None if name in self._seen else sample_indices(name, numel, self.step))
            self._seen.add(name)
        return picks

    def take_inputs(self, picks, grads: Sequence[torch.Tensor]) -> None:
        """Keeps ``sqrt(w) g`` and ``w g^2`` at the picked coordinates of each gradient (any float dtype, flat or
        not), on its device."""
        for position, (pick, grad) in enumerate(zip(picks, grads)):
            if pick is not None:
                indices, weight = pick
                picked = grad.reshape(-1).index_select(0, indices.to(grad.device))
                self._pending[position] = picked.float() * math.sqrt(weight)

    def take_outputs(self, picks, outputs: Sequence[torch.Tensor]) -> None:
        """Adds ``sqrt(w) out`` at the picked coordinates this rank owns: ``outputs[i]`` is parameter ``i``'s
        partition of the mean, ``ceil(numel / W)`` elements from global index ``rank * ceil(numel / W)``."""
        for position, (pick, out) in enumerate(zip(picks, outputs)):
            if pick is None:
                continue
            (indices, weight), g = pick, self._pending.pop(position)
            width = out.numel()
            local = indices - self.rank * width
            owned = (local >= 0) & (local < width)
            mean = torch.zeros_like(g)
            owned_at = owned.nonzero().squeeze(1).to(out.device)
            mean.index_copy_(0, owned_at, out.index_select(0, local[owned].to(out.device)).float() * math.sqrt(weight))
            self._values.append(torch.stack([g, g * g, mean]))

    def vector(self, device) -> torch.Tensor:
        """fp32 ``(FIELDS * picked,)``: the ``g`` values, then ``g^2``, then ``out``, of every sampled parameter."""
        if self._pending:
            raise RuntimeError("MeanErrorSample: a reduce took its inputs but not its outputs")
        if not self._values:
            return torch.zeros(0, dtype=torch.float32, device=device)
        return torch.cat([v.to(device) for v in self._values], dim=1).reshape(-1)


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
