"""The LoCo reduce-scatter of a bucket of gradients: the hop plan's quantized all-to-alls with error feedback."""
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Protocol, Sequence, Tuple

import torch
from torch.profiler import record_function

from deepspeed_loco.config import LocoConfig
from deepspeed_loco.layout import Hop, HopPlan, WireLayout, plan_hops
from deepspeed_loco.ops import kernels_for
from deepspeed_loco.runtime.comm.error_feedback import ErrorFeedbackState
from deepspeed_loco.utils.logging import logger


@dataclass
class WireStats:
    """What this rank put on each hop's wire, keyed by hop name; its own block, which stays local, is not counted.

    ``bytes``: packed values and their fp32 scales sent. ``elements``: the gradient values those bytes carry,
    partition padding included, so ``bytes_per_element(name)`` is the hop's cost, ``bits / 8 + 4 / group_size``
    (:func:`~deepspeed_loco.layout.wire_bytes_per_element`). ``reduces``: buckets reduced.
    """
    bytes: Dict[str, int] = field(default_factory=dict)
    elements: Dict[str, int] = field(default_factory=dict)
    reduces: int = 0

    def sent(self, hop: Hop, wire: WireLayout) -> None:
        """Counts the rows of ``wire`` that ``hop`` sends to other ranks."""
        self.bytes[hop.name] = self.bytes.get(hop.name, 0) + hop.sent_rows * wire.row_bytes
        self.elements[hop.name] = self.elements.get(hop.name, 0) + hop.sent_rows * wire.columns

    def bytes_per_element(self, name: str) -> float:
        """Bytes per element sent on hop ``name``'s wire; 0.0 while nothing was sent on it."""
        elements = self.elements.get(name, 0)
        return self.bytes.get(name, 0) / elements if elements else 0.0

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())


RANGE_PREFIX = "deepspeed_loco."  # every profiler range of the reduce starts with this


def profiler_range(hop: Optional[str], step: str) -> str:
    """The ``torch.profiler`` range around one step of a reduce: ``deepspeed_loco.<hop>.<step>``, or
    ``deepspeed_loco.<step>`` for the final mean (``hop`` None). ``step`` is a kernel entry point
    (``quantize_bucket_``, ``requantize_bucket_``, ``final_mean_bucket``) or ``all_to_all`` (the hop's exchange)."""
    return f"{RANGE_PREFIX}{hop}.{step}" if hop else f"{RANGE_PREFIX}{step}"


class ReduceProbe(Protocol):
    """What the reduces of a measured step report to (the live rho's
    :class:`~deepspeed_loco.runtime.comm.noise_stats.ReduceSums` is one): the reducer knows only this interface."""

    def stats(self, device) -> Tuple[Sequence[Optional[torch.Tensor]], Optional[torch.Tensor]]:
        """Per hop the ``stats`` tensor its kernel adds to (or None), and the final mean's: kept on ``device``."""

    def inputs(self, names: Sequence[str], grads: Sequence[torch.Tensor],
               gather: Callable[..., torch.Tensor]) -> Any:
        """Called with a bucket's gradients before its first hop (``gather``: the kernels' ``gather_sample``);
        returns what :meth:`outputs` is given for the same bucket. No host synchronization."""

    def outputs(self, token: Any, means: Sequence[torch.Tensor]) -> None:
        """Called with the bucket's mean partitions after its final mean. No host synchronization."""


