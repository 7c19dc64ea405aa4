"""The error-feedback state of one rank: the algorithm's settings, every parameter's buffers (one per hop, by hop
name, keyed by the parameter's name), the step counter and the reset rule."""
from typing import Any, Dict, Iterator, Mapping, Optional, Tuple

from deepspeed_loco.config import LocoConfig
from deepspeed_loco.layout import INTER_NODE, ErrorStorage, HopPlan, plan_hops
from deepspeed_loco.ops.error_buffer import ErrorBuffer


def hops_with_error(plan: HopPlan, error_feedback) -> Tuple[str, ...]:
    """The names of ``plan``'s hops that keep an error buffer for ``zeropp_loco_param.error_feedback``: every hop
    (True), none (False) or the inter-node hop alone (``"inter_node"``; none with one node, which has no such hop)."""
    if error_feedback is True:
        return tuple(hop.name for hop in plan.hops)
    if error_feedback == INTER_NODE:
        return tuple(hop.name for hop in plan.hops if hop.name == INTER_NODE)
    return ()


def error_bytes_per_parameter(world_size: int, local_size: int, config: LocoConfig) -> float:
    """Bytes of error state one rank holds per parameter of the model for ``config`` on ``world_size`` ranks,
    ``local_size`` per node, for large tensors (their partitions' padding to whole groups left out): over the hops
    that keep error, ``error rows / W`` values per parameter (:meth:`HopPlan.error_rows`: ``W`` and ``M``, or
    ``W - M`` and ``M - 1`` with ``exact_own_block``) times the storage's bytes per value, scales included."""
    state = ErrorFeedbackState(config, plan_hops(world_size, local_size, config))
    group = config.group_size
    return sum(state.rows().values()) / world_size * state.storage.row_bytes(group, group) / group


def error_feedback_off_reason(plan: HopPlan, error_feedback) -> Optional[str]:
    """Why error feedback asked for by ``error_feedback`` keeps no buffer on ``plan``'s layout, or None when it
    keeps one (or was not asked for): a world of one rank, or ``"inter_node"`` on one node."""
    if error_feedback is False or hops_with_error(plan, error_feedback):
        return None
    if not plan.hops:
        return "a world of one rank has no hop to compensate"
    return (f'error_feedback "{INTER_NODE}" on one node: there is no inter-node hop, so no hop keeps error and '
            f"this run is plain qgZ; error_feedback: true compensates the intra-node hop")


