"""Result records: one JSON-ready dict per (arm, seed) run, from :func:`record` of a simulated
:class:`~deepspeed_loco.simulation.ArmResult` or from the demo's DeepSpeed workers (the same keys); what every
report module reads."""
import statistics
from dataclasses import replace
from typing import Any, Dict, List, Sequence

from deepspeed_loco.config import LocoConfig
from deepspeed_loco.layout import plan_hops
from deepspeed_loco.runtime.comm.error_feedback import ErrorFeedbackState
from deepspeed_loco.simulation.arms import Arm, parse_arm
from deepspeed_loco.simulation.arm_result import ArmResult


def record_arm(record: dict) -> Arm:
    """The arm of a result record (a report record or a line of the benchmark's ``runs.jsonl``).

    Rebuilt from the record's ``key`` and ``arm.seed``, which every record has: older records hold
    ``{"kind", "bits", "seed"}`` in ``arm``, newer ones the fields of ``Arm``.
    """
    return replace(parse_arm(record["key"]), seed=record["arm"]["seed"])


def record(result: ArmResult, parameter_sizes: Sequence[int]) -> Dict[str, Any]:
    """The report record of one simulated run of a model whose parameters have ``parameter_sizes`` elements:
    losses (train loss = mean of the last tenth of the steps), bytes, the error buffers one rank holds, step time
    (training wall time / steps) and fidelity; JSON-serialisable."""
    steps = len(result.train_losses)
    last_k = max(1, steps // 10)
    buffers = 0
    if result.loco:
        config = LocoConfig.from_dict(result.loco)
        state = ErrorFeedbackState(config, plan_hops(result.world_size, config.local_world_size, config))
        buffers = sum(state.planned_bytes(n) for n in parameter_sizes)
    return {
        "arm": replace(parse_arm(result.key), seed=result.seed).to_dict(),
        "key": result.key,
        "label": result.label,
        "parameters": sum(parameter_sizes),
        "train_losses": result.train_losses,
        "train_loss": statistics.fmean(result.train_losses[-last_k:]),
        "train_loss_last_k": last_k,
        "validation": result.validation,
        "val_loss": result.final_val_loss,
        "step_time_s": result.wall_s / steps,
        "bytes_per_step": result.bytes_per_step,
        "full_precision_bytes_per_step": result.full_precision_bytes_per_step,
        "error_buffer_bytes": buffers,
        "fidelity": {"grad_rel_error_mean": statistics.fmean(result.grad_rel_errors),
                     "sum_rel_error_final": result.sum_rel_errors[-1], "sum_rel_errors": result.sum_rel_errors},
    }


def by_arm(results: Sequence[dict]) -> Dict[str, List[dict]]:
    """Records grouped by arm key, in first-seen order."""
    groups: Dict[str, List[dict]] = {}
    for r in results:
        groups.setdefault(r["key"], []).append(r)
    return groups
