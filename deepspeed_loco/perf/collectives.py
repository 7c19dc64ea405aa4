"""Latency-bandwidth cost of the collectives of one ZeRO-3 step, as NCCL runs them (benchmarks/PERFORMANCE.md).

Units: bytes, bytes/s, seconds. Every function returns the time of ONE call.

- All-gather and reduce-scatter: NCCL's ring algorithm (NCCL has no tree for either; PAT, added in NCCL 2.23,
  is used only with one GPU per node). NCCL builds one ring per channel and gives each ring crossing a node
  boundary its own NIC, so all the node's NICs carry the ring together; every rank's link carries
  ``(ranks - 1) / ranks`` of the gathered (or reduced) buffer. Within a node that is each GPU's NVLink; across
  nodes it is the node's NICs, shared by the node's GPUs, which carry the same ``(ranks - 1) / ranks`` of the
  buffer for the whole node (one crossing per ring). The two stages are pipelined, so the slower one sets the
  time. A chunk crosses every edge of the ring once: ``ranks - nodes`` NVLink hops and ``nodes`` network hops.
- All-to-all: NCCL's grouped send/receive, every peer at once; each rank sends ``(peers - 1) / peers`` of its
  buffer off the rank, all concurrent, so one latency and the bandwidth term.
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    """One kind of link: ``bandwidth`` in bytes/s (one direction, as achieved by NCCL), ``latency`` in seconds
    per hop."""
    bandwidth: float
    latency: float


@dataclass(frozen=True)
class Topology:
    """``gpus`` ranks, ``gpus_per_node`` to a node; ``intra`` is one GPU's NVLink, ``inter`` is one node's NICs
    together."""
    gpus: int
    gpus_per_node: int
    intra: Link
    inter: Link

    @property
    def nodes(self) -> int:
        return self.gpus // self.gpus_per_node


def ring_all_gather_s(buffer_bytes: float, topology: Topology) -> float:
    """Seconds of one ring all-gather over all ranks of ``topology`` whose gathered output is ``buffer_bytes``
    per rank."""
    ranks, nodes = topology.gpus, topology.nodes
    if ranks == 1:
        return 0.0
    share = (ranks - 1) / ranks * buffer_bytes
    intra = share / topology.intra.bandwidth
    inter = share / topology.inter.bandwidth if nodes > 1 else 0.0
    latency = (ranks - nodes) * topology.intra.latency + (nodes * topology.inter.latency if nodes > 1 else 0.0)
    return max(intra, inter) + latency


def ring_reduce_scatter_s(buffer_bytes: float, topology: Topology) -> float:
    """Seconds of one ring reduce-scatter over all ranks whose input is ``buffer_bytes`` per rank: the same link
    traffic and hops as the all-gather of that buffer, run backwards."""
    return ring_all_gather_s(buffer_bytes, topology)


def intra_node_all_gather_s(buffer_bytes: float, topology: Topology) -> float:
    """Seconds of one ring all-gather among the GPUs of one node (every node at once, on its own NVLink),
    output ``buffer_bytes`` per rank: hpZ's backward all-gather of the secondary partition."""
    node = Topology(topology.gpus_per_node, topology.gpus_per_node, topology.intra, topology.inter)
    return ring_all_gather_s(buffer_bytes, node)


def all_to_all_s(send_bytes: float, peers: int, bandwidth: float, latency: float) -> float:
    """Seconds of one all-to-all among ``peers`` ranks, each sending ``send_bytes`` in all (its own share
    included, which stays local) over a link of ``bandwidth`` bytes/s per rank."""
    if peers == 1:
        return 0.0
    return (peers - 1) / peers * send_bytes / bandwidth + latency


def intra_node_all_to_all_s(send_bytes: float, topology: Topology) -> float:
    """Hop 1 of the two-hop exchange: all-to-all among the node's GPUs over NVLink."""
    return all_to_all_s(send_bytes, topology.gpus_per_node, topology.intra.bandwidth, topology.intra.latency)


def inter_node_all_to_all_s(send_bytes: float, topology: Topology) -> float:
    """Hop 2: all-to-all among the ``nodes`` GPUs of one local rank, every local rank at once, so each GPU gets
    ``1 / gpus_per_node`` of its node's NICs."""
    share = topology.inter.bandwidth / topology.gpus_per_node
    return all_to_all_s(send_bytes, topology.nodes, share, topology.inter.latency)
