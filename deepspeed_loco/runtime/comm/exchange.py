"""The all-to-all of a hop over a ``torch.distributed`` process group (the exchange real runs use)."""
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ProcessGroupExchange:
    """:class:`~deepspeed_loco.layout.Exchange` over ``group``: one ``all_to_all_single`` of the send buffer."""
    group: dist.ProcessGroup

    def __call__(self, send: torch.Tensor) -> torch.Tensor:
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        return recv
