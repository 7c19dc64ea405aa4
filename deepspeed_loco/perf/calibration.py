"""The engine's per-step host time, calibrated from measured single-GPU steps: :func:`fit`, :func:`load_e2e_points`.

On one GPU nothing is communicated, and a step takes the longer of two things that run side by side: the GPU's
matmuls (``flops / sustained_flops``) and the engine's host-side work (ZeRO-3's parameter hooks, the optimizer
step's launches, the Python between them), which does not grow with the tokens. So the model's single-GPU step is
``max(engine_s, compute_s)``. ``engine_s`` is the mean measured step of the host-bound points (those whose
predicted compute is shorter than the measured step) of ``benchmarks/gpu_e2e.py`` runs at world size 1.
"""
import json
import statistics
from dataclasses import asdict, dataclass
from typing import List, Optional, Sequence

from deepspeed_loco.perf.model import Workload


@dataclass(frozen=True)
class Point:
    """One measured arm: its name, micro-batch, the step's FLOPs on the GPU, the median step (s), the source file;
    ``round_spread``: (largest - smallest) / median of its rounds' median steps (``gpu_e2e.py --rounds``; None for
    one round): how far the measurement itself moved, against which a prediction's error is read."""
    arm: str
    micro_batch: int
    flops: float
    step_s: float
    source: str
    round_spread: Optional[float] = None


@dataclass(frozen=True)
class Calibration:
    """``engine_s``: the engine's host seconds per step (0: no host-bound point was measured); ``points``: how many
    host-bound measurements it is the mean of; ``spread``: their sample standard deviation over the mean."""
    engine_s: float
    points: int
    spread: float = 0.0

    def step_s(self, compute_s: float) -> float:
        """A single-GPU step: host work and GPU compute overlap, the longer one sets the pace."""
        return max(self.engine_s, compute_s)

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
            arms = [(arm["arm"], arm["step_s"], _spread(arm.get("round_step_s"))) for arm in data["arms"]]
        except (KeyError, TypeError) as err:
            raise ValueError(f"{path}: not the JSON of benchmarks/gpu_e2e.py --out (missing {err})") from None
        if world != 1:
            raise ValueError(f"{path}: measured on {world} ranks; the calibration needs world size 1")
        points += [Point(arm, data["micro_batch"], workload.flops_per_gpu(), step, path, spread)
                   for arm, step, spread in arms]
    return points


def _spread(rounds: Optional[Sequence[float]]) -> Optional[float]:
    """(largest - smallest) / median of a run's per-round median steps; None without at least two rounds."""
    if not rounds or len(rounds) < 2:
        return None
    return (max(rounds) - min(rounds)) / statistics.median(rounds)


def fit(points: Sequence[Point], sustained_flops: float) -> Calibration:
    """``engine_s`` from the host-bound ``points`` (compute at ``sustained_flops`` FLOP/s shorter than the step).
    Raises ValueError without points."""
    if not points:
        raise ValueError("calibration needs at least one measured step")
    host_bound = [p.step_s for p in points if p.flops / sustained_flops < p.step_s]
    if not host_bound:
        return Calibration(0.0, 0)
    mean = statistics.fmean(host_bound)
    spread = statistics.stdev(host_bound) / mean if len(host_bound) > 1 else 0.0
    return Calibration(mean, len(host_bound), spread)


def leave_one_out(points: Sequence[Point], sustained_flops: float) -> List[dict]:
    """For each micro-batch: the calibration fitted on the other micro-batches' points, and each of this
    micro-batch's arms predicted by it beside the measurement (relative error); None where no other point exists."""
    rows = []
    for micro_batch in sorted({p.micro_batch for p in points}):
        held = [p for p in points if p.micro_batch == micro_batch]
        rest = [p for p in points if p.micro_batch != micro_batch]
        calibration = fit(rest, sustained_flops) if rest else None
        for p in held:
            predicted = calibration.step_s(p.flops / sustained_flops) if calibration else None
            rows.append(dict(asdict(p), predicted_s=predicted,
                             error=predicted / p.step_s - 1 if predicted is not None else None))
    return rows
