"""The error-feedback state of one rank: every parameter's buffers, the step counter and the reset rule."""
from dataclasses import dataclass
from typing import Iterator, List, Mapping, Optional

import torch

from deepspeed_loco.config import LocoConfig
from deepspeed_loco.ops.error_buffer import ErrorBuffer
from deepspeed_loco.layout import padded_partition_size
from deepspeed_loco.runtime.comm.topology import LocoTopology

PARAM_ATTRIBUTE = "loco_error_feedback"


@dataclass
class ParamErrorFeedback:
    """One parameter's buffers on this rank: ``hop1`` ``(W, P')`` in slot order (None when ``L == 1``) and
    ``hop2`` ``(M, P')`` (None when ``M == 1``); ``P' = roundup(ceil(N / W), group_size)``."""
    hop1: Optional[ErrorBuffer]
    hop2: Optional[ErrorBuffer]

    def buffers(self) -> Iterator[ErrorBuffer]:
        return (b for b in (self.hop1, self.hop2) if b is not None)


class ErrorFeedbackState:
    """Owns LoCo's error-feedback buffers for one rank and one process group.

    The buffers live on the parameters (attribute ``loco_error_feedback``, created on first use) and are
    registered here, which keeps the optimizer-step counter: every ``config.reset_T`` steps all buffers are
    zeroed together. With ``config.error_feedback`` off no buffer is ever created.
    """

    def __init__(self, config: LocoConfig, topology: LocoTopology):
        self.config = config
        self.topology = topology
        self.step = 0
        self.params: List[torch.nn.Parameter] = []

    def for_param(self, param: torch.Tensor, numel: int, device: torch.device) -> Optional[ParamErrorFeedback]:
        """Buffers of ``param`` (whose gradient has ``numel`` elements), allocated as zeros on first use.

        None without error feedback or in a world of one rank.
        """
        topo = self.topology
        if not self.config.error_feedback or topo.world_size == 1:
            return None
        state = getattr(param, PARAM_ATTRIBUTE, None)
        if state is None:
            cols = padded_partition_size(numel, topo.world_size, self.config.group_size)
            make = lambda rows: ErrorBuffer.zeros(rows, cols, self.config.group_size, self.config.error_bits, device)
            state = ParamErrorFeedback(hop1=make(topo.world_size) if topo.local_size > 1 else None,
                                       hop2=make(topo.num_nodes) if topo.num_nodes > 1 else None)
            setattr(param, PARAM_ATTRIBUTE, state)
            self.params.append(param)
        return state

    def buffers(self) -> Iterator[ErrorBuffer]:
        for param in self.params:
            yield from getattr(param, PARAM_ATTRIBUTE).buffers()

    def reset(self) -> None:
        """Zeroes every buffer (the step counter is kept)."""
        for buffer in self.buffers():
            buffer.zero_()

    def rescale(self, factor: float) -> None:
        """Multiplies every buffer by ``factor``: the fp16 loss scale changed by that factor."""
        for buffer in self.buffers():
            buffer.rescale_(factor)

    def on_optimizer_step(self) -> bool:
        """Counts one optimizer step; zeroes all buffers when the count reaches a multiple of ``reset_T``.

        Returns True if this step reset the buffers.
        """
        self.step += 1
        if self.step % self.config.reset_T == 0:
            self.reset()
            return True
        return False

    def memory_bytes(self) -> int:
        """Bytes held by all buffers of this rank."""
        return sum(buffer.nbytes() for buffer in self.buffers())

    def state_dict(self, named_params: Mapping[str, torch.Tensor]) -> dict:
        """This rank's buffers (CPU copies, keyed by parameter name), the step counter and the layout signature;
        format and rules in ``runtime/zero/checkpoint.py`` and ``docs/checkpointing.md``."""
        from deepspeed_loco.runtime.zero import checkpoint
        return checkpoint.state_dict(self, named_params)

    def load_state_dict(self, state_dict: Mapping, named_params: Mapping[str, torch.Tensor]) -> None:
        """Restores a :meth:`state_dict`: checks all of it first (``LocoCheckpointError`` if corrupt,
        ``LocoCheckpointMismatch`` if saved with another layout), then sets the buffers and the step counter."""
        from deepspeed_loco.runtime.zero import checkpoint
        checkpoint.apply_plan(self, checkpoint.parse_state_dict(self, state_dict, named_params))
