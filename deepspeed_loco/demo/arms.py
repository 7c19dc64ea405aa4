"""The arms of the comparison and the DeepSpeed config of each."""
from dataclasses import asdict, dataclass, replace
from typing import Tuple

from deepspeed_loco.demo.model import ModelConfig

KINDS = ("full", "plain", "loco")


@dataclass(frozen=True)
class Arm:
    """``kind``: "full" (full-precision reduce-scatter), "plain" (qgZ, no error feedback) or "loco"."""
    kind: str
    bits: int = 4
    seed: int = 0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"arm kind {self.kind!r}: must be one of {KINDS}")

    @property
    def label(self) -> str:
        if self.kind == "full":
            return "full precision"
        return f"qgZ {self.bits}-bit" + (" + LoCo" if self.kind == "loco" else "")

    @property
    def key(self) -> str:
        return "full" if self.kind == "full" else f"{self.kind}{self.bits}"

    def to_dict(self) -> dict:
        return asdict(self)


def parse_arms(text: str, bits: int) -> Tuple[Arm, ...]:
    """``"full,plain,loco"`` (with ``bits``) or explicit ``"full,plain2,loco2"``."""
    arms = []
    for token in (t.strip() for t in text.split(",") if t.strip()):
        kind = token.rstrip("0123456789")
        digits = token[len(kind):]
        if kind not in KINDS or (kind == "full" and digits):
            raise ValueError(f"--arms: {token!r} is not one of full, plain[BITS], loco[BITS]")
        arms.append(Arm(kind, int(digits) if digits else bits))
    if not arms:
        raise ValueError("--arms: no arm given")
    return tuple(arms)


@dataclass(frozen=True)
class RunSpec:
    """Everything a worker needs to train the arms; the same in every rank and picklable."""
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
    dtype: str = "fp32"
    eval_every: int = 20
    eval_windows: int = 128
    eval_batch: int = 16
    out_dir: str = "."
    fidelity: bool = True  # measure the communicated gradient against the exact mean (demo/fidelity.py)

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
    if arm.kind != "full":
        zero["zero_quantized_gradients"] = True
        zero["zeropp_loco_param"] = {
            "err_beta": spec.err_beta,
            "reset_T": spec.reset_T,
            "intra_node_bits": arm.bits,
            "inter_node_bits": arm.bits,
            "group_size": spec.group_size,
            "error_feedback": arm.kind == "loco",
            "local_world_size": spec.local,
        }
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
