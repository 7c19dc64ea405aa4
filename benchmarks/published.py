"""Published end-to-end figures, their settings and sources, and the step-time model's prediction of each, with
and without overlap: ``python3 benchmarks/published.py`` prints the table (``benchmarks/PERFORMANCE.md``, "Validation
against published figures"). A figure whose settings could not be pinned carries the reason instead of a
prediction. The model's default (no overlap) must stay within :data:`TOLERANCE` of every compared figure
(``tests/benchmarks/test_published.py``)."""
import os
import sys
from dataclasses import dataclass
from statistics import mean
from typing import Callable, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from deepspeed_loco.perf.model import GPUS, METHODS, Cluster, Workload, predict  # noqa: E402

TOLERANCE = 0.15  # the largest relative error (outside a published range) the default variant may show

ZEROPP_SOURCE = ("Wang et al. 2023, ZeRO++, arXiv 2306.10209, and the DeepSpeed ZeRO++ blog "
                 "(github.com/microsoft/DeepSpeed blogs/zeropp): 384 V100 SXM3 (24 DGX-2, 16 per node), fp16")
ZEROPP_SETTINGS = ("18B: 40 layers, hidden 6144, seq 512, activation checkpointing (DeepSpeed ZeRO++ tutorial, "
                   "zeropp.md in the DeepSpeed repository); 138B: 43 layers, hidden 16384 "
                   "(assumed: 12*L*h^2 = 138B), seq 512, "
                   "checkpointing; NVSwitch 150 GB/s per GPU per direction (1200 Gbit/s)")
ZEROPP_MODELS = ((18e9, 40, 6144), (138e9, 43, 16384))
MODEL_NAMES = ("18B", "138B")


def zeropp_cluster(inter_gbps: float) -> Cluster:
    """The ZeRO++ paper's cluster with ``inter_gbps`` per node (4 x 100 Gbit/s IB = 400, 1 x 100 = 100)."""
    return Cluster(gpus=384, gpus_per_node=16, gpu=GPUS["v100"], intra_gbps=1200, inter_gbps=inter_gbps)


def zeropp_speedup(model: Tuple[float, int, int], tokens: int, inter_gbps: float, overlap: bool,
                   baseline_gbps: Optional[float] = None) -> float:
    """Throughput of ZeRO++ over ZeRO-3 (ZeRO-3 at ``baseline_gbps`` if given, else at the same bandwidth), both
    with or both without overlap."""
    params, layers, hidden = model
    workload = Workload(params, layers, hidden, 512, tokens, recompute=True)
    ours = predict(workload, zeropp_cluster(inter_gbps), METHODS["zeropp"], overlap=overlap)
    base = predict(workload, zeropp_cluster(baseline_gbps or inter_gbps), METHODS["zero3"], overlap=overlap)
    return base.step_s / ours.step_s


@dataclass(frozen=True)
class Figure:
    """A published figure: ``low``..``high`` (a ratio of throughputs; low == high for one number), the setting,
    its source; ``predict(overlap)`` gives the model's value (None: not comparable, ``reason`` says why)."""
    name: str
    low: float
    high: float
    setting: str
    source: str
    predict: Optional[Callable[[bool], float]]
    reason: str = ""

    def relative_error(self, predicted: float) -> float:
        """0 inside the published range, else the signed distance to its nearer end over that end."""
        if predicted < self.low:
            return predicted / self.low - 1
        if predicted > self.high:
            return predicted / self.high - 1
        return 0.0


def _speedup(model: Tuple[float, int, int], tokens: int, gbps: float) -> Callable[[bool], float]:
    return lambda overlap: zeropp_speedup(model, tokens, gbps, overlap)


def _all_at_100_gbps(overlap: bool) -> Sequence[float]:
    """ZeRO++ over ZeRO-3 at 100 Gbit/s for both models at 1K and 2K tokens per GPU."""
    return [zeropp_speedup(model, tokens, 100, overlap) for tokens in (1024, 2048) for model in ZEROPP_MODELS]


