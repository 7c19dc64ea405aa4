"""LoCo's telemetry, written through DeepSpeed's own monitor (``engine.monitor``).

When the ds_config enables a DeepSpeed monitor (``tensorboard``, ``wandb``, ``csv_monitor``, ``comet``), global
rank 0 writes after optimizer steps, with the optimizer step (1-based, the count ``reset_T`` uses) as x. On every
``every``-th step (``telemetry_every``; 1: every step), over the steps since its previous such write:

* ``LoCo/<hop>_bytes`` (``intra_node``, ``inter_node``: the hops the layout has): bytes this rank put on that
  hop's all-to-all per optimizer step (all micro-steps), values and fp32 scales;
* ``LoCo/bytes_vs_full_precision``: those bytes over what a full-precision reduce-scatter of the same gradients
  sends per rank, ``(W - 1) / W * N * element bytes`` (``N``: gradient elements reduced, unpadded);
* ``LoCo/reset``: how many of those steps cleared the error buffers (every ``reset_T`` steps, or an fp16
  overflow): with ``every`` 1, 1.0 on a step that cleared them, else 0.0.

On their own steps:

* ``LoCo/error_rel_norm`` (error feedback on; on the measured steps only, every ``error_norm_every``-th, by default
  ``rho_every``'s): ``||e|| / ||g||``, ``e`` the error buffers of the reduced parameters right after each reduce
  (read without dequantizing them: :mod:`deepspeed_loco.ops.squared_sums`), ``g`` the gradients this rank fed into
  those reduces; sums of squares over all reduces of the step;
* at the steps the live rho measures (``rho_every``; :mod:`deepspeed_loco.runtime.comm.noise_stats`), its moving
  estimate: ``LoCo/rho`` (total), ``LoCo/rho_<hop>`` per hop, ``LoCo/rho_spread`` (standard error; from the
  second measurement) and ``LoCo/noise_scale`` (gradient noise scale in samples, while resolved); written when the
  estimate arrives (on a GPU usually one step later: the live rho does not synchronize) with its measured step as x.

A step with nothing to write calls no monitor (some, like the csv monitor, open a file per event).

The telemetry object is one of the hook's reduce observers (:meth:`LocoHook.add_reduce_observer`) and one of its
step listeners (:meth:`LocoHook.add_step_listener`), after the live rho, whose fresh estimate it reads. Without an
enabled monitor, and on every other rank, no telemetry object exists: nothing observes the reduce or the step.

Off the hot path: the byte counts are host integers the reducer keeps anyway; the squared sums of the error norm are
computed on the measured steps only (:mod:`deepspeed_loco.ops.squared_sums`: a few launches per 16M values read,
whatever the number of parameters, and no error buffer dequantized), kept on the gradients' device, and read once at
the step's end (the one host synchronization the telemetry makes, on a measured step only); other steps read no
error buffer.
"""
import math
from typing import Dict, List, Optional, Sequence

import torch

from deepspeed_loco.ops.squared_sums import error_squared_sum, squared_sum
from deepspeed_loco.runtime.comm.noise_stats import LiveRho, RhoEstimate
from deepspeed_loco.runtime.zero import deepspeed_seam

PREFIX = "LoCo/"


def hop_bytes(reducer) -> Dict[str, int]:
    """Bytes this rank has sent on each hop of the reducer's plan since start-up, keyed by hop name: the one reader
    of the reducer's counters."""
    return {hop.name: reducer.stats.bytes.get(hop.name, 0) for hop in reducer.plan.hops}


