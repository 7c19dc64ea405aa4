"""The validated ``zero_optimization.zeropp_loco_param`` block.

``err_beta`` and ``reset_T`` keep the meaning they had in DeepSpeed 0.16.2-0.19.7; every other key is
new, has a default, and is documented in ``docs/config.md``.
"""
from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping, Optional

CONFIG_KEY = "zeropp_loco_param"
SUPPORTED_GRAD_BITS = (2, 3, 4, 8)
SUPPORTED_ERROR_BITS = (8, 32)
MIN_GROUP_SIZE = 32
MAX_GROUP_SIZE = 4096
ON_CORRUPT_CHECKPOINT = ("error", "reset")
QUANT_GRIDS = ("symmetric", "midrise")


class LocoConfigError(ValueError):
    """A ``zeropp_loco_param`` value is invalid; the message names the key and what is valid."""


@dataclass(frozen=True)
class LocoConfig:
    """LoCo settings for one reduce.

    err_beta: moving-average weight of the old error, ``0 <= err_beta < 1`` (0 is classic error feedback).
    reset_T: all error buffers are zeroed every ``reset_T`` optimizer steps.
    intra_node_bits / inter_node_bits: gradient bits on the intra-node (hop 1) and inter-node (hop 2) all-to-all.
    group_size: elements per quantization group (a power of two); one fp32 scale per group travels with the data.
    error_bits: storage of the error buffers, 8 (int8 with one fp32 scale per group) or 32 (fp32).
    error_feedback: False gives plain qgZ through the same path (the A/B baseline).
    local_world_size: ranks per node; None takes it from the launcher (``LOCAL_WORLD_SIZE``).
    on_corrupt_checkpoint: what loading a checkpoint whose LoCo state is corrupt or truncated does: "error" (raise
        ``LocoCheckpointError``) or "reset" (start the error buffers from zero with a WARNING).
    hadamard: rotate every quantization group by a randomized Hadamard transform before quantizing (and back
        after the final sum); the same fixed signs on every rank.
    """
    err_beta: float = 0.8
    reset_T: int = 1024
    intra_node_bits: int = 4
    inter_node_bits: int = 4
    group_size: int = 256
    error_bits: int = 8
    error_feedback: bool = True
    local_world_size: Optional[int] = None
    on_corrupt_checkpoint: str = "error"
    hadamard: bool = False
    quant_grid: str = "symmetric"

    def __post_init__(self):
        _check_number("err_beta", self.err_beta, float, "a float with 0 <= err_beta < 1")
        if not 0.0 <= self.err_beta < 1.0:
            _fail("err_beta", self.err_beta, "a float with 0 <= err_beta < 1")
        _check_number("reset_T", self.reset_T, int, "an integer >= 1 (optimizer steps)")
        if self.reset_T < 1:
            _fail("reset_T", self.reset_T, "an integer >= 1 (optimizer steps)")
        for key in ("intra_node_bits", "inter_node_bits"):
            value = getattr(self, key)
            if isinstance(value, bool) or value not in SUPPORTED_GRAD_BITS:
                _fail(key, value, f"one of {SUPPORTED_GRAD_BITS}")
        _check_number("group_size", self.group_size, int, _group_size_rule())
        if not (MIN_GROUP_SIZE <= self.group_size <= MAX_GROUP_SIZE and self.group_size & (self.group_size - 1) == 0):
            _fail("group_size", self.group_size, _group_size_rule())
        if isinstance(self.error_bits, bool) or self.error_bits not in SUPPORTED_ERROR_BITS:
            _fail("error_bits", self.error_bits, f"one of {SUPPORTED_ERROR_BITS}")
        for key in ("error_feedback", "hadamard"):
            if not isinstance(getattr(self, key), bool):
                _fail(key, getattr(self, key), "true or false")
        if self.local_world_size is not None:
            _check_number("local_world_size", self.local_world_size, int, "an integer >= 1, or null for the launcher's")
            if self.local_world_size < 1:
                _fail("local_world_size", self.local_world_size, "an integer >= 1, or null for the launcher's")
        if self.on_corrupt_checkpoint not in ON_CORRUPT_CHECKPOINT:
            _fail("on_corrupt_checkpoint", self.on_corrupt_checkpoint, "\"error\" or \"reset\"")
        if self.quant_grid not in QUANT_GRIDS:
            _fail("quant_grid", self.quant_grid, "\"symmetric\" or \"midrise\"")

    @classmethod
    def from_dict(cls, params: Optional[Mapping[str, Any]]) -> "LocoConfig":
        """Builds the config from a ``zeropp_loco_param`` mapping; unknown keys are an error."""
        if params is None:
            return cls()
        if not isinstance(params, Mapping):
            raise LocoConfigError(f"{CONFIG_KEY} must be a JSON object (dict), got {type(params).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(params) - known)
        if unknown:
            raise LocoConfigError(f"{CONFIG_KEY}: unknown key(s) {unknown}; valid keys are {sorted(known)}")
        return cls(**params)

    def to_dict(self) -> dict:
        return asdict(self)


def _group_size_rule() -> str:
    return f"a power of two from {MIN_GROUP_SIZE} to {MAX_GROUP_SIZE}"


def _check_number(key: str, value: Any, kind: type, rule: str) -> None:
    ok = isinstance(value, (int, float)) if kind is float else isinstance(value, int)
    if isinstance(value, bool) or not ok:
        _fail(key, value, rule)


def _fail(key: str, value: Any, rule: str) -> None:
    raise LocoConfigError(f"{CONFIG_KEY}.{key} = {value!r} is invalid: it must be {rule}")
