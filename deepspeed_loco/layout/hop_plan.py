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

With ``exact_own_block`` (``zeropp_loco_param.exact_own_block``) the block a rank sends to itself in a hop (rank
``r``'s peer index: ``r % L`` on ``intra_node``, ``r // L`` on ``inter_node``) is not quantized and keeps no error
rows: its exact fp32 values go to the next hop (or the final mean) in a per-bucket "own" buffer and are added there
after the other blocks, so a hop's error buffer has ``rows - kept_rows`` rows instead of ``rows``.

The plan is layout only (which hops, their bits, rows, peers, the group size, the grid, the Hadamard basis, the
exact own block). The
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
    ``own``: this rank's peer index in this hop, whose block (:attr:`kept_rows` rows) is kept exact and handed on in
    fp32 (``own_out``) instead of quantized; -1: every block quantized. ``in_own``: this rank's peer index in the
    previous hop, whose received block is replaced by that hop's exact fp32 block (``own_in``), added after the
    others; -1: none (always -1 on the first hop).
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
    own: int = -1
    in_own: int = -1

    @property
    def rows(self) -> int:
        """Partition rows this hop quantizes: ``W`` on the first hop, ``M`` on a later one."""
        return self.world_size // self.local_size if self.in_blocks else self.world_size

    @property
    def error_rows(self) -> int:
        """Rows of this hop's error buffers: :attr:`rows`, less the own block's :attr:`kept_rows` when ``own`` is
        not -1."""
        return self.rows - (self.kept_rows if self.own >= 0 else 0)

    @property
    def peers(self) -> int:
        """Blocks this hop sends: ``L`` on the first hop when ``L > 1`` (``intra_node``), else the nodes
        (``inter_node``: ``W`` when it is the first hop, ``M`` after ``intra_node``)."""
        if self.in_blocks:
            return self.world_size // self.local_size
        return self.local_size if self.local_size > 1 else self.world_size

    @property
    def kept_rows(self) -> int:
        """Rows of the block this rank sends to itself, :attr:`rows` over :attr:`peers` (as ``Hop.kept_rows``): ``M``
        on ``intra_node``, 1 on ``inter_node``."""
        return self.rows // self.peers

    @property
    def in_kept_rows(self) -> int:
        """Rows of each block received from the previous hop (``M``, the rows ``own_in`` has); 0 on the first hop."""
        return self.world_size // self.local_size if self.in_blocks else 0

    def mean(self) -> "MeanArgs":
        """The arguments of the final mean of the rows this hop sends (the last hop's: ``HopPlan.args(-1, ...)``);
        its ``in_own`` is this hop's ``own``."""
        return MeanArgs(self.world_size, self.bits, self.group_size, self.hadamard, self.grid, in_own=self.own)


@dataclass(frozen=True)
class MeanArgs:
    """Everything the final mean needs besides tensors: ``W`` (the divisor and the partition), the last hop's wire
    ``bits`` and ``group_size``, ``hadamard`` (rotate back) and the ``grid``. ``in_own``: this rank's peer index in
    the last hop, whose received row is replaced by that hop's exact fp32 row (``own_in``), added after the others;
    -1: none."""
    world_size: int
    bits: int
    group_size: int
    hadamard: bool = False
    grid: str = "symmetric"
    in_own: int = -1


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

    def peer_index(self, rank: int, local_size: int) -> int:
        """The index of rank ``rank`` among this hop's peers (its own block's), ``local_size`` ranks per node:
        ``rank % L`` on ``intra_node``, ``rank // L`` on ``inter_node`` (``rank`` itself when ``L == 1``)."""
        return rank % local_size if self.name == INTRA_NODE else rank // local_size

    def wire(self, widths: Sequence[int], group_size: int) -> WireLayout:
        """The byte layout of this hop's send buffer for parameters of padded partition widths ``widths``."""
        return WireLayout(tuple(widths), self.bits, group_size)


@dataclass(frozen=True)
class HopPlan:
    """The ordered hops of a reduce over ``world_size = M * local_size`` ranks (empty for a world of one);
    ``grid`` is the resolved quantization grid of every hop ("symmetric" or "midrise", never "auto");
    ``exact_own_block``: each rank's own block of every hop is kept exact (module docstring).

    Two plans are equal when their layouts are (hops' exchanges are not compared)."""
    world_size: int
    local_size: int
    group_size: int
    hadamard: bool
    grid: str
    hops: Tuple[Hop, ...]
    exact_own_block: bool = False

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.local_size

    def args(self, index: int, err_beta: float, rank: int) -> HopArgs:
        """The kernel arguments of hop ``index`` on rank ``rank`` (the last hop's ``.mean()`` are the final mean's):
        this plan's layout and the error state's ``err_beta``."""
        index = index % len(self.hops)
        hop = self.hops[index]
        previous = self.hops[index - 1] if index > 0 else None
        return HopArgs(self.world_size, self.local_size, hop.bits, self.group_size, err_beta, self.hadamard,
                       self.grid, in_bits=previous.bits if previous else 0, in_blocks=previous.peers if previous else 0,
                       own=self.own_block(hop, rank), in_own=self.own_block(previous, rank) if previous else -1)

    def own_block(self, hop: Hop, rank: int) -> int:
        """The block of ``hop`` that rank ``rank`` keeps exact: its peer index there with ``exact_own_block``,
        else -1 (none)."""
        return hop.peer_index(rank, self.local_size) if self.exact_own_block else -1

    def widths(self, numels: Sequence[int]) -> Tuple[int, ...]:
        """Padded partition widths ``P'`` of gradients of ``numels`` elements."""
        return padded_widths(numels, self.world_size, self.group_size)

    def error_rows(self) -> Mapping[str, int]:
        """Rows of each hop's error buffer (with error feedback), by hop name, in hop order: the partition rows the
        hop quantizes, ``hop.rows``, less its own block's ``hop.kept_rows`` with ``exact_own_block``."""
        return {hop.name: hop.rows - (hop.kept_rows if self.exact_own_block else 0) for hop in self.hops}

    def error_bytes(self, numel: int, storage: ErrorStorage, hops: Iterable[str]) -> int:
        """Bytes of the error buffers of the hops named ``hops``, stored as ``storage``, for a gradient of ``numel``
        elements."""
        cols = padded_partition_size(numel, self.world_size, self.group_size)
        kept = set(hops)
        rows = sum(count for hop, count in self.error_rows().items() if hop in kept)
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
    return HopPlan(world_size, local_size, config.group_size, config.hadamard, grid, tuple(hops),
                   config.exact_own_block)
