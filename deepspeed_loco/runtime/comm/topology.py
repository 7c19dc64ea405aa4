"""The two-level layout of a data-parallel group: ``W = M * L`` ranks, ``L`` per node, its subgroups, and the
exchanges of the hop plan's hops over them."""
import os
from dataclasses import dataclass
from typing import Dict, Mapping, Optional

import torch.distributed as dist

from deepspeed_loco.config import LocoConfigError
from deepspeed_loco.layout import INTER_NODE, INTRA_NODE
from deepspeed_loco.runtime.comm.exchange import ProcessGroupExchange


LAUNCHER_VARS = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE")  # the launchers' ranks-per-node variables, in precedence order


def ranks_per_node(configured: Optional[int], world_size: int, device_count: int,
                   environ: Mapping[str, str] = os.environ) -> int:
    """The one default rule for ranks per node ``L``: ``configured`` (``zeropp_loco_param.local_world_size``) when
    set, else the first of :data:`LAUNCHER_VARS` set in ``environ``, else the accelerator count ``device_count``
    capped at ``world_size`` (1 without accelerators)."""
    if configured is not None:
        return configured
    for var in LAUNCHER_VARS:
        if environ.get(var):
            return int(environ[var])
    return min(device_count, world_size) or 1


@dataclass(frozen=True)
class LocoTopology:
    """Rank ``rank = node * L + local`` of a group of ``W = M * L`` ranks.

    ``intra_group``: the ``L`` ranks of this node (the ``intra_node`` hop). ``inter_group``: the ``M`` ranks
    with this local index, one per node (the ``inter_node`` hop). Either is None where its hop does not exist
    (``L == 1`` or ``M == 1``).
    """
    world_size: int
    local_size: int
    rank: int
    group: Optional[dist.ProcessGroup] = None
    intra_group: Optional[dist.ProcessGroup] = None
    inter_group: Optional[dist.ProcessGroup] = None

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.local_size

    @property
    def node(self) -> int:
        return self.rank // self.local_size

    @property
    def local_rank(self) -> int:
        return self.rank % self.local_size

    @property
    def exchanges(self) -> Dict[str, Optional[ProcessGroupExchange]]:
        """Each hop's all-to-all over its subgroup, by hop name, for
        :meth:`~deepspeed_loco.layout.HopPlan.with_exchanges` (None where the subgroup is, as in a topology built
        without process groups)."""
        groups = {INTRA_NODE: self.intra_group, INTER_NODE: self.inter_group}
        return {name: None if group is None else ProcessGroupExchange(group) for name, group in groups.items()}

    def describe(self) -> str:
        """``W=8 (M=2 nodes x L=4 ranks)``; ``W=2 (M=1 node x L=2 ranks)``."""
        return f"W={self.world_size} ({describe_layout(self.num_nodes, self.local_size)})"

    @classmethod
    def build(cls, group: Optional[dist.ProcessGroup] = None, *, local_size: int) -> "LocoTopology":
        """Creates the intra- and inter-node subgroups of ``group`` (None: the default group; a collective call on
        every rank of the job); ``local_size``: ranks per node (:func:`ranks_per_node`)."""
        world_size = dist.get_world_size(group)
        check_layout(world_size, local_size)
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world_size))
        rank = dist.get_rank(group)
        nodes = world_size // local_size
        intra = inter = None
        if world_size > 1 and local_size > 1:
            for node in range(nodes):
                members = ranks[node * local_size:(node + 1) * local_size]
                created = dist.new_group(members)
                if node == rank // local_size:
                    intra = created
        if world_size > 1 and nodes > 1:
            for local in range(local_size):
                members = ranks[local::local_size]
                created = dist.new_group(members)
                if local == rank % local_size:
                    inter = created
        return cls(world_size, local_size, rank, group, intra, inter)


def check_layout(world_size: int, local_size: int) -> None:
    """Raises a clear error unless ``local_size`` ranks per node tile ``world_size`` ranks."""
    if local_size < 1 or world_size % local_size != 0:
        raise LocoConfigError(f"zeropp_loco_param.local_world_size = {local_size} (ranks per node) does not divide "
                              f"the data-parallel world size {world_size}: it must be a divisor of {world_size} "
                              f"(set local_world_size, or launch the same number of ranks on every node)")


def describe_layout(nodes: int, local_size: int) -> str:
    """``M=2 nodes x L=4 ranks``, ``M=1 node x L=2 ranks``: the node layout as the log lines and errors name it."""
    return f"M={nodes} {'node' if nodes == 1 else 'nodes'} x L={local_size} {'rank' if local_size == 1 else 'ranks'}"


def check_hpz_partition(hpz: int, world_size: int, local_size: int) -> None:
    """Raises a clear error unless ``zero_hpz_partition_size`` (ZeRO++ hpZ: each block of ``hpz`` consecutive ranks
    keeps a secondary copy of the weights) is 1 or a divisor of both ``world_size`` (DeepSpeed would quietly shrink
    it to the world size) and ``local_size`` ranks per node (else a block would span nodes, and the backward
    all-gather LoCo's layout assumes stays in the node would not)."""
    if hpz in (0, 1):  # DeepSpeed's "off" (its config takes any value >= 0)
        return
    valid = f"1 (off) or a divisor of {local_size}, the ranks per node, such as {local_size}"
    if world_size % hpz != 0:
        raise LocoConfigError(f"zero_optimization.zero_hpz_partition_size = {hpz} does not divide the world size "
                              f"{world_size}: set it to {valid}")
    if local_size % hpz != 0:
        raise LocoConfigError(f"zero_optimization.zero_hpz_partition_size = {hpz} does not fit the node layout "
                              f"({describe_layout(world_size // local_size, local_size)}): a partition of {hpz} "
                              f"ranks would span nodes; set it to {valid}")
