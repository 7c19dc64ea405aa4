"""The calibration of the single-GPU step that ``python -m deepspeed_loco.perf predict --calibration`` reads:
:class:`Calibration`.

On one GPU nothing is communicated, and a step takes the longer of two things that run side by side: the GPU's
work and the engine's host-side work (ZeRO-3's parameter hooks, the optimizer step's launches, the Python between
them), which does not grow with the tokens. The GPU's work is ``fixed * parameters + flops / rate``: the matmuls,
plus memory-bound work per parameter that does not grow with the tokens either (the optimizer step, ZeRO's gradient
and parameter copies). So the model's single-GPU step is ``max(engine_s, fixed * parameters + flops / rate)``.
``benchmarks/calibrate.py`` fits the three figures to ``benchmarks/gpu_e2e.py`` runs on one GPU and writes them as
the JSON this record reads.
"""
import json
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Calibration:
    """``engine_s``: the engine's host seconds per step (0: no host-bound point was measured); ``points``: how many
    host-bound measurements it is the mean of; ``spread``: their sample standard deviation over the mean;
    ``gpu_flops``: FLOP/s of the GPU's matmuls, fitted on ``gpu_points`` profiled measurements (0: none profiled,
    the GPU table's sustained rate stands); ``gpu_fixed_s_per_param``: GPU seconds per step and parameter that do
    not grow with the tokens (0: not resolved by the points)."""
    engine_s: float
    points: int
    spread: float = 0.0
    gpu_flops: float = 0.0
    gpu_points: int = 0
    gpu_fixed_s_per_param: float = 0.0

    def gpu_fixed_s(self, parameters: float) -> float:
        """The GPU's seconds per step that do not grow with the tokens, for ``parameters`` held on that GPU."""
        return self.gpu_fixed_s_per_param * parameters

    def gpu_s(self, flops: float, parameters: float, sustained_flops: float) -> float:
        """The GPU's seconds for a step of ``flops`` on ``parameters``: the per-parameter work
        (:meth:`gpu_fixed_s`) plus the matmuls, at ``gpu_flops`` when calibrated, else at ``sustained_flops``."""
        return self.gpu_fixed_s(parameters) + flops / (self.gpu_flops or sustained_flops)

    def step_s(self, flops: float, parameters: float, sustained_flops: float) -> float:
        """A single-GPU step: host work and GPU work (:meth:`gpu_s`) overlap, the longer one sets the pace."""
        return max(self.engine_s, self.gpu_s(flops, parameters, sustained_flops))

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)
