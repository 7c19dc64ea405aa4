"""Step time of one ZeRO-3 training step per method: compute, the codec kernels and the collectives
(benchmarks/PERFORMANCE.md states every assumption). Units: seconds, bytes, bytes/s, FLOPs."""
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Tuple

from deepspeed_loco.layout.wire import wire_bytes_per_element
from deepspeed_loco.perf.collectives import (Link, Topology, inter_node_all_to_all_s, intra_node_all_gather_s,
                                             intra_node_all_to_all_s, ring_all_gather_s, ring_reduce_scatter_s)


@dataclass(frozen=True)
class Gpu:
    """``peak_tflops``: dense fp16/bf16 tensor-core peak; ``achieved_fraction``: the share of it a training step's
    matmuls sustain; ``hbm_tbps``: memory bandwidth (TB/s), which scales the memory-bound codec kernels."""
    name: str
    peak_tflops: float
    achieved_fraction: float
    hbm_tbps: float
    source: str

    @property
    def sustained_flops(self) -> float:
        """FLOP/s a training step's matmuls sustain."""
        return self.peak_tflops * 1e12 * self.achieved_fraction


GPUS = {
    "v100": Gpu("v100", 125.0, 0.30, 0.9, "NVIDIA V100 datasheet (125 TFLOPS fp16 tensor, 900 GB/s); fraction: "
                "Megatron-LM (Shoeybi et al. 2019) 39 TFLOPS on one V100, '30% of peak'"),
    "a100": Gpu("a100", 312.0, 0.50, 2.039, "NVIDIA A100 80GB SXM datasheet (312 TFLOPS bf16, 2039 GB/s); fraction: "
                "Narayanan et al. 2021 (Megatron-LM at scale), up to 52% of peak per GPU"),
    "h100": Gpu("h100", 989.0, 0.40, 3.35, "NVIDIA H100 SXM datasheet (989 TFLOPS dense bf16, 3.35 TB/s); fraction: "
                "Llama 3 paper (Dubey et al. 2024), 38-43% bf16 MFU"),
    "h200": Gpu("h200", 989.0, 0.40, 4.8, "NVIDIA H200 SXM datasheet (989 TFLOPS dense bf16, 4.8 TB/s); fraction: "
                "as H100 (same compute die)"),
}

INTRA_EFFICIENCY = 0.80  # NCCL's achieved share of NVLink/NVSwitch line rate (nccl-tests bus bandwidth)
INTER_EFFICIENCY = 0.90  # NCCL's achieved share of InfiniBand/RoCE line rate for large messages
INTRA_LATENCY_US = 2.0   # per NVLink hop
INTER_LATENCY_US = 8.0   # per network hop
QWZ_GROUP = 4096         # DeepSpeed 0.19.8 CUDAQuantizer: int8 weights, groups of 4K-8K elements, one fp32 scale


@dataclass(frozen=True)
class Workload:
    """A dense transformer: ``params`` parameters in ``layers`` layers of width ``hidden``, sequences of ``seq``
    tokens, ``tokens_per_gpu`` tokens per GPU per step; ``recompute``: activation checkpointing (forward twice)."""
    params: float
    layers: int
    hidden: int
    seq: int
    tokens_per_gpu: int
    recompute: bool = False

    def flops_per_gpu(self) -> float:
        """FLOPs of one GPU's step: ``k * tokens * (params + 2 * layers * hidden * seq)``, k = 6 (forward 2,
        backward 4 per parameter and token) or 8 with recomputation; the second term is attention's QK^T and AV
        (4 * seq * hidden FLOPs per token and layer forward, not causal-halved)."""
        factor = 8 if self.recompute else 6
        return factor * self.tokens_per_gpu * (self.params + 2 * self.layers * self.hidden * self.seq)