class LocoTelemetry:
    """Accumulates one optimizer step's figures from the reduces, and writes them to ``monitor`` at the step, with
    the live rho's estimate when ``live_rho`` (a :class:`~deepspeed_loco.runtime.comm.noise_stats.LiveRho`, told of
    the step before this object) updated it at that step. ``error_norm_every``: the error norm's measured steps
    (every so many optimizer steps, 1-based; 0: never); ``next_step``: the optimizer step the next reduces belong to
    (a resumed run's); ``every``: the byte counts' and resets' steps (``telemetry_every``)."""

    def __init__(self, monitor, reducer, world_size: int, error_feedback, live_rho: Optional[LiveRho] = None,
                 error_norm_every: int = 1, next_step: int = 1, every: int = 1):
        if every < 1:
            raise ValueError(f"LocoTelemetry: every {every} must be >= 1 (zeropp_loco_param.telemetry_every)")
        self.monitor = monitor
        self.reducer = reducer
        self.live_rho = live_rho
        self.world_size = world_size
        self.error_feedback = bool(error_feedback)
        self.error_norm_every = error_norm_every
        self.every = every
        self._sent_before = hop_bytes(reducer)
        self._full_precision_bytes = 0.0
        self._steps = 0  # optimizer steps since the byte counts were last written, and the resets among them
        self._resets = 0
        self._squares: List[torch.Tensor] = []  # per reduce of a measured step: fp64 (2,) [||g||^2, ||e||^2]
        self._measuring = self._measured(next_step)

    def _measured(self, step: int) -> bool:
        """Whether optimizer step ``step`` writes the error norm (and so its reduces read the error buffers)."""
        return self.error_feedback and self.error_norm_every > 0 and step % self.error_norm_every == 0

    @torch.no_grad()
    def on_reduce(self, names: Sequence[str], grads: Sequence[torch.Tensor],
                  partitions: Sequence[torch.Tensor]) -> None:
        """Counts one reduced bucket, the gradients ``grads`` of the parameters ``names`` (a reduce observer: called
        after the reduce, so that the buffers, read through the reducer's error state, hold its error;
        ``partitions`` are not used). On a measured step it adds the bucket's squared sums on the device, with no
        host synchronization; on other steps it reads no tensor."""
        self._full_precision_bytes += (self.world_size - 1) / self.world_size * sum(
            g.numel() * g.element_size() for g in grads)
        if self._measuring and grads:
            device = grads[0].device
            errors = [b for name in names for b in self.reducer.state.buffers_of(name).values()]
            self._squares.append(torch.stack([squared_sum(grads, device), error_squared_sum(errors, device)]))

    def on_step(self, step: int, reset: bool) -> None:
        """After optimizer step ``step`` (``reset``: it cleared the error buffers; a step listener): writes what is
        due at this step (the module docstring) in one call of the monitor, and starts the next step's counts."""
        rho = self.live_rho.fresh if self.live_rho is not None else None
        self._steps += 1
        self._resets += int(reset)
        events = []
        if step % self.every == 0:
            sent_now = hop_bytes(self.reducer)
            sent = {hop: sent_now[hop] - self._sent_before.get(hop, 0) for hop in sent_now}
            events += [(f"{PREFIX}{hop}_bytes", count / self._steps, step) for hop, count in sent.items()]
            ratio = sum(sent.values()) / self._full_precision_bytes if self._full_precision_bytes else 0.0
            events.append((f"{PREFIX}bytes_vs_full_precision", ratio, step))
            events.append((f"{PREFIX}reset", float(self._resets), step))
            self._sent_before, self._full_precision_bytes, self._steps, self._resets = sent_now, 0.0, 0, 0
        if self._measuring:
            grad_sq, error_sq = torch.stack(self._squares).sum(0).tolist() if self._squares else (0.0, 0.0)
            events.append((f"{PREFIX}error_rel_norm", (error_sq / grad_sq)**0.5 if grad_sq else 0.0, step))
        if rho is not None:
            events += rho_events(rho, self.live_rho.fresh_step)
        if events:
            self.monitor.write_events(events)
        self._squares = []
        self._measuring = self._measured(step + 1)


def rho_events(rho: RhoEstimate, step: int):
    """The monitor events of a live-rho estimate at optimizer step ``step`` (the module docstring's names); a
    figure not resolved yet (NaN rho, no spread, no noise scale) is left out."""
    figures = {"rho": rho.rho, "rho_spread": rho.rho_spread, "noise_scale": rho.noise_scale,
               **{f"rho_{hop}": value for hop, value in rho.hop_rho.items()}}
    return [(f"{PREFIX}{name}", float(value), step) for name, value in figures.items()
            if value is not None and math.isfinite(value)]


def rank0_monitor(engine):
    """The monitor the telemetry writes to: ``engine``'s DeepSpeed monitor on global rank 0 when one is enabled;
    None otherwise (no telemetry)."""
    monitor = deepspeed_seam.engine_monitor(engine)
    return monitor if monitor is not None and torch.distributed.get_rank() == 0 else None