class ErrorFeedbackState:
    """Owns LoCo's error-feedback buffers for one rank and one hop plan, and the settings of the algorithm.

    ``plan`` is the layout (built once by the caller and shared with the
    :class:`~deepspeed_loco.runtime.comm.loco_reduce.LocoReducer` that updates these buffers); ``config`` gives the
    settings: ``err_beta`` (passed to every hop's kernel arguments), ``error_feedback``, ``error_bits`` (int8 or
    fp32 storage) and ``reset_T``.

    A parameter's buffers are a dict ``{hop name: ErrorBuffer}`` in hop order, each ``(error rows, P')`` with
    ``P' = roundup(ceil(N / W), group_size)`` and the hop's error rows of :meth:`HopPlan.error_rows` (``hop.rows``,
    less the own block's rows with ``exact_own_block``; the first hop's rows in slot order), held here under the
    parameter's name (a name must always stand for the same parameter), created as zeros on first use. Nothing is
    stored on the parameters. Every ``reset_T`` optimizer steps all buffers are zeroed together. With
    ``error_feedback`` off, or a plan without hops, no buffer is ever created.
    """

    def __init__(self, config: LocoConfig, plan: HopPlan):
        self.config = config
        self.plan = plan
        self.step = 0
        kept = hops_with_error(plan, config.error_feedback)  # the plan and the config are frozen: derived once
        self._rows: Dict[str, int] = {hop: rows for hop, rows in plan.error_rows().items() if hop in kept}
        self._buffers: Dict[str, Dict[str, ErrorBuffer]] = {}
        self._numels: Dict[str, int] = {}

    @property
    def err_beta(self) -> float:
        return self.config.err_beta

    @property
    def error_feedback(self):
        """``zeropp_loco_param.error_feedback``: True (every hop), False (none) or ``"inter_node"``."""
        return self.config.error_feedback

    @property
    def error_bits(self) -> int:
        return self.config.error_bits

    @property
    def storage(self) -> ErrorStorage:
        """How the buffers are stored (``error_bits`` are its bits)."""
        return ErrorStorage.of_bits(self.config.error_bits)

    def rows(self) -> Mapping[str, int]:
        """Error-buffer rows per hop name, of the hops that keep error (``error_feedback``: every hop, none, or only
        ``inter_node``); empty without error feedback."""
        return self._rows

    @property
    def hops_with_error(self) -> Tuple[str, ...]:
        """Names of the plan's hops that keep an error buffer, in hop order (``error_feedback``)."""
        return tuple(self._rows)

    def planned_bytes(self, numel: int) -> int:
        """Error-buffer bytes this rank will hold for a gradient of ``numel`` elements (0 without buffers)."""
        return self.plan.error_bytes(numel, self.storage, self._rows)

    def buffers_for(self, name: str, numel: int, device) -> Optional[Dict[str, ErrorBuffer]]:
        """Buffers of parameter ``name`` (whose gradient has ``numel`` elements), allocated as zeros on ``device``
        on first use; None without error feedback or in a world of one rank. Raises ValueError if ``name`` was
        first used with another ``numel``."""
        rows = self.rows()
        if not rows:
            return None
        if name not in self._buffers:
            cols = self.plan.widths([numel])[0]
            self._buffers[name] = {hop: ErrorBuffer.zeros(count, cols, self.plan.group_size, self.storage, device)
                                   for hop, count in rows.items()}
            self._numels[name] = numel
        elif self._numels[name] != numel:
            raise ValueError(f"LoCo error feedback: parameter {name!r} has {self._numels[name]} elements, got a "
                             f"gradient of {numel}; a name must always stand for the same parameter")
        return self._buffers[name]

    def buffers_of(self, name: str) -> Mapping[str, ErrorBuffer]:
        """Parameter ``name``'s buffers by hop name, as they are (empty before its first use or without error
        feedback); allocates nothing."""
        return self._buffers.get(name, {})

    def names(self) -> Tuple[str, ...]:
        """Names of the parameters that hold buffers, in the order they were first used."""
        return tuple(self._buffers)

    def named_buffers(self) -> Iterator[Tuple[str, str, ErrorBuffer]]:
        """``(parameter name, hop name, buffer)`` for every buffer, in first-use and hop order."""
        for name, buffers in self._buffers.items():
            for hop, buffer in buffers.items():
                yield name, hop, buffer

    def buffers(self) -> Iterator[ErrorBuffer]:
        return (buffer for _, _, buffer in self.named_buffers())

    def state_dict(self) -> Dict[str, Any]:
        """The step and every buffer as CPU copies, all at once: ``{"step": int, "params": {name: {"numel": int,
        "buffers": {hop name: {"values": int8|uint8|fp32 (rows, P' or P'/2), "scale": fp32 (rows, P'/group) |
        None}}}}}``. Checkpoints do not use it: they stream the buffers through a bounded host buffer
        (``runtime/zero/checkpoint.py``)."""
        copy = lambda t: None if t is None else t.detach().to("cpu", copy=True)
        return {"step": self.step, "params": {
            name: {"numel": self._numels[name],
                   "buffers": {hop: {"values": copy(b.values), "scale": copy(b.scale)} for hop, b in buffers.items()}}
            for name, buffers in self._buffers.items()}}

    def load_state_dict(self, state: Mapping[str, Any], devices: Optional[Mapping[str, Any]] = None) -> None:
        """Makes this state exactly ``state`` (a :meth:`state_dict` of a state with the same plan and settings; the
        checkpoint module checks a saved one first): every buffer zeroed, the saved ones copied in, the step set.
        A parameter without buffers yet gets them on ``devices[name]`` (default the CPU)."""
        self.reset()
        for name, entry in state["params"].items():
            buffers = self.buffers_for(name, entry["numel"], (devices or {}).get(name, "cpu"))
            for hop, saved in entry["buffers"].items():
                buffers[hop].values.copy_(saved["values"])
                if buffers[hop].scale is not None:
                    buffers[hop].scale.copy_(saved["scale"])
        self.step = int(state["step"])

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
