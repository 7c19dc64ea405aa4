"""The LoCo reduce-scatter of a bucket of gradients: two quantized all-to-all hops with error feedback."""
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from deepspeed_loco.config import LocoConfig
from deepspeed_loco.ops import kernels_for
from deepspeed_loco.layout import padded_partition_size
from deepspeed_loco.runtime.comm.topology import LocoTopology
from deepspeed_loco.layout.wire import WireLayout
from deepspeed_loco.runtime.zero.error_feedback import ErrorFeedbackState
from deepspeed_loco.utils.logging import logger


@dataclass
class WireStats:
    """What this rank put on each hop's wire; its own block, which stays local, is not counted.

    ``intra_bytes`` / ``inter_bytes``: packed values and their fp32 scales sent on the intra-node (hop 1) and
    inter-node (hop 2) all-to-all. ``intra_elements`` / ``inter_elements``: the gradient values those bytes carry,
    partition padding included, so ``*_bytes_per_element`` is the hop's cost, ``bits / 8 + 4 / group_size``
    (:func:`~deepspeed_loco.layout.wire.wire_bytes_per_element`). ``reduces``: buckets reduced.
    """
    intra_bytes: int = 0
    inter_bytes: int = 0
    reduces: int = 0
    intra_elements: int = 0
    inter_elements: int = 0

    @property
    def intra_bytes_per_element(self) -> float:
        """Bytes per element sent on the intra-node wire; 0.0 while nothing was sent on it."""
        return _per_element(self.intra_bytes, self.intra_elements)

    @property
    def inter_bytes_per_element(self) -> float:
        """Bytes per element sent on the inter-node wire; 0.0 while nothing was sent on it."""
        return _per_element(self.inter_bytes, self.inter_elements)

    def sent_intra(self, rows: int, layout: WireLayout) -> None:
        """Counts ``rows`` rows of ``layout`` sent on the intra-node wire."""
        self.intra_bytes += rows * layout.row_bytes
        self.intra_elements += rows * layout.columns

    def sent_inter(self, rows: int, layout: WireLayout) -> None:
        """Counts ``rows`` rows of ``layout`` sent on the inter-node wire."""
        self.inter_bytes += rows * layout.row_bytes
        self.inter_elements += rows * layout.columns


def _per_element(num_bytes: int, elements: int) -> float:
    return num_bytes / elements if elements else 0.0


class LocoReducer:
    """Reduce-scatters buckets of full gradients to this rank's ZeRO-3 partitions of their mean.

    ``reduce_scatter`` returns, per parameter, ``ceil(N / W)`` elements (zero past ``N``) of the mean over the
    ``W`` ranks, in the gradient's dtype: the quantity and layout of DeepSpeed's reduce-scatter path. A bucket
    costs one all-to-all per hop whatever its number of parameters.
    """

    def __init__(self, config: LocoConfig, topology: LocoTopology, state: Optional[ErrorFeedbackState] = None):
        self.config = config
        self.topology = topology
        self.state = state if state is not None else ErrorFeedbackState(config, topology)
        self.stats = WireStats()
        self._touched = False

    @torch.no_grad()
    def reduce_scatter(self, params: Sequence[torch.Tensor],
                       grads: Optional[Sequence[torch.Tensor]] = None) -> List[torch.Tensor]:
        """``params``' gradients (``grads``, default each ``p.grad``) to this rank's mean partitions."""
        grads = [p.grad for p in params] if grads is None else list(grads)
        topo = self.topology
        for param, grad in zip(params, grads):
            if grad is None:
                raise ValueError(f"LoCo reduce: parameter {_name(param)} has no gradient to reduce")
            if grad.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                raise TypeError(f"LoCo reduce: gradient of {_name(param)} is {grad.dtype}; "
                                f"supported are float32, float16 and bfloat16")
        if topo.world_size == 1:
            return [g.reshape(-1).clone() for g in grads]
        self._touched = False
        try:
            return self._reduce_scatter(params, grads)
        except BaseException as exc:
            # a bucket's buffers may be half-updated: fall back to the state a fresh run starts from
            if self._touched:
                self.state.reset()
                logger.warning(f"deepspeed-loco: rank {topo.rank}: {type(exc).__name__} during a LoCo reduce; all "
                               f"error-feedback buffers of this rank were reset to zero")
            raise

    def _reduce_scatter(self, params: Sequence[torch.Tensor], grads: List[torch.Tensor]) -> List[torch.Tensor]:
        topo, cfg = self.topology, self.config
        self.stats.reduces += 1
        kernels = kernels_for(grads[0].device)
        widths = tuple(padded_partition_size(g.numel(), topo.world_size, cfg.group_size) for g in grads)
        errors = [self.state.for_param(p, g.numel(), g.device) for p, g in zip(params, grads)]
        device = grads[0].device
        beta = cfg.err_beta
        self._touched = any(e is not None for e in errors)  # the kernels below update the buffers in place

        if topo.local_size > 1:
            hop1 = WireLayout(widths, cfg.intra_node_bits, cfg.group_size)
            send1 = hop1.empty(topo.world_size, device)
            for i, (grad, offset) in enumerate(zip(grads, hop1.offsets())):
                kernels.hop1_(grad, topo.world_size, topo.local_size, errors[i] and errors[i].hop1, beta, hop1.bits,
                              cfg.group_size, *hop1.views(send1, i, offset), hadamard=cfg.hadamard)
            recv1 = torch.empty_like(send1)
            dist.all_to_all_single(recv1, send1, group=topo.intra_group)
            self.stats.sent_intra((topo.local_size - 1) * topo.num_nodes, hop1)  # all but the M rows this rank keeps
            if topo.num_nodes == 1:
                return self._final(kernels, hop1, recv1, grads)

        hop2 = WireLayout(widths, cfg.inter_node_bits, cfg.group_size)
        send2 = hop2.empty(topo.num_nodes, device)
        for i, (grad, offset) in enumerate(zip(grads, hop2.offsets())):
            error = errors[i] and errors[i].hop2
            out = hop2.views(send2, i, offset)
            if topo.local_size == 1:
                kernels.hop1_(grad, topo.world_size, 1, error, beta, hop2.bits, cfg.group_size, *out,
                              hadamard=cfg.hadamard)
            else:
                kernels.hop2_(*hop1.views(recv1, i, offset), topo.local_size, hop1.bits, error, beta, hop2.bits,
                              cfg.group_size, *out)
        recv2 = torch.empty_like(send2)
        dist.all_to_all_single(recv2, send2, group=topo.inter_group)
        self.stats.sent_inter(topo.num_nodes - 1, hop2)  # all but the row this rank keeps
        return self._final(kernels, hop2, recv2, grads)

    def _final(self, kernels, layout: WireLayout, received: torch.Tensor,
               grads: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        topo = self.topology
        return [
            kernels.final_mean(*layout.views(received, i, offset), layout.bits, layout.group_size, topo.world_size,
                               grad.numel(), topo.rank, grad.dtype, hadamard=self.config.hadamard)
            for i, (grad, offset) in enumerate(zip(grads, layout.offsets()))
        ]


def _name(param: torch.Tensor) -> str:
    return getattr(param, "ds_name", None) or f"#{getattr(param, 'ds_id', id(param))}"
