"""The hop plan: which quantized all-to-all hops a reduce makes, in order, and what each one needs.

A group of ``W = M * L`` ranks (``M`` nodes of ``L`` ranks) reduces in up to two hops:

* ``intra_node`` (``L > 1``): every rank quantizes its whole gradient as ``W`` partition rows and sends block
  ``d`` (``M`` rows) to local peer ``d``;
* ``inter_node`` (``M > 1``): every rank quantizes the ``M`` rows it summed (or, with ``L == 1``, its whole
  gradient) and sends row ``m`` to node ``m``.

The first hop of a plan quantizes the gradient itself; a later hop re-quantizes the sum of the blocks the
previous hop received. Each hop carries its exchange (the all-to-all over its peers), supplied by whoever builds
the plan: process groups (:class:`~deepspeed_loco.runtime.comm.topology.LocoTopology`) or an in-process
simulation (:mod:`deepspeed_loco.simulation`).

The plan is layout only (which hops, their bits, rows, peers, the group size, the grid, the Hadamard basis). The
algorithm's settings (``err_beta``, error feedback on or off, the error buffers' storage) belong to the error state
(:class:`~deepspeed_loco.runtime.comm.error_feedback.ErrorFeedbackState`), which passes ``err_beta`` to
:meth:`HopPlan.args` when a hop's kernel arguments are built.
"""
from dataclasses import dataclass, field, replace
from typing import Iterable, Mapping, Optional, Protocol, Sequence, Tuple

import torch

from deepspeed_loco.layout.formats import ErrorStorage, grid_named
from deepspeed_loco.layout.partition import padded_partition_size, padded_widths
from deepspeed_loco.layout.wire import WireLayout

INTRA_NODE = "intra_node"
INTER_NODE = "inter_node"


class Exchange(Protocol):
    """An all-to-all among a hop's peers."""

    def __call__(self, send: torch.Tensor) -> torch.Tensor:
        """``send`` uint8 ``(rows, row_bytes)``, ``rows = peers * k``: rows ``[i*k, (i+1)*k)`` go to peer ``i``.
        Returns a tensor of the same shape whose rows ``[i*k, (i+1)*k)`` came from peer ``i``."""


@dataclass(frozen=True)
class HopArgs:
    """Everything a hop's kernel needs besides tensors (one object per hop, from :meth:`HopPlan.args`; the bucket
    entry points of ``deepspeed_loco.ops.library`` pass these fields to the ``deepspeed_loco`` ops as scalars).

    ``world_size`` / ``local_size``: ``W`` and ``L`` (the first hop's partition and swizzle). ``bits``: this hop's
    wire bits. ``in_bits`` / ``in_blocks``: the previous hop's bits and the number of blocks received from it and
    summed (0 for the first hop). ``hadamard``: the first hop rotates each group, the final mean rotates back.
    ``grid``: the name of the gradient quantization grid (``deepspeed_loco.layout.formats.GRIDS``).
    """
    world_size: int
    local_size: int
    bits: int
    group_size: int
    err_beta: float
    hadamard: bool = False
    grid: str = "symmetric"
    in_bits: int = 0
    in_blocks: int = 0

    def mean(self) -> "MeanArgs":
        """The arguments of the final mean of the rows this hop sends (the last hop's: ``HopPlan.args(-1, ...)``)."""
        return MeanArgs(self.world_size, self.bits, self.group_size, self.hadamard, self.grid)


@dataclass(frozen=True)
class MeanArgs:
    """Everything the final mean needs besides tensors: ``W`` (the divisor and the partition), the last hop's wire
    ``bits`` and ``group_size``, ``hadamard`` (rotate back) and the ``grid``."""
    world_size: int
    bits: int
    group_size: int
    hadamard: bool = False
    grid: str = "symmetric"


