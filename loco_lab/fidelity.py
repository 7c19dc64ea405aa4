"""Gradient fidelity: how far the communicated (reduced) gradient is from the exact mean, per step and summed.

``GradientFidelity.attach(engine)`` registers an observer of the ZeRO-3 optimizer's bucket reduce
(``deepspeed_loco.add_reduce_observer``: LoCo's hook for the qgZ arms, DeepSpeed's own reduce for the
full-precision arm). For every bucket it also computes the exact mean of the same gradients with a float64
all-reduce, and keeps, for this rank's partitions:

* per step: ``||out - exact|| / ||exact||`` over the whole model (all ranks);
* running sums ``S_out = sum_t out_t`` and ``S_exact``: ``||S_out - S_exact|| / ||S_exact||`` after every step.
  Error feedback exists to keep this one small: the bias that plain quantization leaves accumulates here.

Works the same for the full-precision arm (whose error is fp32 rounding), so every arm is measured alike. The
time it spends is measured and excluded from the reported step time.
"""
import math
import time
from typing import Dict, List, Sequence

import torch
import torch.distributed as dist

import deepspeed_loco
from deepspeed_loco.runtime.zero import deepspeed_seam


class GradientFidelity:
    """The fidelity figures of one engine's reduces: ``on_reduce`` per bucket (the observer), ``after_step`` per
    optimizer step, ``summary`` at the end."""

    def __init__(self, group):
        self.group = group  # the data-parallel group: the exact mean and the step's totals are all-reduced over it
        self.sums: Dict[str, List[torch.Tensor]] = {}
        self.step_err = self.step_ref = 0.0
        self.step_errors: List[float] = []
        self.sum_errors: List[float] = []
        self.calls = 0
        self.overhead_s = 0.0  # wall time spent measuring (exact all-reduce and bookkeeping)

    @classmethod
    def attach(cls, engine) -> "GradientFidelity":
        """A probe observing every bucket reduce of ``engine`` from now on."""
        probe = cls(deepspeed_seam.data_parallel_group(engine.optimizer))
        deepspeed_loco.add_reduce_observer(engine, probe.on_reduce)
        return probe

    @torch.no_grad()
    def on_reduce(self, names: Sequence[str], grads: Sequence[torch.Tensor], outs: Sequence[torch.Tensor]) -> None:
        """Measures one bucket: the reduce's partitions ``outs`` against the exact mean of ``grads``."""
        t0 = time.perf_counter()
        world = dist.get_world_size(self.group)
        rank = dist.get_rank(self.group)
        flat = torch.cat([g.reshape(-1).double() for g in grads])
        dist.all_reduce(flat, group=self.group)
        flat /= world
        exact, offset = [], 0
        for g in grads:
            exact.append(flat[offset:offset + g.numel()])
            offset += g.numel()
        self.calls += 1
        for name, full, out in zip(names, exact, outs):
            size, start = out.numel(), rank * math.ceil(full.numel() / world)  # DeepSpeed's partition may stop at N
            ref = torch.zeros(size, dtype=torch.float64, device=full.device)
            mine = full[start:start + size]
            ref[:mine.numel()] = mine
            got = out.reshape(-1).double()
            self.step_err += (got - ref).pow(2).sum().item()
            self.step_ref += ref.pow(2).sum().item()
            if name not in self.sums:
                self.sums[name] = [torch.zeros_like(ref), torch.zeros_like(ref)]
            self.sums[name][0] += got
            self.sums[name][1] += ref
        self.overhead_s += time.perf_counter() - t0

    @torch.no_grad()
    def after_step(self) -> None:
        """Closes the step: one small all-reduce of this rank's squared norms."""
        t0 = time.perf_counter()
        sum_err = sum_ref = 0.0
        for got, ref in self.sums.values():
            sum_err += (got - ref).pow(2).sum().item()
            sum_ref += ref.pow(2).sum().item()
        device = next(iter(self.sums.values()))[0].device if self.sums else torch.device("cpu")
        totals = torch.tensor([self.step_err, self.step_ref, sum_err, sum_ref], dtype=torch.float64, device=device)
        dist.all_reduce(totals, group=self.group)
        step_err, step_ref, sum_err, sum_ref = totals.tolist()
        self.step_errors.append((step_err / step_ref)**0.5 if step_ref > 0 else float("nan"))
        self.sum_errors.append((sum_err / sum_ref)**0.5 if sum_ref > 0 else float("nan"))
        self.step_err = self.step_ref = 0.0
        self.overhead_s += time.perf_counter() - t0

    def take_overhead(self) -> float:
        spent, self.overhead_s = self.overhead_s, 0.0
        return spent

    def summary(self) -> dict:
        if not self.step_errors:
            return {}
        finite = [e for e in self.step_errors if e == e]
        return {
            "grad_rel_error_mean": sum(finite) / max(len(finite), 1),
            "grad_rel_error_last": self.step_errors[-1],
            "sum_rel_error_final": self.sum_errors[-1],
            "grad_rel_errors": self.step_errors,
            "sum_rel_errors": self.sum_errors,
            "reduce_calls": self.calls,
        }
