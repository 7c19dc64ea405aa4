"""The demo's run settings and the DeepSpeed config of each arm (the arms themselves are the library's)."""
from dataclasses import dataclass, replace
from typing import Any, Optional, Tuple

from deepspeed_loco.simulation.arms import GRAMMAR, KINDS, Arm, parse_arm, parse_arms, zeropp_loco_param  # noqa: F401
from deepspeed_loco.simulation.records import record_arm  # noqa: F401  (the demo's records are the library's)
from loco_lab.model import ModelConfig

DEVICES = ("cpu", "cuda")
BACKENDS = ("nccl", "gloo")


@dataclass(frozen=True)
class RunSpec:
    """Everything a worker needs to train the arms; the same in every rank and picklable.

    ``device``: "cpu" or "cuda" (rank r takes GPU ``r % device_count``, so ranks may share GPUs). ``backend``: the
    collectives, "gloo" (any device) or "nccl" (CUDA with one GPU per rank: NCCL refuses two ranks on one GPU).
    """
    model: ModelConfig
    arms: Tuple[Arm, ...]
    steps: int = 100
    micro_batch: int = 8
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 15
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    group_size: int = 256
    err_beta: float = 0.8
    reset_T: int = 1024
    nodes: int = 2
    local: int = 2
    device: str = "cpu"
    backend: str = "gloo"
    dtype: str = "fp32"
    eval_every: int = 20
    eval_windows: int = 128
    eval_batch: int = 16
    out_dir: str = "."
    fidelity: bool = True  # measure the communicated gradient against the exact mean (demo/fidelity.py)
    text: Optional[str] = None  # the user's own training text (a file or a folder of .txt); None: the bundled plays
    quant_grid: str = "auto"
    # further zeropp_loco_param keys of every qgZ arm, as (key, value) pairs: e.g. (("error_bits", 4),)
    loco_settings: Tuple[Tuple[str, Any], ...] = ()

    def __post_init__(self):
        if self.device not in DEVICES:
            raise ValueError(f"device {self.device!r}: must be one of {DEVICES}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend {self.backend!r}: must be one of {BACKENDS}")
        if self.backend == "nccl" and self.device != "cuda":
            raise ValueError("backend 'nccl' needs device 'cuda'")

    @property
    def world_size(self) -> int:
        return self.nodes * self.local

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.world_size

    def with_arms(self, arms) -> "RunSpec":
        return replace(self, arms=tuple(arms))


def ds_config(spec: RunSpec, arm: Arm) -> dict:
    """The DeepSpeed config of ``arm``: ZeRO-3, AdamW, warm-up + cosine decay, and for qgZ arms LoCo's block."""
    zero = {
        "stage": 3,
        "overlap_comm": False,
        "contiguous_gradients": True,
        "reduce_bucket_size": 50_000_000,
    }
    settings = dict(err_beta=spec.err_beta, reset_T=spec.reset_T, group_size=spec.group_size,
                    quant_grid=spec.quant_grid, local_world_size=spec.local)
    loco = zeropp_loco_param(arm, **{**settings, **dict(spec.loco_settings)})
    if loco is not None:
        zero["zero_quantized_gradients"] = True
        zero["zeropp_loco_param"] = loco
    config = {
        "train_micro_batch_size_per_gpu": spec.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": spec.grad_clip,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": spec.lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": spec.weight_decay,
                       "torch_adam": True},
        },
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {"total_num_steps": spec.steps, "warmup_num_steps": spec.warmup, "warmup_type": "linear",
                       "warmup_min_ratio": 0.0, "cos_min_ratio": spec.min_lr_ratio},
        },
        "zero_optimization": zero,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if spec.dtype == "bf16":
        config["bf16"] = {"enabled": True}
    elif spec.dtype == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 16}
    return config
