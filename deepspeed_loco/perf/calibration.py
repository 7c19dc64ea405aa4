"""The single-GPU terms of the step-time model fitted to measured steps: :func:`fit`, :func:`load_e2e_points`.

A step on one GPU is ``engine_s + flops / sustained_flops``: a per-step cost that does not grow with the tokens
(the engine's host-side work: ZeRO-3's parameter hooks, the optimizer step, launch gaps) plus the matmuls at the
rate the GPU sustains. Both come from a least-squares line through ``(flops, seconds)`` points of
``benchmarks/gpu_e2e.py`` runs at world size 1 (several micro-batches of one model), where nothing is communicated.
"""
import json
import statistics
from dataclasses import asdict, dataclass
from typing import List, Sequence

from deepspeed_loco.perf.model import Workload


@dataclass(frozen=True)
class Point:
    """One measured arm: its name, the step's FLOPs on the GPU, the median step in seconds and the source file."""
    arm: str
    micro_batch: int
    flops: float
    step_s: float
    source: str


@dataclass(frozen=True)
class Calibration:
    """``engine_s``: seconds per step that do not grow with the tokens; ``tflops``: the sustained matmul rate
    (TFLOPS); ``points``: how many measurements the line went through."""
    engine_s: float
    tflops: float
    points: int

    def step_s(self, flops: float) -> float:
        return self.engine_s + flops / (self.tflops * 1e12)

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
            arms = [(arm["arm"], arm["step_s"]) for arm in data["arms"]]
        except (KeyError, TypeError) as err:
            raise ValueError(f"{path}: not the JSON of benchmarks/gpu_e2e.py --out (missing {err})") from None
        if world != 1:
            raise ValueError(f"{path}: measured on {world} ranks; the calibration needs world size 1")
        points += [Point(arm, data["micro_batch"], workload.flops_per_gpu(), step, path) for arm, step in arms]
    return points


def fit(points: Sequence[Point]) -> Calibration:
    """The least-squares line ``step_s = engine_s + flops / rate`` through ``points``. Raises ValueError with fewer
    than two distinct FLOP counts, or where the fitted rate or per-step cost is not positive."""
    xs, ys = [p.flops for p in points], [p.step_s for p in points]
    if len(set(xs)) < 2:
        raise ValueError(f"calibration needs steps of at least two sizes (micro-batches), got FLOPs {sorted(set(xs))}")
    slope, intercept = statistics.linear_regression(xs, ys)
    if slope <= 0 or intercept < 0:
        raise ValueError(f"the fitted line (engine {intercept * 1e3:.1f} ms, {slope:.3g} s per FLOP) is not physical: "
                         f"the steps do not grow with the tokens; measure more steps or larger micro-batches")
    return Calibration(intercept, 1.0 / slope / 1e12, len(points))


def leave_one_out(points: Sequence[Point]) -> List[dict]:
    """For each micro-batch: the calibration fitted on the other micro-batches' points, and each of this
    micro-batch's arms predicted by it beside the measurement (relative error)."""
    rows = []
    for micro_batch in sorted({p.micro_batch for p in points}):
        held, rest = ([p for p in points if (p.micro_batch == micro_batch) == keep] for keep in (True, False))
        try:
            calibration = fit(rest)
        except ValueError as err:
            rows += [dict(asdict(p), predicted_s=None, error=None, note=str(err)) for p in held]
            continue
        for p in held:
            predicted = calibration.step_s(p.flops)
            rows.append(dict(asdict(p), predicted_s=predicted, error=predicted / p.step_s - 1, note=""))
    return rows
