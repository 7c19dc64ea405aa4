"""The engine's per-step host time and the GPU's rate, calibrated from measured single-GPU steps: :func:`fit`,
:func:`load_e2e_points`.

On one GPU nothing is communicated, and a step takes the longer of two things that run side by side: the GPU's
work and the engine's host-side work (ZeRO-3's parameter hooks, the optimizer step's launches, the Python between
them), which does not grow with the tokens. The GPU's work is ``fixed * parameters + flops / rate``: the matmuls,
plus memory-bound work per parameter that does not grow with the tokens either (the optimizer step, ZeRO's gradient
and parameter copies). So the model's single-GPU step is ``max(engine_s, fixed * parameters + flops / rate)``.
From ``benchmarks/gpu_e2e.py`` runs at world size 1: ``engine_s`` is the mean measured step of the host-bound
points (those whose GPU time is under ``HOST_BOUND_BUSY`` of the step); ``rate`` and ``fixed`` are the least-squares
fit of the profiled GPU-busy seconds (the GPU's own time, which a drifting host does not move) on parameters and
FLOPs, where the points' tokens per parameter differ; else ``rate`` is the median of ``flops / gpu_busy_s`` and
``fixed`` 0; without profiles, the GPU table's sustained rate. The rate grows with the matmuls' size, so it carries
over between micro-batches of one model, not between models.
"""
import json
import statistics
from dataclasses import asdict, dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from deepspeed_loco.perf.model import Workload

HOST_BOUND_BUSY = 0.8  # a step whose GPU is busy less than this share of it waits on the host (a compute-bound
# step keeps the GPU busy but for the gaps between kernels)


@dataclass(frozen=True)
class Point:
    """One measured arm: its name, micro-batch, the step's FLOPs on the GPU, the median step (s), the source file;
    ``round_spread``: (largest - smallest) / median of its rounds' median steps (``gpu_e2e.py --rounds``; None for
    one round): how far the measurement itself moved, against which a prediction's error is read;
    ``gpu_busy_s``: seconds per step the GPU was busy (the torch profiler's, ``gpu_e2e.py``; None if not profiled);
    ``parameters``: the model's parameters (all on this one GPU)."""
    arm: str
    micro_batch: int
    flops: float
    step_s: float
    source: str
    round_spread: Optional[float] = None
    gpu_busy_s: Optional[float] = None
    parameters: float = 0.0

    def gpu_s(self, sustained_flops: float) -> float:
        """The GPU's seconds per step: measured when profiled, else ``flops / sustained_flops``."""
        return self.gpu_busy_s if self.gpu_busy_s is not None else self.flops / sustained_flops


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


def load_e2e_points(paths: Sequence[str]) -> List[Point]:
    """Every arm of every ``gpu_e2e.py --out`` JSON, as a :class:`Point`. Raises ValueError for a file that is not
    such a JSON or was measured on more than one rank (the calibration is of one GPU)."""
    points = []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        try:
            world, model = data["environment"]["world_size"], data["model"]
            workload = Workload(model["parameters"], model["layers"], model["dim"], model["seq_len"],
                                data["micro_batch"] * model["seq_len"])
            arms = [(arm["arm"], arm["step_s"], _spread(arm.get("round_step_s")),
                     (arm.get("profile") or {}).get("gpu_busy_s")) for arm in data["arms"]]
        except (KeyError, TypeError) as err:
            raise ValueError(f"{path}: not the JSON of benchmarks/gpu_e2e.py --out (missing {err})") from None
        if world != 1:
            raise ValueError(f"{path}: measured on {world} ranks; the calibration needs world size 1")
        points += [Point(arm, data["micro_batch"], workload.flops_per_gpu(), step, path, spread, busy,
                         model["parameters"]) for arm, step, spread, busy in arms]
    return points


def _spread(rounds: Optional[Sequence[float]]) -> Optional[float]:
    """(largest - smallest) / median of a run's per-round median steps; None without at least two rounds."""
    if not rounds or len(rounds) < 2:
        return None
    return (max(rounds) - min(rounds)) / statistics.median(rounds)


def fit_gpu(points: Sequence[Point]) -> Tuple[float, int, float]:
    """``(gpu_flops, points used, gpu_fixed_s_per_param)`` from the profiled ``points``: the least-squares fit of
    ``gpu_busy_s = fixed * parameters + flops / rate`` where the points' FLOPs per parameter differ and the fit gives
    both terms positive; else the median of ``flops / gpu_busy_s`` with no fixed term; ``(0, 0, 0)`` without
    profiles."""
    profiled = [p for p in points if p.gpu_busy_s]
    if not profiled:
        return 0.0, 0, 0.0
    design = torch.tensor([[p.parameters, p.flops] for p in profiled], dtype=torch.float64)
    busy = torch.tensor([[p.gpu_busy_s] for p in profiled], dtype=torch.float64)
    scale = design.amax(dim=0)  # parameters and FLOPs differ by ~10 orders of magnitude: solve in units of the largest
    if bool((scale > 0).all()):
        solution = torch.linalg.lstsq(design / scale, busy, driver="gelsd")  # CPU tensors: the SVD solver, with rank
        fixed, inverse_rate = solution.solution[:, 0].tolist()
        if int(solution.rank) == 2 and fixed > 0 and inverse_rate > 0:
            return float(scale[1]) / inverse_rate, len(profiled), fixed / float(scale[0])
    return statistics.median(p.flops / p.gpu_busy_s for p in profiled), len(profiled), 0.0


def fit(points: Sequence[Point], sustained_flops: float) -> Calibration:
    """``engine_s`` from the host-bound ``points`` (GPU time, :meth:`Point.gpu_s`, under ``HOST_BOUND_BUSY`` of the
    step) and the GPU's rate and per-parameter time from the profiled ones (:func:`fit_gpu`). Raises ValueError
    without points."""
    if not points:
        raise ValueError("calibration needs at least one measured step")
    rate, profiled, fixed = fit_gpu(points)
    gpu = dict(gpu_flops=rate, gpu_points=profiled, gpu_fixed_s_per_param=fixed)
    host_bound = [p.step_s for p in points if p.gpu_s(sustained_flops) < HOST_BOUND_BUSY * p.step_s]
    if not host_bound:
        return Calibration(0.0, 0, 0.0, **gpu)
    mean = statistics.fmean(host_bound)
    spread = statistics.stdev(host_bound) / mean if len(host_bound) > 1 else 0.0
    return Calibration(mean, len(host_bound), spread, **gpu)


def leave_one_out(points: Sequence[Point], sustained_flops: float) -> List[dict]:
    """For each micro-batch: the calibration fitted on the other micro-batches' points, and each of this
    micro-batch's arms predicted by it beside the measurement (relative error; None where no other point exists),
    its GPU time (``gpu_s``, :meth:`Point.gpu_s`) and the predicted GPU time (``predicted_gpu_s``)."""
    rows = []
    for micro_batch in sorted({p.micro_batch for p in points}):
        held = [p for p in points if p.micro_batch == micro_batch]
        rest = [p for p in points if p.micro_batch != micro_batch]
        calibration = fit(rest, sustained_flops) if rest else None
        for p in held:
            predicted = calibration.step_s(p.flops, p.parameters, sustained_flops) if calibration else None
            predicted_gpu = calibration.gpu_s(p.flops, p.parameters, sustained_flops) if calibration else None
            rows.append(dict(asdict(p), gpu_s=p.gpu_s(sustained_flops), predicted_s=predicted,
                             predicted_gpu_s=predicted_gpu,
                             error=predicted / p.step_s - 1 if predicted is not None else None))
    return rows
