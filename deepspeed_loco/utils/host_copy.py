"""A device tensor read on the host without a synchronization: :class:`HostCopy` starts the copy and says when it
has landed, so that a reader polls it on a later step instead of draining the device's queue now; :class:`Landing`
hands such copies back in order as they land."""
from collections import deque
from typing import Any, Deque, List, Tuple

import torch


class HostCopy:
    """The host copy of ``tensor`` (any shape and dtype). On a CUDA device it goes into pinned memory behind an event
    (no host synchronization; :meth:`ready` polls the event); elsewhere it is made at once (and always ready). It
    holds the values ``tensor`` had when the copy was made, whatever later work does to ``tensor``."""

    def __init__(self, tensor: torch.Tensor):
        if tensor.device.type == "cuda":
            with torch.cuda.device(tensor.device):  # the copy and its event on the tensor's device's current stream
                self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                self._host.copy_(tensor, non_blocking=True)
                self._event = torch.cuda.Event()
                self._event.record()
        else:
            self._host, self._event = tensor.to("cpu", copy=True), None

    def ready(self) -> bool:
        """Whether the copy has landed (never blocks)."""
        return self._event is None or self._event.query()

    def result(self) -> torch.Tensor:
        """The host tensor, waiting for the copy if it has not landed yet."""
        if self._event is not None:
            self._event.synchronize()
        return self._host


class Landing:
    """Host copies on their way (:class:`HostCopy` or any object with ``ready()`` and ``result()``), each under a key,
    handed back in the order they were added once landed; at most ``in_flight`` stay waiting behind one another (an
    older one beyond them is waited for), so a reader that is never told "ready" still gets every copy in turn."""

    def __init__(self, in_flight: int = 1):
        if in_flight < 1:
            raise ValueError(f"Landing: in_flight {in_flight} must be >= 1")
        self.in_flight = in_flight
        self._queue: Deque[Tuple[Any, HostCopy]] = deque()

    def add(self, key, copy: HostCopy) -> None:
        self._queue.append((key, copy))

    def landed(self) -> List[Tuple[Any, torch.Tensor]]:
        """``(key, host tensor)`` of every copy that has landed, oldest first, stopping at the first still on its
        way unless more than ``in_flight`` are waiting."""
        out = []
        while self._queue and (self._queue[0][1].ready() or len(self._queue) > self.in_flight):
            key, copy = self._queue.popleft()
            out.append((key, copy.result()))
        return out