class LocoReducer:
    """Reduce-scatters buckets of full gradients to this rank's ZeRO-3 partitions of their mean.

    ``reduce_scatter`` returns, per parameter, ``ceil(N / W)`` elements (zero past ``N``) of the mean over the
    ``W`` ranks, in the gradient's dtype: the quantity and layout of DeepSpeed's reduce-scatter path. A bucket
    costs one all-to-all per hop of the plan whatever its number of parameters. Each kernel call and each exchange
    runs inside a ``torch.profiler`` range named by :func:`profiler_range`, so a profile groups their time per hop
    (``benchmarks/gpu_e2e.py``).

    With the plan's ``exact_own_block`` each hop hands this rank's own block, exact, to the next hop or the final
    mean in a bucket's fp32 own buffer ``(kept rows, sum of the padded widths)`` (about ``N_bucket / L`` values after
    the intra-node hop, ``N_bucket / W`` after the last hop), allocated per bucket and dropped once the next step has
    added it. :class:`WireStats` never counted own blocks, so it is the same either way.

    ``plan``: the hops, with this rank's exchanges; ``state``: the error buffers and the algorithm's settings
    (``err_beta`` goes from it into every hop's kernel arguments), built for the same plan (ValueError otherwise);
    ``rank``: this rank's index in the group. :meth:`for_topology` builds all three.

    A measured optimizer step (the live rho's, :mod:`deepspeed_loco.runtime.comm.noise_stats`) lies between
    :meth:`begin_measured_step` and :meth:`end_measured_step`: its reduces report to the step's
    :class:`ReduceProbe` (the ops' ``stats`` outputs, the buckets' gradients and means); outside one nothing of the
    kind is computed.
    """

    def __init__(self, plan: HopPlan, state: ErrorFeedbackState, rank: int):
        if state.plan != plan:
            raise ValueError(f"LocoReducer: the error-feedback state belongs to another plan ({state.plan}) than the "
                             f"reducer's ({plan}); build the state from the reducer's plan")
        self.plan = plan
        self.state = state
        self.rank = rank
        self.stats = WireStats()
        self._probe: Optional[ReduceProbe] = None  # the measured step's, between begin and end
        self._touched = False

    @classmethod
    def for_topology(cls, config: LocoConfig, topology, layout: Optional[HopPlan] = None) -> "LocoReducer":
        """The reducer of rank ``topology.rank`` with a fresh :class:`ErrorFeedbackState` of ``config``.

        ``layout``: the plan of ``config`` on the topology's ``W`` and ``L`` (:func:`~deepspeed_loco.layout.plan_hops`),
        built here when None (a simulated cluster builds it once for all its ranks); the reducer's plan is that
        layout with the topology's exchanges (``topology.exchanges``, by hop name).
        """
        if layout is None:
            layout = plan_hops(topology.world_size, topology.local_size, config)
        plan = layout.with_exchanges(topology.exchanges)
        return cls(plan, ErrorFeedbackState(config, plan), topology.rank)

    @property
    def measuring(self) -> bool:
        """Whether a measured step has begun and not ended: the reduces add their noise statistics."""
        return self._probe is not None

    def begin_measured_step(self, probe: ReduceProbe) -> None:
        """From now until :meth:`end_measured_step`, every reduce reports to ``probe``. RuntimeError while a
        measured step is open already."""
        if self._probe is not None:
            raise RuntimeError(f"LoCo reduce: rank {self.rank} began a measured step inside another one; end that "
                               f"one first (end_measured_step)")
        self._probe = probe

    def end_measured_step(self) -> ReduceProbe:
        """Ends the measured step and returns its probe. RuntimeError without :meth:`begin_measured_step`."""
        if self._probe is None:
            raise RuntimeError(f"LoCo reduce: rank {self.rank} ended a measured step it never began "
                               f"(begin_measured_step)")
        probe, self._probe = self._probe, None
        return probe

    @torch.no_grad()
    def reduce_scatter(self, names: Sequence[str], grads: Iterable[torch.Tensor]) -> List[torch.Tensor]:
        """The gradients ``grads`` of the parameters named ``names`` to this rank's mean partitions; the state keeps
        each parameter's error buffers under its name, so a name must always stand for the same parameter.

        The reducer holds its own references to the gradients only until the first hop has quantized them: a caller
        that holds none (the simulated cluster's ``stream``) lets them be freed while the later hops wait."""
        grads = list(grads)
        if len(names) != len(grads):
            raise ValueError(f"LoCo reduce: {len(names)} parameter names for {len(grads)} gradients")
        _check_gradients(names, grads)
        if len({(g.dtype, g.device) for g in grads}) > 1:
            raise TypeError("LoCo reduce: the gradients of one bucket must share one dtype and device, got "
                            f"{sorted({f'{g.dtype} on {g.device}' for g in grads})}")
        if not self.plan.hops:
            return [g.reshape(-1).clone() for g in grads]
        self._touched = False
        try:
            return self._reduce_scatter(names, grads)
        except BaseException as exc:
            # a bucket's buffers may be half-updated: fall back to the state a fresh run starts from
            if self._touched:
                self.state.reset()
                logger.warning(f"deepspeed-loco: rank {self.rank}: {type(exc).__name__} during a LoCo "
                               f"reduce; all error-feedback buffers of this rank were reset to zero")
            raise

    def _reduce_scatter(self, names: Sequence[str], grads: List[torch.Tensor]) -> List[torch.Tensor]:
        """``grads``: this call's own list, emptied once the first hop has quantized the gradients."""
        plan, err_beta = self.plan, self.state.err_beta
        self.stats.reduces += 1
        numels, dtype, device = [g.numel() for g in grads], grads[0].dtype, grads[0].device
        kernels = kernels_for(device, self.state.config.kernels)
        widths = plan.widths(numels)
        buffers = [self.state.buffers_for(n, g.numel(), g.device) for n, g in zip(names, grads)]
        self._touched = any(b is not None for b in buffers)  # the kernels below update the buffers in place
        recv = wire = own = None  # own: the previous hop's exact own block (exact_own_block), else None
        probe = self._probe
        hop_stats, mean_stats = probe.stats(device) if probe is not None else ([None] * len(plan.hops), None)
        token = probe.inputs(names, grads, kernels.gather_sample) if probe is not None else None
        for index, hop in enumerate(plan.hops):
            errors = [b.get(hop.name) if b else None for b in buffers]  # a hop keeps error for all or none
            args, in_wire, wire = plan.args(index, err_beta, self.rank), wire, hop.wire(widths, plan.group_size)
            send = wire.empty(hop.rows, device)
            own_in, own = own, _own_buffer(args.own, hop.kept_rows, wire.columns, device)
            if index == 0:
                with record_function(profiler_range(hop.name, "quantize_bucket_")):
                    kernels.quantize_bucket_(grads, errors, args, wire, send, hop_stats[index], own)
                grads.clear()  # the full gradients are on the wire: let them go before the exchanges
            else:
                with record_function(profiler_range(hop.name, "requantize_bucket_")):
                    kernels.requantize_bucket_(recv, in_wire, errors, args, wire, send, hop_stats[index], own_in,
                                               own)
            own_in = None  # the previous hop's own block is in this hop's sum: let it go
            if hop.exchange is None:
                raise RuntimeError(f"LoCo reduce: hop {hop.name!r} has no exchange (a topology without process "
                                   f"groups cannot reduce)")
            with record_function(profiler_range(hop.name, "all_to_all")):
                recv = hop.exchange(send)
            self.stats.sent(hop, wire)
        with record_function(profiler_range(None, "final_mean_bucket")):
            means = kernels.final_mean_bucket(recv, wire, args.mean(), numels, self.rank, dtype, mean_stats, own)
        if probe is not None:
            probe.outputs(token, means)
        return means


def _own_buffer(own: int, rows: int, columns: int, device) -> Optional[torch.Tensor]:
    """A bucket's fp32 own buffer ``(rows, columns)`` (the own block a hop keeps exact, every parameter's columns as
    on the wire) when ``own`` is a block index, None when it is -1."""
    return torch.empty(rows, columns, dtype=torch.float32, device=device) if own >= 0 else None


def _check_gradients(names: Sequence[str], grads: Sequence[torch.Tensor]) -> None:
    """Every gradient present and of a supported dtype (in a function of its own: no loop variable outlives it)."""
    for name, grad in zip(names, grads):
        if grad is None:
            raise ValueError(f"LoCo reduce: parameter {name} has no gradient to reduce")
        if grad.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"LoCo reduce: gradient of {name} is {grad.dtype}; "
                            f"supported are float32, float16 and bfloat16")
