"""LoCo's error state per GPU against ZeRO-3's own model states, for a model size and cluster shape
(``python -m deepspeed_loco.perf memory``; the table in ``docs/config.md``, "Error memory")."""
from dataclasses import dataclass
from typing import List, Sequence, Tuple

from deepspeed_loco.config import INTER_NODE_ONLY, LocoConfig
from deepspeed_loco.runtime.comm.error_feedback import error_bytes_per_parameter

ZERO3_BYTES_PER_PARAMETER = 16  # bf16 weights and gradients (2 + 2), fp32 master weights and Adam's two moments (12)
OPTIONS: Tuple[Tuple[object, int], ...] = (  # (error_feedback, error_bits): the rows of the table
    (True, 8), (True, 4), (True, 32), (INTER_NODE_ONLY, 8), (INTER_NODE_ONLY, 4))


@dataclass(frozen=True)
class MemoryRow:
    """One option's error state: bytes per parameter per GPU (large tensors) and GB per GPU at each (params, W)."""
    label: str
    bytes_per_parameter: List[float]  # one per cluster shape (W)
    gb_per_gpu: List[List[float]]  # [params index][W index]


def option_label(error_feedback, error_bits: int) -> str:
    """``'error_feedback: true, error_bits: 8'`` as a JSON-style block fragment."""
    feedback = f'"{error_feedback}"' if isinstance(error_feedback, str) else str(error_feedback).lower()
    return f"error_feedback: {feedback}, error_bits: {error_bits}"


def memory_rows(params: Sequence[float], gpus: Sequence[int], gpus_per_node: int) -> List[MemoryRow]:
    """Every option of :data:`OPTIONS` and ZeRO-3's model states (last row) for models of ``params`` parameters on
    ``gpus`` GPUs each, ``gpus_per_node`` per node (each of ``gpus`` a multiple of it)."""
    rows = []
    for feedback, bits in OPTIONS:
        config = LocoConfig(error_feedback=feedback, error_bits=bits)
        per = [error_bytes_per_parameter(w, gpus_per_node, config) for w in gpus]
        rows.append(MemoryRow(option_label(feedback, bits), per, [[b * n / 1e9 for b in per] for n in params]))
    zero3 = [ZERO3_BYTES_PER_PARAMETER / w for w in gpus]
    rows.append(MemoryRow("ZeRO-3's model states (16 B / W)", zero3, [[b * n / 1e9 for b in zero3] for n in params]))
    return rows


def memory_table(params: Sequence[float], gpus: Sequence[int], gpus_per_node: int) -> str:
    """The rows of :func:`memory_rows` as a markdown table: per GPU, bytes per parameter and GB per model and W."""
    shapes = [(n, w) for n in params for w in gpus]
    head = "| per GPU | " + " | ".join(f"B/param W={w}" for w in gpus) + " | " + " | ".join(
        f"{n / 1e9:g}B, W={w}" for n, w in shapes) + " |"
    lines = [f"LoCo's error state per GPU, {gpus_per_node} GPUs a node (group size 256; GB = 1e9 bytes)", "", head,
             "|" + "---|" * (1 + len(gpus) + len(shapes))]
    for row in memory_rows(params, gpus, gpus_per_node):
        gb = [row.gb_per_gpu[i][j] for i in range(len(params)) for j in range(len(gpus))]
        lines.append(f"| {row.label} | " + " | ".join(f"{b:.4f}" for b in row.bytes_per_parameter) + " | "
                     + " | ".join(f"{g:.2f} GB" for g in gb) + " |")
    return "\n".join(lines)