@dataclass(frozen=True)
class Cluster:
    """``gpus`` GPUs, ``gpus_per_node`` to a node; ``intra_gbps``: one GPU's NVLink bandwidth, one direction;
    ``inter_gbps``: one node's network bandwidth, all NICs together, one direction (Gbit/s, line rate);
    ``tflops``: sustained TFLOPS overriding the GPU table's."""
    gpus: int
    gpus_per_node: int
    gpu: Gpu
    intra_gbps: float
    inter_gbps: float
    intra_latency_us: float = INTRA_LATENCY_US
    inter_latency_us: float = INTER_LATENCY_US
    tflops: Optional[float] = None

    def __post_init__(self):
        if self.gpus_per_node < 1 or self.gpus < 1:
            raise ValueError(f"--gpus and --gpus-per-node must be >= 1, got {self.gpus} and {self.gpus_per_node}")
        if self.gpus % self.gpus_per_node:
            raise ValueError(f"--gpus ({self.gpus}) must be a multiple of --gpus-per-node ({self.gpus_per_node})")
        if self.intra_gbps <= 0 or self.inter_gbps <= 0:
            raise ValueError(f"--intra-gbps and --inter-gbps must be > 0, got {self.intra_gbps} and {self.inter_gbps}")

    @property
    def sustained_flops(self) -> float:
        return self.tflops * 1e12 if self.tflops else self.gpu.sustained_flops

    def topology(self) -> Topology:
        """Links as NCCL achieves them: line rate (Gbit/s) to bytes/s times the efficiency."""
        intra = Link(self.intra_gbps * 1e9 / 8 * INTRA_EFFICIENCY, self.intra_latency_us * 1e-6)
        inter = Link(self.inter_gbps * 1e9 / 8 * INTER_EFFICIENCY, self.inter_latency_us * 1e-6)
        return Topology(self.gpus, self.gpus_per_node, intra, inter)


@dataclass(frozen=True)
class Method:
    """Bytes per element of each collective. ``gather_bytes``: forward (and, without hpZ, backward) weight
    all-gather; ``hpz``: the backward all-gather stays in the node; ``grad_bits``: None for a 16-bit
    reduce-scatter, else (intra, inter) bits of the two-hop all-to-all; ``grad_group``: scale group (None:
    DeepSpeed qgZ's, one group per row of a (hidden, k * hidden) gradient, so ``hidden``); ``kernels``: the
    codec's kernel set in ``KernelCosts``."""
    name: str
    gather_bytes: float
    hpz: bool
    grad_bits: Optional[Tuple[int, int]]
    grad_group: Optional[int]
    kernels: Optional[str]


QWZ_BYTES = wire_bytes_per_element(8, QWZ_GROUP)
METHODS = {
    "zero3": Method("zero3", 2.0, False, None, None, None),
    "zeropp": Method("zeropp", QWZ_BYTES, True, (4, 4), None, "deepspeed"),
    "plain4": Method("plain4", QWZ_BYTES, True, (4, 4), 256, "plain 4/4"),
    "loco4": Method("loco4", QWZ_BYTES, True, (4, 4), 256, "loco 4/4"),
    "loco8-2h": Method("loco8-2h", QWZ_BYTES, True, (8, 2), 256, "loco 8/2+H"),
}

# benchmarks/kernels.py rows (kernel_times.json's) per kernel set, (kernel, config) for hop 1, hop 2 and the final mean.
KERNEL_ROWS = {
    "deepspeed": (("deepspeed swizzle_quant", "4/4"), ("deepspeed quantized_reduction", "4/4"),
                  ("deepspeed dequantize", "4/4")),
    "plain 4/4": (("plain hop1 (no err)", "4/4"), ("plain hop2 (no err)", "4/4"), ("loco final mean", "4/4")),
    "loco 4/4": (("loco hop1 (int8 err)", "4/4"), ("loco hop2 (int8 err)", "4/4"), ("loco final mean", "4/4")),
    "loco 8/2+H": (("loco hop1 (int8 err)", "8/2+H"), ("loco hop2 (int8 err)", "8/2+H"),
                   ("loco final mean", "8/2+H")),
}
KERNEL_TIMES = Path(__file__).with_name("kernel_times.json")  # package data: median ms per kernel, with provenance


