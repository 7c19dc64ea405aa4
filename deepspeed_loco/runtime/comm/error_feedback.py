"""The error-feedback state of one rank: every parameter's buffers (one per hop, by hop name), the step counter
and the reset rule."""
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from deepspeed_loco.config import LocoConfig
from deepspeed_loco.layout import HopPlan
from deepspeed_loco.ops.error_buffer import ErrorBuffer

PARAM_ATTRIBUTE = "loco_error_feedback"


class ErrorFeedbackState:
    """Owns LoCo's error-feedback buffers for one rank and one hop plan.

    A parameter's buffers are a dict ``{hop name: ErrorBuffer}`` in hop order, each ``(hop.rows, P')`` with
    ``P' = roundup(ceil(N / W), group_size)`` (the first hop's rows in slot order). They live on the parameter
    (attribute ``loco_error_feedback``, created on first use) and are registered here, which keeps the
    optimizer-step counter: every ``config.reset_T`` steps all buffers are zeroed together. With
    ``config.error_feedback`` off, or a plan without hops, no buffer is ever created.
    """

    def __init__(self, config: LocoConfig, topology):
        self.config = config
        self.plan: HopPlan = topology.plan(config)
        self.step = 0
        self.params: List[torch.nn.Parameter] = []

    def for_param(self, param: torch.Tensor, numel: int, device: torch.device) -> Optional[Dict[str, ErrorBuffer]]:
        """Buffers of ``param`` (whose gradient has ``numel`` elements), allocated as zeros on first use; None
        without error feedback or in a world of one rank."""
        rows = self.plan.error_rows()
        if not rows:
            return None
        buffers = getattr(param, PARAM_ATTRIBUTE, None)
        if buffers is None:
            cols = self.plan.widths([numel])[0]
            buffers = {name: ErrorBuffer.zeros(count, cols, self.plan.group_size, self.plan.error_bits, device)
                       for name, count in rows.items()}
            setattr(param, PARAM_ATTRIBUTE, buffers)
            self.params.append(param)
        return buffers

    def named_buffers(self) -> Iterator[Tuple[torch.nn.Parameter, str, ErrorBuffer]]:
        """``(parameter, hop name, buffer)`` for every buffer, in registration and hop order."""
        for param in self.params:
            for name, buffer in getattr(param, PARAM_ATTRIBUTE).items():
                yield param, name, buffer

    def buffers(self) -> Iterator[ErrorBuffer]:
        return (buffer for _, _, buffer in self.named_buffers())

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
