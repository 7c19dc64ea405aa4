"""In-process all-to-all among virtual ranks that run in threads of one process."""
import threading
from typing import List, Optional

import torch

TIMEOUT_S = 600.0  # a peer that never arrives (it raised) breaks the barrier instead of hanging the others


class InProcessAllToAll:
    """One hop's all-to-all among ``peers`` virtual ranks, each calling :meth:`member` ``(index)`` from its own
    thread: the same contract as ``all_to_all_single`` (block ``i`` of a peer's send buffer goes to peer ``i``)."""

    def __init__(self, peers: int):
        self.peers = peers
        self._barrier = threading.Barrier(peers, timeout=TIMEOUT_S)
        self._sends: List[Optional[torch.Tensor]] = [None] * peers

    def member(self, index: int):
        """The :class:`~deepspeed_loco.layout.Exchange` of peer ``index``."""
        return lambda send: self._exchange(index, send)

    def abort(self) -> None:
        """Releases every peer waiting here with ``threading.BrokenBarrierError`` (a peer failed)."""
        self._barrier.abort()

    def _exchange(self, index: int, send: torch.Tensor) -> torch.Tensor:
        self._sends[index] = send
        self._barrier.wait()  # every peer's send buffer is in place
        rows = send.shape[0] // self.peers
        recv = torch.cat([peer[index * rows:(index + 1) * rows] for peer in self._sends])
        self._barrier.wait()  # every peer has read its blocks: the send buffers may be reused
        return recv