def _default_kernel_times() -> Tuple[Dict[Tuple[str, str], float], int, float, str]:
    """``(ms per (kernel, config), elements, hbm_tbps, source)`` of the shipped :data:`KERNEL_TIMES`."""
    table = json.loads(KERNEL_TIMES.read_text())
    source = f"defaults: {table['device']}, {table['measured']} (deepspeed_loco/perf/{KERNEL_TIMES.name}), scaled by HBM"
    return ({(r["kernel"], r["config"]): r["ms"] for r in table["rows"]}, table["elements"], table["hbm_tbps"],
            source)


DEFAULT_KERNEL_MS, DEFAULT_KERNEL_ELEMENTS, DEFAULT_KERNEL_HBM_TBPS, DEFAULT_KERNEL_SOURCE = _default_kernel_times()


@dataclass(frozen=True)
class KernelCosts:
    """Seconds per gradient element (of one GPU's whole gradient) of each kernel set's three kernels together,
    on the GPU they were measured on (``hbm_tbps``; None: use them as they are on any GPU)."""
    per_element_s: Dict[str, float]
    hbm_tbps: Optional[float]
    source: str

    def seconds(self, kernels: str, elements: float, gpu: Gpu) -> float:
        """Seconds of kernel set ``kernels`` on ``elements`` gradient elements on ``gpu``: memory-bound, so scaled
        by the ratio of HBM bandwidths when measured on another GPU."""
        scale = self.hbm_tbps / gpu.hbm_tbps if self.hbm_tbps else 1.0
        return self.per_element_s[kernels] * elements * scale


def kernel_costs(milliseconds: Dict[Tuple[str, str], float], elements: int, hbm_tbps: Optional[float],
                 source: str) -> KernelCosts:
    """Per-element costs of every kernel set from per-kernel median milliseconds on ``elements`` elements."""
    per_element = {name: sum(milliseconds[row] for row in rows) * 1e-3 / elements
                   for name, rows in KERNEL_ROWS.items()}
    return KernelCosts(per_element, hbm_tbps, source)


DEFAULT_KERNELS = kernel_costs(DEFAULT_KERNEL_MS, DEFAULT_KERNEL_ELEMENTS, DEFAULT_KERNEL_HBM_TBPS,
                               DEFAULT_KERNEL_SOURCE)


def load_kernel_costs(path: str) -> KernelCosts:
    """Kernel costs from ``benchmarks/kernels.py --json`` output (``{"device", "copy_gbps", "rows": [{"kernel",
    "config", "shape", "dtype", "ms", ...}], "buckets"}``): the rows of the largest shape, bf16 over fp16, scaled
    to ``DEFAULT_KERNEL_ELEMENTS``. Times are the JSON's device's, used unscaled on any ``--gpu``; a kernel
    without a row (an older JSON has no DeepSpeed dequantize) keeps its H200 default, also unscaled."""
    with open(path) as f:
        rows = json.load(f).get("rows")
    if not rows or not all({"kernel", "config", "shape", "dtype", "ms"} <= set(r) for r in rows):
        raise ValueError(f"{path}: expected the JSON of benchmarks/kernels.py --json, a 'rows' list of "
                         "{kernel, config, shape, dtype, ms}")
    largest = max(r["shape"][0] * r["shape"][1] for r in rows)
    measured = {}
    for dtype in ("fp16", "bf16"):  # bf16 last, so it wins
        for r in rows:
            if r["shape"][0] * r["shape"][1] == largest and r["dtype"] == dtype:
                measured[(r["kernel"], r["config"])] = r["ms"] * DEFAULT_KERNEL_ELEMENTS / largest
    missing = sorted(k[0] for k in DEFAULT_KERNEL_MS if k not in measured)
    merged = {**DEFAULT_KERNEL_MS, **measured}
    note = f"; H200 defaults for {', '.join(missing)}" if missing else ""
    return kernel_costs(merged, DEFAULT_KERNEL_ELEMENTS, None, f"{path} ({largest} elements){note}")


