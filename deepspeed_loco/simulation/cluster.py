"""A simulated cluster: ``W = M x L`` virtual ranks in one process (CPU or one GPU), reduced by the library's own
:class:`~deepspeed_loco.runtime.comm.loco_reduce.LocoReducer`, error state, kernels and layout.

The only thing replaced is the exchange: each hop's all-to-all is an in-process copy among the virtual ranks
(:class:`~deepspeed_loco.simulation.exchange.InProcessAllToAll`), with every rank's reduce running in its own
thread. So partitions and error buffers are bit-identical to a real run of ``W`` processes with the same
gradients (``tests/unit/simulation`` checks it against gloo).
"""
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence

import torch

from deepspeed_loco.config import LocoConfig
from deepspeed_loco.layout import INTER_NODE, INTRA_NODE, HopPlan, plan_hops
from deepspeed_loco.runtime.comm import noise_stats
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
    :meth:`mean_gradients` gathers them into full mean gradients (what ZeRO-3's all-gather would give every rank);
    :meth:`stream` does the same fed a node at a time (:class:`StreamedReduce`).
    :meth:`on_optimizer_step` counts a step on every rank (``reset_T``). :meth:`measure_noise` and
    :meth:`noise_totals` give the live rho's sums of a step, as a real run's all-reduce would. A rank that raises
    aborts the others' exchanges; the cluster cannot be used after that.
    """

    def __init__(self, config: LocoConfig, nodes: int, local: int):
        world = nodes * local
        check_layout(world, local)
        self.config = config
        self.world_size, self.local_size, self.num_nodes = world, local, nodes
        self.plan: HopPlan = plan_hops(world, local, config)  # the layout, without exchanges
        intra = [InProcessAllToAll(local) for _ in range(nodes)]  # one per node
        inter = [InProcessAllToAll(nodes) for _ in range(local)]  # one per local index
        self._groups = intra + inter
        self._released = [threading.Event() for _ in range(world)]  # set: the rank's reduce holds no gradient
        first = self.plan.hops[0].name if self.plan.hops else None
        self.topologies = [
            SimulatedTopology(world, local, rank, {
                hop: self._signalling(rank, exchange) if hop == first else exchange
                for hop, exchange in ((INTRA_NODE, intra[rank // local].member(rank % local)),
                                      (INTER_NODE, inter[rank % local].member(rank // local)))
            }) for rank in range(world)
        ]
        self.reducers = [LocoReducer.for_topology(config, topo, self.plan) for topo in self.topologies]
        self.states = [reducer.state for reducer in self.reducers]
        self._pool = ThreadPoolExecutor(max_workers=world, thread_name_prefix="loco-virtual-rank")

    def reduce_scatter(self, grads_per_rank: Sequence[Sequence[torch.Tensor]],
                       names: Optional[Sequence[str]] = None) -> List[List[torch.Tensor]]:
        """``grads_per_rank[r][i]``: rank ``r``'s gradient of parameter ``i`` (the same shapes on every rank),
        named ``names[i]`` (default ``param<i>``): every rank's state keeps that parameter's error buffers under this
        name, so a name must always stand for the same parameter.
        Returns ``[r][i]``: rank ``r``'s partition of the mean of parameter ``i`` (``ceil(N / W)`` elements)."""
        return self._whole(grads_per_rank, names).partitions()

    def mean_gradients(self, grads_per_rank: Sequence[Sequence[torch.Tensor]],
                       names: Optional[Sequence[str]] = None) -> List[torch.Tensor]:
        """The full mean gradient of each parameter, shaped like ``grads_per_rank[0][i]``: the reduce-scatter
        followed by the gather of the ``W`` partitions."""
        return self._whole(grads_per_rank, names).mean_gradients()

    def stream(self, names: Sequence[str]) -> "StreamedReduce":
        """One reduce of the parameters ``names`` fed a few ranks at a time, in rank order (e.g. node by node):
        see :class:`StreamedReduce`. Use it as a context manager, so that a failure while feeding it releases the
        ranks already waiting at an exchange."""
        return StreamedReduce(self, names)

    def _whole(self, grads_per_rank, names) -> "StreamedReduce":
        """The reduce of every rank's gradients at once (refused before any rank starts if they do not fit)."""
        if len(grads_per_rank) != self.world_size:
            raise ValueError(f"SimulatedCluster.reduce_scatter: got gradients of {len(grads_per_rank)} ranks, the "
                             f"cluster has {self.world_size}")
        names = list(names) if names is not None else [f"param{i}" for i in range(len(grads_per_rank[0]))]
        with self.stream(names) as reduce:
            reduce.add(grads_per_rank)
        return reduce

    def on_optimizer_step(self) -> bool:
        """Counts one optimizer step on every rank; True if this step reset the buffers (``reset_T``)."""
        return any([state.on_optimizer_step() for state in self.states])

    def measure_noise(self, step: int) -> None:
        """Every rank's reducer begins measuring optimizer step ``step`` for the live rho
        (:func:`~deepspeed_loco.runtime.comm.noise_stats.begin_measured_step`) until :meth:`noise_totals`."""
        for reducer in self.reducers:
            noise_stats.begin_measured_step(reducer, step)

    def noise_totals(self, device) -> torch.Tensor:
        """Ends every rank's measured step: the sums over ranks of its statistics (the live rho's all-reduce), added
        in rank order."""
        return torch.stack([noise_stats.end_measured_step(reducer, device) for reducer in self.reducers]).sum(0)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _signalling(self, rank: int, exchange):
        """``exchange`` that first marks rank ``rank`` released: it reaches its first exchange once the first hop
        has quantized its gradients, which the reducer then no longer holds."""
        def first_exchange(send: torch.Tensor) -> torch.Tensor:
            self._released[rank].set()
            return exchange(send)

        return first_exchange

    def _reduce_one(self, rank: int, names: Sequence[str], handed: List[torch.Tensor]) -> List[torch.Tensor]:
        """Rank ``rank``'s reduce of the gradients in ``handed``, which it empties: its reducer then holds the
        only references (until its first hop has quantized them)."""
        try:
            return self.reducers[rank].reduce_scatter(names, _take(handed))
        except BaseException:
            self._abort()  # release the peers waiting for this rank
            raise
        finally:
            self._released[rank].set()

    def _abort(self) -> None:
        """Aborts every exchange group, releasing the ranks that wait at one."""
        for group in self._groups:
            group.abort()


class StreamedReduce:
    """One reduce on a :class:`SimulatedCluster`, fed rank by rank: :meth:`add` starts the next ranks' reduces
    (rank ``r``'s in its own thread, on gradients it takes over), :meth:`wait_released` waits until every rank
    started has quantized its first hop, :meth:`partitions` / :meth:`mean_gradients` wait for the end once all ``W``
    ranks were added.

    A rank blocks only at exchanges whose peers have not started: with ``L`` ranks per node added node by node, a
    node's ranks finish hop 1 (intra-node) among themselves and wait at hop 2 (inter-node) for the other nodes. Once
    the caller has dropped its own references to an added node's gradients and :meth:`wait_released` returned,
    nothing holds those gradients any more, so at most one node's are alive while the next node's are computed.
    Leaving the ``with`` block on an exception aborts the exchanges (the cluster cannot be used after that).
    """

    def __init__(self, cluster: SimulatedCluster, names: Sequence[str]):
        self.cluster, self.names = cluster, list(names)
        self._futures = []
        self._shapes: Optional[List[torch.Size]] = None

    def __enter__(self) -> "StreamedReduce":
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc_type is not None and self._futures:
            self.cluster._abort()
            wait(self._futures)

    def add(self, grads_per_rank: Sequence[Sequence[torch.Tensor]]) -> None:
        """Starts the reduces of the next ``len(grads_per_rank)`` ranks, ``grads_per_rank[k][i]`` the gradient of
        parameter ``names[i]`` (the same shapes on every rank); each rank gets its own list of the tensors."""
        cluster, started = self.cluster, len(self._futures)
        if started + len(grads_per_rank) > cluster.world_size:
            raise ValueError(f"SimulatedCluster: gradients of {started + len(grads_per_rank)} ranks for a cluster of "
                             f"{cluster.world_size}")
        if any(len(grads) != len(self.names) for grads in grads_per_rank):  # refused before these ranks start
            raise ValueError(f"SimulatedCluster: {len(self.names)} names for {[len(g) for g in grads_per_rank]} "
                             f"gradients per rank")
        if self._shapes is None and grads_per_rank:
            self._shapes = [grad.shape for grad in grads_per_rank[0]]
        for rank, grads in enumerate(grads_per_rank, start=started):
            cluster._released[rank].clear()
            self._futures.append(cluster._pool.submit(cluster._reduce_one, rank, self.names, list(grads)))

    def wait_released(self) -> None:
        """Waits until every rank added so far holds no gradient any more (or has finished)."""
        for rank in range(len(self._futures)):
            self.cluster._released[rank].wait()

    def partitions(self) -> List[List[torch.Tensor]]:
        """``[r][i]``: rank ``r``'s partition of the mean of parameter ``i`` (``ceil(N / W)`` elements); raises the
        first failing rank's own error."""
        if len(self._futures) != self.cluster.world_size:
            raise ValueError(f"SimulatedCluster.reduce_scatter: got gradients of {len(self._futures)} ranks, the "
                             f"cluster has {self.cluster.world_size}")
        errors = [future.exception() for future in self._futures]
        if any(errors):  # the failing rank's own error, not the broken barriers it left its peers
            raise next((e for e in errors if e and not isinstance(e, threading.BrokenBarrierError)),
                       next(e for e in errors if e))
        return [future.result() for future in self._futures]

    def mean_gradients(self) -> List[torch.Tensor]:
        """The full mean gradient of each parameter, shaped like the gradients added: the gather of the ``W``
        partitions."""
        partitions = self.partitions()
        return [
            torch.cat([partitions[rank][i] for rank in range(len(partitions))])[:shape.numel()].view(shape)
            for i, shape in enumerate(self._shapes)
        ]


def _take(items: list) -> Iterator:
    """The items of ``items``, each removed from it as it is handed out, so that only the receiver holds them."""
    while items:
        yield items.pop(0)