@dataclass(frozen=True)
class Hop:
    """One quantized all-to-all: ``rows`` partition rows of each gradient quantized (and, with error feedback,
    that many error rows kept) and sent in ``peers`` blocks of ``rows // peers`` rows, one block per peer."""
    name: str
    bits: int
    rows: int
    peers: int
    exchange: Optional[Exchange] = field(default=None, compare=False, repr=False)

    @property
    def kept_rows(self) -> int:
        """Rows of the block this rank sends to itself (they stay local)."""
        return self.rows // self.peers

    @property
    def sent_rows(self) -> int:
        """Rows that cross the wire from this rank."""
        return self.rows - self.kept_rows

    def wire(self, widths: Sequence[int], group_size: int) -> WireLayout:
        """The byte layout of this hop's send buffer for parameters of padded partition widths ``widths``."""
        return WireLayout(tuple(widths), self.bits, group_size)


@dataclass(frozen=True)
class HopPlan:
    """The ordered hops of a reduce over ``world_size = M * local_size`` ranks (empty for a world of one);
    ``grid`` is the resolved quantization grid of every hop ("symmetric" or "midrise", never "auto").

    Two plans are equal when their layouts are (hops' exchanges are not compared)."""
    world_size: int
    local_size: int
    group_size: int
    hadamard: bool
    grid: str
    hops: Tuple[Hop, ...]

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.local_size

    def args(self, index: int, err_beta: float) -> HopArgs:
        """The kernel arguments of hop ``index`` (the last hop's ``.mean()`` are the final mean's): this plan's
        layout and the error state's ``err_beta``."""
        hop = self.hops[index]
        previous = self.hops[index - 1] if index > 0 else None
        return HopArgs(self.world_size, self.local_size, hop.bits, self.group_size, err_beta, self.hadamard,
                       self.grid, in_bits=previous.bits if previous else 0, in_blocks=previous.peers if previous else 0)

    def widths(self, numels: Sequence[int]) -> Tuple[int, ...]:
        """Padded partition widths ``P'`` of gradients of ``numels`` elements."""
        return padded_widths(numels, self.world_size, self.group_size)

    def rows(self) -> Mapping[str, int]:
        """Partition rows each hop quantizes, by hop name, in hop order (an error buffer's rows, with error
        feedback)."""
        return {hop.name: hop.rows for hop in self.hops}

    def error_bytes(self, numel: int, storage: ErrorStorage, hops: Iterable[str]) -> int:
        """Bytes of the error buffers of the hops named ``hops``, stored as ``storage``, for a gradient of ``numel``
        elements."""
        cols = padded_partition_size(numel, self.world_size, self.group_size)
        kept = set(hops)
        rows = sum(count for hop, count in self.rows().items() if hop in kept)
        return rows * storage.row_bytes(cols, self.group_size)

    def with_exchanges(self, exchanges: Mapping[str, Exchange]) -> "HopPlan":
        """The same plan with each hop's exchange taken from ``exchanges`` (keyed by hop name)."""
        return replace(self, hops=tuple(replace(hop, exchange=exchanges[hop.name]) for hop in self.hops))


def resolve_grid(quant_grid: str, bits: Iterable[int]) -> str:
    """The name of the grid every hop uses for ``zeropp_loco_param.quant_grid``, given the hops' ``bits``: "auto" is
    "midrise" when a hop sends 2 bits and "symmetric" otherwise; a grid's name is itself (ValueError for no grid's)."""
    if quant_grid != "auto":
        return grid_named(quant_grid).name
    return "midrise" if any(b <= 2 for b in bits) else "symmetric"


def plan_hops(world_size: int, local_size: int, config) -> HopPlan:
    """The hops of a :class:`~deepspeed_loco.config.LocoConfig` on ``world_size`` ranks, ``local_size`` per node
    (``world_size % local_size == 0``, checked by the caller), without exchanges: built once per engine or
    simulated cluster, then given each rank's exchanges with :meth:`HopPlan.with_exchanges`."""
    nodes = world_size // local_size
    hops = []
    if world_size > 1 and local_size > 1:
        hops.append(Hop(INTRA_NODE, config.intra_node_bits, rows=world_size, peers=local_size))
    if world_size > 1 and nodes > 1:
        hops.append(Hop(INTER_NODE, config.inter_node_bits, rows=nodes, peers=nodes))
    grid = resolve_grid(config.quant_grid, [hop.bits for hop in hops])
    return HopPlan(world_size, local_size, config.group_size, config.hadamard, grid, tuple(hops))
