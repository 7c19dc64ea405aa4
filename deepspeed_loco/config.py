"""The validated ``zero_optimization.zeropp_loco_param`` block.

``err_beta`` and ``reset_T`` keep the meaning they had in DeepSpeed 0.16.2-0.19.7; every other key is
new, has a default, and is documented in ``docs/config.md``. Validation is pydantic's (strict types: ``"0.8"``
is not a float, ``true`` is not an integer); every failure is a :class:`LocoConfigError` whose message names
``zeropp_loco_param.<key>``, the bad value and what is valid.
"""
from typing import Annotated, Any, Literal, Mapping, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from deepspeed_loco.layout import formats, limits

CONFIG_KEY = "zeropp_loco_param"
SUPPORTED_GRAD_BITS = limits.WIRE_BITS  # the kernels' limits, written once in csrc/quantization/loco_limits.h
SUPPORTED_ERROR_BITS = tuple(storage.bits for storage in formats.STORED)  # the error buffers' formats: 4, 8, 32
INTER_NODE_ONLY = "inter_node"  # error_feedback: only the inter-node hop keeps error
MIN_GROUP_SIZE = limits.MIN_GROUP_SIZE
MAX_GROUP_SIZE = limits.MAX_GROUP_SIZE
ON_CORRUPT_CHECKPOINT = ("error", "reset")
QUANT_GRIDS = ("auto", ) + formats.GRID_NAMES  # "auto", then the grids' names
KERNEL_CHOICES = ("auto", "cuda", "reference")


def _either(values) -> str:
    """``'"a", "b" or "c"'``: a key's valid JSON strings, for its error message."""
    quoted = [f'"{v}"' for v in values]
    return ", ".join(quoted[:-1]) + " or " + quoted[-1]


class LocoConfigError(ValueError):
    """A ``zeropp_loco_param`` value is invalid; the message names the key and what is valid."""


def _power_of_two(value: int) -> int:
    if value & (value - 1):
        raise ValueError("not a power of two")
    return value


def _rule(text: str, **constraints) -> Any:
    """A field's pydantic constraints; ``text`` says what is valid and ends the error message."""
    return Field(description=text, **constraints)