FIGURES = (
    *(Figure(f"ZeRO++/ZeRO-3, {name}, 400 Gbps, {tokens // 1024}K tok/GPU", low, high,
             "the blog's range over model sizes (Fig. 6)", ZEROPP_SOURCE, _speedup(model, tokens, 400))
      for tokens, low, high in ((1024, 1.28, 1.36), (2048, 1.24, 1.29))
      for name, model in zip(MODEL_NAMES, ZEROPP_MODELS)),
    Figure("ZeRO++/ZeRO-3, 100 Gbps, max over models and 1K/2K", 2.2, 2.2,
           "'up to 2.2x' at 100 Gbps (blog Fig. 7); which model and batch reach it is not stated", ZEROPP_SOURCE,
           lambda overlap: max(_all_at_100_gbps(overlap))),
    Figure("ZeRO++/ZeRO-3, 100 Gbps, mean over models and 1K/2K", 2.0, 2.0,
           "'about 2x on average' at 100 Gbps; the averaged set is not stated", ZEROPP_SOURCE,
           lambda overlap: mean(_all_at_100_gbps(overlap))),
    *(Figure(f"ZeRO++ at 200 Gbps / ZeRO-3 at 800 Gbps, {name}, 1K tok/GPU", 1.0, 1.0,
             "'comparable' throughput (blog Fig. 8); tokens per GPU not stated, 1K assumed", ZEROPP_SOURCE,
             lambda overlap, m=model: zeropp_speedup(m, 1024, 200, overlap, baseline_gbps=800))
      for name, model in zip(MODEL_NAMES, ZEROPP_MODELS)),
    Figure("LoCo 4-bit over full-precision Adam", 1.14, 1.40,
           "Megatron-LM and FSDP, LLaMA-2 and Mixtral", "Xie et al., LoCo, IEEE TPAMI 2025, arXiv 2407.04480",
           None, "not pinned: GPU count, GPUs per node, interconnect bandwidth and tokens per GPU of each speed-up "
                 "were not found (abstract: '14% to 40%'); its baselines (Megatron-LM all-reduce/reduce-scatter, "
                 "FSDP) are not this model's ZeRO-3 pattern"),
    Figure("SDP4Bit over Megatron ShardedDP baseline", 4.08, 4.08,
           "up to 4.08x at 128 GPUs; GPT 1.3B-18B with TP up to 8 and PP up to 2; H800 (8 per node) and A100 "
           "(4 per node) clusters (SDP4Bit README)", "Jia et al., SDP4Bit, NeurIPS 2024, arXiv 2410.15526", None,
           "not comparable: its 4-bit weight-difference all-gather is no method of this model, it mixes tensor "
           "and pipeline parallelism, and which cluster, model and interconnect bandwidth give 4.08x was not "
           "pinned"),
)


def validation_rows(overlap: bool):
    """``(figure, predicted or None)`` per figure, every method with (or every method without) overlap."""
    return [(figure, figure.predict(overlap) if figure.predict else None) for figure in FIGURES]


def format_validation() -> str:
    """The validation table, one line per figure: the published value, then the prediction and its relative error
    without overlap (the model's default) and with full overlap; then each figure's
    setting and source, and the reasons for the figures not compared."""
    lines = [f"{'figure':58s} {'published':>9s} {'no-overlap':>10s} {'rel.err':>7s} {'overlap':>8s} {'rel.err':>7s}"]
    notes = []
    for (figure, serial), (_, overlapped) in zip(validation_rows(False), validation_rows(True)):
        published = f"{figure.low:.2f}" if figure.low == figure.high else f"{figure.low:.2f}-{figure.high:.2f}"
        if serial is None:
            lines.append(f"{figure.name:58s} {published:>9s} {'n/a':>10s} {'n/a':>7s} {'n/a':>8s} {'n/a':>7s}")
            notes.append(f"{figure.name}: {figure.reason}")
            continue
        error = figure.relative_error(serial)
        verdict = "" if abs(error) <= TOLERANCE else f"  (no-overlap outside {TOLERANCE:.0%})"
        lines.append(f"{figure.name:58s} {published:>9s} {serial:10.2f} {error:+7.1%} {overlapped:8.2f} "
                     f"{figure.relative_error(overlapped):+7.1%}{verdict}")
    lines += ["", f"ZeRO++ runs modelled as: {ZEROPP_SETTINGS}"]
    for source in dict.fromkeys(figure.source for figure in FIGURES):  # each source once, in order
        lines += ["", f"Source: {source}"]
        lines += [f"  {figure.name}: {figure.setting}" for figure in FIGURES if figure.source == source]
    return "\n".join(lines + ["", "Not compared:"] + notes)


if __name__ == "__main__":
    print(format_validation())
