"""The arms of the comparison and the DeepSpeed config of each."""
import re
from dataclasses import asdict, dataclass, replace
from typing import Optional, Tuple

from deepspeed_loco.config import SUPPORTED_GRAD_BITS
from loco_lab.model import ModelConfig

KINDS = ("full", "plain", "loco")
DEVICES = ("cpu", "cuda")
BACKENDS = ("nccl", "gloo")
GRAMMAR = ("arms are 'full', or 'plain'/'loco' followed by an optional width W (both hops) or W-W (intra-node "
           "then inter-node hop), then an optional 'h' for Hadamard-rotated groups, with W in "
           f"{', '.join(map(str, SUPPORTED_GRAD_BITS))}; without a width both hops take the default bits "
           "(e.g. full, loco, plain4, loco2, loco8-2, loco4h, loco8-2h, plainh)")
_TOKEN = re.compile(r"(full|plain|loco)(?:([0-9]+)(?:-([0-9]+))?)?(h?)")


@dataclass(frozen=True)
class Arm:
    """One way of reducing the gradients.

    ``kind``: "full" (full-precision reduce-scatter), "plain" (qgZ, no error feedback) or "loco" (qgZ + LoCo).
    ``intra_bits`` / ``inter_bits``: gradient bits on the intra-node (hop 1) and inter-node (hop 2) all-to-all,
    each in ``SUPPORTED_GRAD_BITS``; None for "full", required otherwise. ``hadamard``: randomized Hadamard
    rotation of every quantization group (qgZ arms only). ``seed``: model initialisation and data order.
    """
    kind: str
    intra_bits: Optional[int] = None
    inter_bits: Optional[int] = None
    hadamard: bool = False
    seed: int = 0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"arm kind {self.kind!r}: must be one of {KINDS}")
        if not isinstance(self.hadamard, bool):
            raise ValueError(f"arm hadamard {self.hadamard!r}: must be True or False")
        if self.kind == "full":
            if (self.intra_bits, self.inter_bits, self.hadamard) != (None, None, False):
                raise ValueError("the full-precision arm takes no bit widths and no Hadamard rotation")
            return
        for name in ("intra_bits", "inter_bits"):
            value = getattr(self, name)
            if isinstance(value, bool) or value not in SUPPORTED_GRAD_BITS:
                raise ValueError(f"{self.kind} arm {name} = {value!r}: must be one of {SUPPORTED_GRAD_BITS}")

    @property
    def widths(self) -> str:
        """``"4"``: both hops carry 4 bits; ``"8/2"``: an 8-bit intra-node and a 2-bit inter-node hop; full: ``""``."""
        if self.kind == "full":
            return ""
        if self.intra_bits == self.inter_bits:
            return str(self.inter_bits)
        return f"{self.intra_bits}/{self.inter_bits}"

    @property
    def variant(self) -> str:
        """The quantization of a qgZ arm in words, without its kind: ``"8/2-bit + Hadamard"``; full: ``""``."""
        if self.kind == "full":
            return ""
        return f"{self.widths}-bit" + (" + Hadamard" if self.hadamard else "")

    @property
    def label(self) -> str:
        """``"full precision"``, ``"qgZ 4-bit"``, ``"qgZ 4-bit + LoCo"``, ``"qgZ 8/2-bit + LoCo + Hadamard"``."""
        if self.kind == "full":
            return "full precision"
        return f"qgZ {self.widths}-bit" + (" + LoCo" if self.kind == "loco" else "") + (
            " + Hadamard" if self.hadamard else "")

    @property
    def key(self) -> str:
        """The canonical token: ``full``, ``plain4``/``loco2`` (both hops), ``loco8-2`` (per hop), ``h`` suffix.

        ``parse_arm(arm.key)`` gives the arm back (seed aside); keys of equal-width arms without Hadamard are the
        ones the convergence benchmark has always written (``full``, ``plain4``, ``loco2``, ...).
        """
        if self.kind == "full":
            return "full"
        widths = self.widths.replace("/", "-")
        return f"{self.kind}{widths}" + ("h" if self.hadamard else "")

    def to_dict(self) -> dict:
        return asdict(self)


def parse_arm(token: str, bits: Optional[int] = None) -> Arm:
    """The arm named by ``token`` (see ``GRAMMAR``); a token without a width puts ``bits`` on both hops.

    Raises ValueError naming the token and the grammar if it is not an arm, or has no width and ``bits`` is None.
    """
    match = _TOKEN.fullmatch(token)
    if match is None:
        raise ValueError(f"arm {token!r} is invalid: {GRAMMAR}")
    kind, first, second, hadamard = match.groups()
    if kind == "full":
        if first or hadamard:
            raise ValueError(f"arm {token!r} is invalid: 'full' takes no width and no 'h'; {GRAMMAR}")
        return Arm("full")
    if first is None:
        if bits is None:
            raise ValueError(f"arm {token!r} has no width and no default bits were given; {GRAMMAR}")
        first = bits
    intra, inter = int(first), int(second if second is not None else first)
    for width in (intra, inter):
        if width not in SUPPORTED_GRAD_BITS:
            raise ValueError(f"arm {token!r} is invalid: width {width} is not one of {SUPPORTED_GRAD_BITS}; {GRAMMAR}")
    return Arm(kind, intra, inter, hadamard == "h")


def parse_arms(text: str, bits: int) -> Tuple[Arm, ...]:
    """A comma list of arm tokens (``"full,plain,loco"``, ``"full,plain2,loco8-2h"``); ``bits``: the default width.

    Raises ValueError for an invalid token (naming it and the grammar), an empty list or an arm given twice.
    """
    if bits not in SUPPORTED_GRAD_BITS:
        raise ValueError(f"default bits {bits!r}: must be one of {SUPPORTED_GRAD_BITS}")
    arms = [parse_arm(token, bits) for token in (t.strip() for t in text.split(",")) if token]
    if not arms:
        raise ValueError(f"no arm given; {GRAMMAR}")
    keys = [arm.key for arm in arms]
    twice = sorted({key for key in keys if keys.count(key) > 1})
    if twice:
        raise ValueError(f"arm(s) {', '.join(twice)} given more than once")
    return tuple(arms)


def record_arm(record: dict) -> Arm:
    """The arm of a result record (a demo result or a line of the benchmark's ``runs.jsonl``).

    Rebuilt from the record's ``key`` and ``arm.seed``, which every record has: older records hold
    ``{"kind", "bits", "seed"}`` in ``arm``, newer ones the fields of ``Arm``.
    """
    return replace(parse_arm(record["key"]), seed=record["arm"]["seed"])


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
    if arm.kind != "full":
        zero["zero_quantized_gradients"] = True
        zero["zeropp_loco_param"] = {
            "err_beta": spec.err_beta,
            "reset_T": spec.reset_T,
            "intra_node_bits": arm.intra_bits,
            "inter_node_bits": arm.inter_bits,
            "hadamard": arm.hadamard,
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
