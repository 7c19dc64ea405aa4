"""A simulated cluster: ``W = M x L`` virtual ranks in one process (CPU or one GPU), reduced by the library's own
:class:`~deepspeed_loco.runtime.comm.loco_reduce.LocoReducer`, error state, kernels and layout.

The only thing replaced is the exchange: each hop's all-to-all is an in-process copy among the virtual ranks
(:class:`~deepspeed_loco.simulation.exchange.InProcessAllToAll`), with every rank's reduce running in its own
thread. So partitions and error buffers are bit-identical to a real run of ``W`` processes with the same
gradients (``tests/unit/simulation`` checks it against gloo).
"""
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

from deepspeed_loco.config import LocoConfig
from deepspeed_loco.layout import INTER_NODE, INTRA_NODE, HopPlan, plan_hops
from deepspeed_loco.runtime.comm.loco_reduce import LocoReducer
from deepspeed_loco.runtime.comm.topology import check_layout
from deepspeed_loco.simulation.exchange import InProcessAllToAll


@dataclass(frozen=True)
class SimulatedTopology:
    """Virtual rank ``rank = node * L + local`` of the cluster; ``exchanges`` (by hop name) are its hops'
    in-process all-to-alls."""
    world_size: int
    local_size: int
    rank: int
    exchanges: Dict[str, object]

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.local_size

    def describe(self) -> str:
        return f"W={self.world_size} (M={self.num_nodes} nodes x L={self.local_size} ranks), simulated"


class SimulatedCluster:
    """``nodes x local`` virtual ranks, each with its own :class:`LocoReducer` and
    :class:`~deepspeed_loco.runtime.comm.error_feedback.ErrorFeedbackState` (``states[rank]``), all built from the
    one hop plan of ``config`` on this layout (:attr:`plan`), each rank's with its own exchanges.

    :meth:`reduce_scatter` takes every rank's gradients of one bucket and returns every rank's mean partitions;
    :meth:`mean_gradients` gathers them into full mean gradients (what ZeRO-3's all-gather would give every rank).
    :meth:`on_optimizer_step` counts a step on every rank (``reset_T``). A rank that raises aborts the others'
    exchanges; the cluster cannot be used after that.
    """

    def __init__(self, config: LocoConfig, nodes: int, local: int):
        world = nodes * local
        check_layout(world, local)
        self.config = config
        self.world_size, self.local_size, self.num_nodes = world, local, nodes
        intra = [InProcessAllToAll(local) for _ in range(nodes)]  # one per node
        inter = [InProcessAllToAll(nodes) for _ in range(local)]  # one per local index
        self._groups = intra + inter
        self.topologies = [
            SimulatedTopology(world, local, rank, {
                INTRA_NODE: intra[rank // local].member(rank % local),
                INTER_NODE: inter[rank % local].member(rank // local)
            }) for rank in range(world)
        ]
        self.plan: HopPlan = plan_hops(world, local, config)  # the layout, without exchanges
        self.reducers = [LocoReducer.for_topology(config, topo, self.plan) for topo in self.topologies]
        self.states = [reducer.state for reducer in self.reducers]
        self._pool = ThreadPoolExecutor(max_workers=world, thread_name_prefix="loco-virtual-rank")

    def reduce_scatter(self, grads_per_rank: Sequence[Sequence[torch.Tensor]],
                       names: Optional[Sequence[str]] = None) -> List[List[torch.Tensor]]:
        """``grads_per_rank[r][i]``: rank ``r``'s gradient of parameter ``i`` (the same shapes on every rank),
        named ``names[i]`` (default ``param<i>``): every rank's state keeps that parameter's error buffers under this
        name, so a name must always stand for the same parameter.
        Returns ``[r][i]``: rank ``r``'s partition of the mean of parameter ``i`` (``ceil(N / W)`` elements)."""
        if len(grads_per_rank) != self.world_size:
            raise ValueError(f"SimulatedCluster.reduce_scatter: got gradients of {len(grads_per_rank)} ranks, the "
                             f"cluster has {self.world_size}")
        names = list(names) if names is not None else [f"param{i}" for i in range(len(grads_per_rank[0]))]
        if any(len(grads) != len(names) for grads in grads_per_rank):  # refused before any rank starts
            raise ValueError(f"SimulatedCluster: {len(names)} names for {[len(g) for g in grads_per_rank]} gradients "
                             f"per rank")
        if self.world_size == 1:
            return [self.reducers[0].reduce_scatter(names, grads_per_rank[0])]
        futures = [
            self._pool.submit(self._reduce_one, rank, names, grads_per_rank[rank])
            for rank in range(self.world_size)
        ]
        errors = [future.exception() for future in futures]
        if any(errors):  # the failing rank's own error, not the broken barriers it left its peers
            raise next((e for e in errors if e and not isinstance(e, threading.BrokenBarrierError)),
                       next(e for e in errors if e))
        return [future.result() for future in futures]

    def mean_gradients(self, grads_per_rank: Sequence[Sequence[torch.Tensor]],
                       names: Optional[Sequence[str]] = None) -> List[torch.Tensor]:
        """The full mean gradient of each parameter, shaped like ``grads_per_rank[0][i]``: the reduce-scatter
        followed by the gather of the ``W`` partitions."""
        partitions = self.reduce_scatter(grads_per_rank, names)
        return [
            torch.cat([partitions[rank][i] for rank in range(self.world_size)])[:grad.numel()].view_as(grad)
            for i, grad in enumerate(grads_per_rank[0])
        ]

    def on_optimizer_step(self) -> bool:
        """Counts one optimizer step on every rank; True if this step reset the buffers (``reset_T``)."""
        return any([state.on_optimizer_step() for state in self.states])

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _reduce_one(self, rank: int, names: Sequence[str], grads) -> List[torch.Tensor]:
        try:
            return self.reducers[rank].reduce_scatter(names, grads)
        except BaseException:
            for group in self._groups:  # release the peers waiting for this rank
                group.abort()
            raise
