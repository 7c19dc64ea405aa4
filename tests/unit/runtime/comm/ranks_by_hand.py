"""W ranks of one reduce played by hand for the live rho's sample: each rank's
:class:`~deepspeed_loco.runtime.comm.error_sample.MeanErrorSample` fed its own gradients and its partitions of a
given communicated mean, and the sum of their vectors over ranks (what the live rho's all-reduce sums)."""
import math
from typing import Sequence

import torch

from deepspeed_loco.runtime.comm.error_sample import MeanErrorSample


def partition(mean: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s ZeRO-3 partition of the flat ``mean``: ``ceil(N / W)`` elements, zero past ``N``."""
    width = math.ceil(mean.numel() / world)
    part = torch.zeros(width, dtype=mean.dtype)
    chunk = mean[rank * width:(rank + 1) * width]
    part[:chunk.numel()] = chunk
    return part


def rank_vectors(step: int, names: Sequence[str], grads: Sequence[Sequence[torch.Tensor]],
                 means: Sequence[torch.Tensor]) -> torch.Tensor:
    """fp32 ``(W, 3 * picked)``: each rank's :meth:`MeanErrorSample.vector` after one reduce of optimizer step
    ``step``; ``grads[r][i]`` rank ``r``'s gradient of parameter ``names[i]``, ``means[i]`` its flat mean."""
    world, vectors = len(grads), []
    for rank in range(world):
        sample = MeanErrorSample(step, rank)
        picks = sample.pick(names, [m.numel() for m in means])
        sample.take_inputs(picks, grads[rank])
        sample.take_outputs(picks, [partition(m, rank, world) for m in means])
        vectors.append(sample.vector("cpu"))
    return torch.stack(vectors)


def summed_vectors(step: int, names: Sequence[str], grads: Sequence[Sequence[torch.Tensor]],
                   means: Sequence[torch.Tensor]) -> torch.Tensor:
    """fp64 ``(3 * picked,)``: the sum over ranks of :func:`rank_vectors` (summed in fp64)."""
    return rank_vectors(step, names, grads, means).double().sum(0)
