"""The engine's per-step host time and the GPU's rate, calibrated from measured single-GPU steps: :func:`fit`,
:func:`load_e2e_points`.

On one GPU nothing is communicated, and a step takes the longer of two things that run side by side: the GPU's
work (``flops / rate``) and the engine's host-side work (ZeRO-3's parameter hooks, the optimizer step's launches,
the Python between them), which does not grow with the tokens. So the model's single-GPU step is
``max(engine_s, flops / rate)``. From ``benchmarks/gpu_e2e.py`` runs at world size 1: ``engine_s`` is the mean
measured step of the host-bound points (those whose GPU time is under ``HOST_BOUND_BUSY`` of the step); ``rate``
is the median of ``flops / gpu_busy_s`` over the points whose profile measured the GPU's busy time (the GPU's own
rate, which a drifting host does not move), else the GPU table's sustained rate. The rate grows with the matmuls' size,
so it carries over between micro-batches of one model, not between models.
"""
import json
import statistics
from dataclasses import asdict, dataclass
from typing import List, Optional, Sequence

from deepspeed_loco.perf.model import Workload

HOST_BOUND_BUSY = 0.8  # a step whose GPU is busy less than this share of it waits on the host (a compute-bound
# step keeps the GPU busy but for the gaps between kernels)


@dataclass(frozen=True)
class Point:
    """One measured arm: its name, micro-batch, the step's FLOPs on the GPU, the median step (s), the source file;
    ``round_spread``: (largest - smallest) / median of its rounds' median steps (``gpu_e2e.py --rounds``; None for
    one round): how far the measurement itself moved, against which a prediction's error is read;
    ``gpu_busy_s``: seconds per step the GPU was busy (the torch profiler's, ``gpu_e2e.py``; None if not profiled)."""
    arm: str
    micro_batch: int
    flops: float
    step_s: float
    source: str
    round_spread: Optional[float] = None
    gpu_busy_s: Optional[float] = None

    def gpu_s(self, sustained_flops: float) -> float:
        """The GPU's seconds per step: measured when profiled, else ``flops / sustained_flops``."""
        return self.gpu_busy_s if self.gpu_busy_s is not None else self.flops / sustained_flops


@dataclass(frozen=True)
class Calibration:
    """``engine_s``: the engine's host seconds per step (0: no host-bound point was measured); ``points``: how many
    host-bound measurements it is the mean of; ``spread``: their sample standard deviation over the mean;
    ``gpu_flops``: FLOP/s the GPU achieved while busy, the median over ``gpu_points`` profiled measurements (0: none
    profiled, the GPU table's sustained rate stands)."""
    engine_s: float
    points: int
    spread: float = 0.0
    gpu_flops: float = 0.0
    gpu_points: int = 0

    def step_s(self, flops: float, sustained_flops: float) -> float:
        """A single-GPU step of ``flops``: host work and GPU work overlap, the longer one sets the pace; the GPU runs
        at ``gpu_flops`` when calibrated, else at ``sustained_flops``."""
        return max(self.engine_s, flops / (self.gpu_flops or sustained_flops))

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
        points += [Point(arm, data["micro_batch"], workload.flops_per_gpu(), step, path, spread, busy)
                   for arm, step, spread, busy in arms]
    return points


def _spread(rounds: Optional[Sequence[float]]) -> Optional[float]:
    """(largest - smallest) / median of a run's per-round median steps; None without at least two rounds."""
    if not rounds or len(rounds) < 2:
        return None
    return (max(rounds) - min(rounds)) / statistics.median(rounds)


def fit(points: Sequence[Point], sustained_flops: float) -> Calibration:
    """``engine_s`` from the host-bound ``points`` (GPU time, :meth:`Point.gpu_s`, under ``HOST_BOUND_BUSY`` of the
    step) and ``gpu_flops`` from the profiled ones. Raises ValueError without points."""
    if not points:
        raise ValueError("calibration needs at least one measured step")
    rates = [p.flops / p.gpu_busy_s for p in points if p.gpu_busy_s]
    gpu = (statistics.median(rates), len(rates)) if rates else (0.0, 0)
    host_bound = [p.step_s for p in points if p.gpu_s(sustained_flops) < HOST_BOUND_BUSY * p.step_s]
    if not host_bound:
        return Calibration(0.0, 0, 0.0, *gpu)
    mean = statistics.fmean(host_bound)
    spread = statistics.stdev(host_bound) / mean if len(host_bound) > 1 else 0.0
    return Calibration(mean, len(host_bound), spread, *gpu)


def leave_one_out(points: Sequence[Point], sustained_flops: float) -> List[dict]:
    """For each micro-batch: the calibration fitted on the other micro-batches' points, and each of this
    micro-batch's arms predicted by it beside the measurement (relative error; None where no other point exists)
    and its GPU time (``gpu_s``, :meth:`Point.gpu_s`)."""
    rows = []
    for micro_batch in sorted({p.micro_batch for p in points}):
        held = [p for p in points if p.micro_batch == micro_batch]
        rest = [p for p in points if p.micro_batch != micro_batch]
        calibration = fit(rest, sustained_flops) if rest else None
        for p in held:
            predicted = calibration.step_s(p.flops, sustained_flops) if calibration else None
            rows.append(dict(asdict(p), gpu_s=p.gpu_s(sustained_flops), predicted_s=predicted,
                             error=predicted / p.step_s - 1 if predicted is not None else None))
    return rows
