"""The engine's per-step host time and the GPU's rate, calibrated from measured single-GPU steps: ``python3
benchmarks/calibrate.py RESULTS.json ... [--gpu h200] [--tflops T] [--out calibration.json]`` prints the calibration
and a leave-one-micro-batch-out table, and writes the JSON that ``python -m deepspeed_loco.perf predict
--calibration`` reads (:class:`~deepspeed_loco.perf.calibration.Calibration`, where the single-GPU step model is).

From ``benchmarks/gpu_e2e.py`` runs at world size 1: ``engine_s`` is the mean measured step of the host-bound
points (those whose GPU time is under ``HOST_BOUND_BUSY`` of the step); ``rate`` and ``fixed`` are the least-squares
fit of the profiled GPU-busy seconds (the GPU's own time, which a drifting host does not move) on parameters and
FLOPs, where the points' tokens per parameter differ; else ``rate`` is the median of ``flops / gpu_busy_s`` and
``fixed`` 0; without profiles, the GPU table's sustained rate. The rate grows with the matmuls' size, so it carries
over between micro-batches of one model, not between models.
"""
import argparse
import json
import os
import statistics
import sys
from dataclasses import asdict, dataclass
from typing import List, Optional, Sequence, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from deepspeed_loco.perf.calibration import Calibration  # noqa: E402
from deepspeed_loco.perf.model import GPUS, Workload  # noqa: E402

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python3 benchmarks/calibrate.py", description=(
        "The engine's host seconds per step and the GPU's rate from gpu_e2e.py runs on one GPU, with each "
        "micro-batch predicted from the others; --out writes the JSON that 'python -m deepspeed_loco.perf predict "
        "--calibration' reads."))
    parser.add_argument("results", nargs="+", help="JSON files written by benchmarks/gpu_e2e.py --out (world size 1)")
    parser.add_argument("--gpu", choices=sorted(GPUS), default="h200",
                        help="the GPU they ran on (its sustained TFLOPS)")
    parser.add_argument("--tflops", type=float, default=None, help="sustained TFLOPS (overrides the GPU table)")
    parser.add_argument("--out", default=None, help="write the calibration JSON here (for predict --calibration)")
    return parser


def run_calibrate(args, parser) -> str:
    """The calibration (written to ``--out`` if given) and the leave-one-micro-batch-out table."""
    rate = args.tflops * 1e12 if args.tflops else GPUS[args.gpu].sustained_flops
    try:
        points = load_e2e_points(args.results)
        calibration = fit(points, rate)
    except (OSError, ValueError) as exc:
        parser.error(str(exc))
    if args.out:
        with open(args.out, "w") as f:
            f.write(calibration.to_json() + "\n")
    fixed = (f" plus {calibration.gpu_fixed_s_per_param * 1e12:.1f} ps per parameter that does not grow with the "
             f"tokens" if calibration.gpu_fixed_s_per_param else "")
    gpu = (f"the GPU at {calibration.gpu_flops / 1e12:.1f} TFLOPS{fixed} (fitted on {calibration.gpu_points} "
           f"profiled arms)" if calibration.gpu_flops else f"the GPU at the table's {rate / 1e12:.0f} TFLOPS (no "
           f"profiled arm)")
    lines = [f"engine host time {calibration.engine_s * 1e3:.1f} ms per step: the mean of {calibration.points} "
             f"host-bound arms (spread {calibration.spread:.0%}); {gpu}", "",
             "each micro-batch predicted from the others (leave one out), "
             "step = max(engine, fixed * parameters + flops / GPU rate):",
             f"{'arm':8s} {'micro-batch':>11s} {'gpu ms':>10s} {'pred. gpu ms':>12s} {'measured ms':>11s} "
             f"{'predicted ms':>12s} {'rel.err':>8s} {'rounds moved':>12s}"]
    for row in leave_one_out(points, rate):
        held_out = row["predicted_s"] is not None
        gpu = f"{row['predicted_gpu_s'] * 1e3:12.1f}" if held_out else f"{'n/a':>12s}"
        predicted = (f"{row['predicted_s'] * 1e3:12.1f} {row['error']:+8.1%}" if held_out
                     else f"{'n/a':>12s} {'n/a':>8s}")
        moved = f"{row['round_spread']:12.1%}" if row["round_spread"] is not None else f"{'-':>12s}"
        lines.append(f"{row['arm']:8s} {row['micro_batch']:11d} {row['gpu_s'] * 1e3:10.1f} {gpu} "
                     f"{row['step_s'] * 1e3:11.1f} {predicted} {moved}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = build_parser()
    print(run_calibrate(parser.parse_args(argv), parser))


if __name__ == "__main__":
    main()
