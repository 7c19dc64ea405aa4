"""Gradient fidelity: how far the communicated (reduced) gradient is from the exact mean, per step and summed.

``GradientFidelity.attach(engine)`` wraps the ZeRO-3 optimizer's bucket reduce (``__avg_scatter_grads``, which
``deepspeed_loco`` replaces for its arms) on that one optimizer instance. For every bucket it also computes the
exact mean of the same gradients with a float64 all-reduce, and keeps, for this rank's partitions:

* per step: ``||out - exact|| / ||exact||`` over the whole model (all ranks);
* running sums ``S_out = sum_t out_t`` and ``S_exact``: ``||S_out - S_exact|| / ||S_exact||`` after every step.
  Error feedback exists to keep this one small: the bias that plain quantization leaves accumulates here.

Works the same for the full-precision arm (whose error is fp32 rounding), so every arm is measured alike. The
time it spends is measured and excluded from the reported step time.
"""
import time
from typing import Dict, List

import torch
import torch.distributed as dist

from deepspeed_loco.runtime.zero.deepspeed_seam import REDUCE_METHOD


class GradientFidelity:

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.inner = getattr(optimizer, REDUCE_METHOD)
        self.group = None
        self.sums: Dict[int, List[torch.Tensor]] = {}
        self.step_err = self.step_ref = 0.0
        self.step_errors: List[float] = []
        self.sum_errors: List[float] = []
        self.calls = 0
        self.overhead_s = 0.0  # wall time spent measuring (exact all-reduce and bookkeeping)
        setattr(optimizer, REDUCE_METHOD, self._reduce)

    @classmethod
    def attach(cls, engine) -> "GradientFidelity":
        optimizer = engine.optimizer
        if not callable(getattr(optimizer, REDUCE_METHOD, None)):
            raise RuntimeError(f"gradient fidelity needs the ZeRO-3 optimizer, got {type(optimizer).__name__}")
        return cls(optimizer)

    @torch.no_grad()
    def _reduce(self, params, communication_data_type):
        t0 = time.perf_counter()
        group = self.optimizer._get_param_partition_group(params[0])
        self.group = group
        world = dist.get_world_size(group)
        rank = dist.get_rank(group)
        flat = torch.cat([p.grad.reshape(-1).double() for p in params])
        dist.all_reduce(flat, group=group)
        flat /= world
        exact, offset = [], 0
        for p in params:
            exact.append(flat[offset:offset + p.grad.numel()])
            offset += p.grad.numel()
        self.overhead_s += time.perf_counter() - t0
        outs = self.inner(params, communication_data_type)
        t0 = time.perf_counter()
        self.calls += 1
        for p, full, out in zip(params, exact, outs):
            size = out.numel()
            ref = torch.zeros(size, dtype=torch.float64, device=full.device)
            mine = full[rank * size:(rank + 1) * size]
            ref[:mine.numel()] = mine
            got = out.reshape(-1).double()
            self.step_err += (got - ref).pow(2).sum().item()
            self.step_ref += ref.pow(2).sum().item()
            key = id(p)
            if key not in self.sums:
                self.sums[key] = [torch.zeros_like(ref), torch.zeros_like(ref)]
            self.sums[key][0] += got
            self.sums[key][1] += ref
        self.overhead_s += time.perf_counter() - t0
        return outs

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