class LocoConfig(BaseModel):
    """LoCo settings for one reduce (immutable; build with keywords or :meth:`from_dict`).

    err_beta: moving-average weight of the old error, ``0 <= err_beta < 1`` (0 is classic error feedback).
    reset_T: all error buffers are zeroed every ``reset_T`` optimizer steps.
    intra_node_bits / inter_node_bits: gradient bits on the ``intra_node`` and ``inter_node`` hops.
    group_size: elements per quantization group (a power of two); one fp32 scale per group travels with the data.
    error_bits: storage of the error buffers: 8 (int8 with one fp32 scale per group, the default), 4 (4-bit values,
        two per byte, with one fp32 scale per group: half the bytes) or 32 (fp32).
    error_feedback: which hops keep an error buffer. True (the default, upstream's meaning): every hop. False: none,
        plain qgZ through the same path (the A/B baseline). "inter_node": only the inter-node hop (about ``N / L``
        values per rank instead of ``N (1 + 1/L)``); the intra-node hop quantizes without compensation, so pair it
        with more intra-node bits (8/2). With one node there is no inter-node hop and error feedback is off (logged);
        with one rank per node the inter-node hop is the only hop, so it equals True.
    checkpoint_error_state: True (the default): checkpoints carry the error buffers and a resume is exact. False:
        checkpoints leave them out (the error state is the largest part of a LoCo checkpoint); a resume starts the
        buffers from zero, as a ``reset_T`` reset does, and logs so.
    local_world_size: ranks per node; None takes it from the launcher (``LOCAL_WORLD_SIZE``).
    on_corrupt_checkpoint: what loading a checkpoint whose LoCo state is corrupt or truncated does: "error" (raise
        ``LocoCheckpointError``) or "reset" (start the error buffers from zero with a WARNING).
    hadamard: rotate every quantization group by a randomized Hadamard transform before quantizing (and back
        after the final sum); the same fixed signs on every rank.
    exact_own_block: in each hop the block a rank sends to itself (it never crosses the wire) is not quantized and
        keeps no error rows: its exact fp32 values (rotated with ``hadamard``) go to the next hop or the final mean in
        a per-bucket fp32 buffer and are added after the other blocks. The error buffers lose 1/L of the intra-node
        hop's rows (``W - M``) and one of the inter-node hop's ``M``; a bucket holds ``N_bucket / L`` fp32 values
        between the hops and ``N_bucket / W`` before the final mean; the kernels take longer (hop 1 +6-9%, hop 2
        +19-25% on an H100, ``docs/config.md``). False (the default): every block quantized, as DeepSpeed's qgZ and
        LoCo did.
    quant_grid: the gradient quantization grid of ``b`` bits with group scale ``s``. "symmetric": levels ``k*s``,
        ``k`` in ``[-qmax, qmax]``, ``qmax = 2^(b-1) - 1``, ``s = absmax / qmax``. "midrise": levels ``(k + 0.5)*s``,
        ``k`` in ``[-2^(b-1), 2^(b-1) - 1]``, ``s = absmax / (2^(b-1) - 0.5)``: every code is used. "auto" (the
        default): "midrise" when a hop of the reduce sends 2 bits (measured better there, ``docs/config.md``),
        otherwise "symmetric" (what DeepSpeed's qgZ and its LoCo used); the hop plan resolves it.
    kernels: the implementation of the ``deepspeed_loco`` ops for CUDA tensors (``deepspeed_loco.ops.kernels_for``).
        "auto" (the default): the fused CUDA kernels when they build and load, else the PyTorch reference (logged
        with the reason). "cuda": the fused kernels, failing to build or load them is an error. "reference": the
        PyTorch reference (A/B checks, debugging). CPU tensors always run the reference. The environment variable
        ``DS_LOCO_KERNELS``, when set, overrides this key (logged).
    rho_every: measure rho live (:mod:`deepspeed_loco.runtime.comm.noise_stats`) on every ``rho_every``-th
        optimizer step (its micro-steps' reduces emit the norms, one all-reduce of a few scalars at its end); 0:
        never. Steps not measured cost nothing.
    rho_log_every: global rank 0 logs one line saying what the live rho means every ``rho_log_every`` optimizer
        steps (once a measurement exists); 0: never.
    error_norm_every: with a DeepSpeed monitor on, rank 0's telemetry writes ``LoCo/error_rel_norm`` (it reads the
        error buffers) on every ``error_norm_every``-th optimizer step only; 0: never; None (the default):
        ``rho_every``'s steps, so that the measured steps coincide.
    telemetry_every: with a DeepSpeed monitor on, rank 0 writes LoCo's byte counts and resets every
        ``telemetry_every``-th optimizer step, per step over the steps since its previous write (the error norm and
        the live rho on their own steps); 1: every step.
    """
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, validate_default=True)

    err_beta: Annotated[float, _rule("a float with 0 <= err_beta < 1", ge=0.0, lt=1.0)] = 0.8
    reset_T: Annotated[int, _rule("an integer >= 1 (optimizer steps)", ge=1)] = 1024
    intra_node_bits: Annotated[Literal[SUPPORTED_GRAD_BITS], _rule(f"one of {SUPPORTED_GRAD_BITS}")] = 4
    inter_node_bits: Annotated[Literal[SUPPORTED_GRAD_BITS], _rule(f"one of {SUPPORTED_GRAD_BITS}")] = 4
    group_size: Annotated[int, _rule(f"a power of two from {MIN_GROUP_SIZE} to {MAX_GROUP_SIZE}", ge=MIN_GROUP_SIZE,
                                     le=MAX_GROUP_SIZE), AfterValidator(_power_of_two)] = 256
    error_bits: Annotated[Literal[SUPPORTED_ERROR_BITS], _rule(f"one of {SUPPORTED_ERROR_BITS}")] = 8
    error_feedback: Annotated[Union[bool, Literal[INTER_NODE_ONLY]],
                              _rule(f'true, false or "{INTER_NODE_ONLY}"')] = True
    local_world_size: Annotated[Optional[int], _rule("an integer >= 1, or null for the launcher's", ge=1)] = None
    on_corrupt_checkpoint: Annotated[Literal[ON_CORRUPT_CHECKPOINT], _rule('"error" or "reset"')] = "error"
    hadamard: Annotated[bool, _rule("true or false")] = False
    exact_own_block: Annotated[bool, _rule("true or false")] = False
    quant_grid: Annotated[Literal[QUANT_GRIDS], _rule(_either(QUANT_GRIDS))] = "auto"
    kernels: Annotated[Literal[KERNEL_CHOICES], _rule('"auto", "cuda" or "reference"')] = "auto"
    rho_every: Annotated[int, _rule("an integer >= 0 (optimizer steps between measurements; 0: off)", ge=0)] = 10
    rho_log_every: Annotated[int, _rule("an integer >= 0 (optimizer steps between log lines; 0: never)", ge=0)] = 100
    error_norm_every: Annotated[Optional[int], _rule("an integer >= 0 (0: never), or null for rho_every's steps",
                                                     ge=0)] = None
    telemetry_every: Annotated[int, _rule("an integer >= 1 (optimizer steps between writes of the byte counts)",
                                          ge=1)] = 10
    checkpoint_error_state: Annotated[bool, _rule("true or false")] = True

    def __init__(self, **values: Any):
        """Validates ``values``; raises :class:`LocoConfigError` naming every bad or unknown key."""
        try:
            super().__init__(**values)
        except ValidationError as err:
            raise LocoConfigError(_describe(type(self), err)) from None

    @classmethod
    def from_dict(cls, params: Optional[Mapping[str, Any]]) -> "LocoConfig":
        """Builds the config from a ``zeropp_loco_param`` mapping (None: all defaults); unknown keys are an error."""
        if params is None:
            return cls()
        if not isinstance(params, Mapping):
            raise LocoConfigError(f"{CONFIG_KEY} must be a JSON object (dict), got {type(params).__name__}")
        return cls(**params)

    def to_dict(self) -> dict:
        """Every key with its value, as :meth:`from_dict` takes it."""
        return self.model_dump()


def _describe(model: type, err: ValidationError) -> str:
    """One message for a failed validation: the unknown keys with the valid ones, then each bad value's rule."""
    problems = err.errors()
    unknown = sorted(str(p["loc"][0]) for p in problems if p["type"] == "extra_forbidden")
    messages = []
    if unknown:
        messages.append(f"{CONFIG_KEY}: unknown key(s) {unknown}; valid keys are {sorted(model.model_fields)}")
    for problem in problems:
        if problem["type"] != "extra_forbidden":
            key = str(problem["loc"][0])
            message = (f"{CONFIG_KEY}.{key} = {problem['input']!r} is invalid: it must be "
                       f"{model.model_fields[key].description}")
            if message not in messages:  # a union (error_feedback) reports each of its members
                messages.append(message)
    return "; ".join(messages)