@dataclass(frozen=True)
class Prediction:
    """One step: ``compute_s`` (matmuls), ``gpu_fixed_s`` (the GPU's work per step that does not grow with the tokens:
    the optimizer step and ZeRO's copies of this GPU's partition; from a calibration, else 0), ``engine_s`` (the
    engine's host time per step, overlapping the GPU's work; from a calibration, else 0), ``kernel_s`` (gradient
    codec), ``collectives`` (seconds per kind), ``comm_s`` (their sum), ``exposed_s`` (communication not hidden
    behind compute), ``step_s``; rates per second and per GPU."""
    method: str
    overlap: bool
    compute_s: float
    gpu_fixed_s: float
    engine_s: float
    kernel_s: float
    collectives: Dict[str, float]
    comm_s: float
    exposed_s: float
    step_s: float
    tokens_per_s: float
    tflops_per_gpu: float


def collective_seconds(workload: Workload, cluster: Cluster, method: Method) -> Dict[str, float]:
    """Seconds of each collective in one step: one call per layer per kind, each on ``params / layers``
    elements (DeepSpeed fetches and reduces per layer: ZeRO-3's 2 all-gathers and 1 reduction)."""
    topo = cluster.topology()
    layers = workload.layers
    per_layer = workload.params / layers
    gather = per_layer * method.gather_bytes
    backward = intra_node_all_gather_s(gather, topo) if method.hpz else ring_all_gather_s(gather, topo)
    times = {"forward_all_gather_s": layers * ring_all_gather_s(gather, topo),
             "backward_all_gather_s": layers * backward}
    if method.grad_bits is None:
        times["reduce_scatter_s"] = layers * ring_reduce_scatter_s(per_layer * 2.0, topo)
        return times
    group = method.grad_group or workload.hidden
    intra_bits, inter_bits = method.grad_bits
    hop1 = per_layer * wire_bytes_per_element(intra_bits, group)
    hop2 = per_layer / cluster.gpus_per_node * wire_bytes_per_element(inter_bits, group)
    times["intra_all_to_all_s"] = layers * intra_node_all_to_all_s(hop1, topo)
    times["inter_all_to_all_s"] = layers * inter_node_all_to_all_s(hop2, topo)
    return times


def exposed_seconds(collectives: Dict[str, float], compute_s: float, layers: int, overlap: bool) -> float:
    """Communication the step waits for. Without overlap, all of it. With overlap, the first layer's forward
    all-gather (nothing to hide it behind) and the last layer's gradient reduction (after the backward ends),
    plus whatever of the rest outlasts the compute."""
    total = sum(collectives.values())
    if not overlap:
        return total
    reduction = total - collectives["forward_all_gather_s"] - collectives["backward_all_gather_s"]
    edges = (collectives["forward_all_gather_s"] + reduction) / layers
    return edges + max(0.0, total - edges - compute_s)


def predict(workload: Workload, cluster: Cluster, method: Method, kernels: KernelCosts = DEFAULT_KERNELS,
            overlap: bool = False, engine_s: float = 0.0, gpu_fixed_s: float = 0.0) -> Prediction:
    """Step time: the longer of the GPU's work (compute plus ``gpu_fixed_s``, the per-step work that does not grow
    with the tokens) and ``engine_s`` (the engine's host time per step, which overlaps the GPU's work; both
    calibrated by :mod:`deepspeed_loco.perf.calibration`, else 0), plus the codec kernels, plus the exposed
    communication (hidden only behind the compute: the optimizer step comes after the last reduction). The kernels
    are never hidden: they share the SMs with the compute, and each sits in the dependency chain of the hop it
    feeds; on one GPU nothing is reduced, so they do not run. ``overlap`` off (the default) is the variant that
    reproduces the published ZeRO++ gains (``benchmarks/published.py``); on, the full-overlap bound."""
    flops = workload.flops_per_gpu()
    compute = flops / cluster.sustained_flops
    kernel = kernels.seconds(method.kernels, workload.params, cluster.gpu) if method.kernels and cluster.gpus > 1 \
        else 0.0
    collectives = collective_seconds(workload, cluster, method)
    exposed = exposed_seconds(collectives, compute, workload.layers, overlap)
    step = max(compute + gpu_fixed_s, engine_s) + kernel + exposed
    return Prediction(method.name, overlap, compute, gpu_fixed_s, engine_s, kernel, collectives,
                      sum(collectives.values()), exposed, step, workload.tokens_per_gpu * cluster.gpus / step,
                      flops / step / 1e12)
