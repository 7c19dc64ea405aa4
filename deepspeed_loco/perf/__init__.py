"""Cluster step-time model: compute, codec kernels and NCCL collectives per method (docs/performance.md)."""
from deepspeed_loco.perf.model import GPUS, METHODS, Cluster, Prediction, Workload, predict

__all__ = ["GPUS", "METHODS", "Cluster", "Prediction", "Workload", "predict"]
