"""The arms of a comparison: full-precision reduce, plain qgZ, or qgZ + LoCo, with bits per hop and Hadamard."""
import re
from dataclasses import asdict, dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

from deepspeed_loco.config import SUPPORTED_GRAD_BITS

KINDS = ("full", "plain", "loco")
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
    arms = tuple(parse_arm(token, bits) for token in (t.strip() for t in text.split(",")) if token)
    check_distinct(arms)
    return arms


def check_distinct(arms: Sequence[Arm]) -> None:
    """Raises ValueError for an empty list of arms, or one naming the arms given more than once (by key)."""
    if not arms:
        raise ValueError(f"no arm given; {GRAMMAR}")
    keys = [arm.key for arm in arms]
    twice = sorted({key for key in keys if keys.count(key) > 1})
    if twice:
        raise ValueError(f"arm(s) {', '.join(twice)} given more than once")


def zeropp_loco_param(arm: Arm, **settings: Any) -> Optional[Dict[str, Any]]:
    """The ``zeropp_loco_param`` block of a qgZ ``arm`` (its bits, Hadamard and error feedback) over ``settings``
    (other keys of the block: ``group_size``, ``err_beta``, ``error_bits``, ...); None for the full-precision arm.
    A LoCo arm's error feedback is ``settings["error_feedback"]`` when given (``"inter_node"`` narrows it to that
    hop), else True; a plain arm's is always False."""
    if arm.kind == "full":
        return None
    feedback = settings.pop("error_feedback", True)
    if arm.kind == "loco" and feedback is False:
        raise ValueError(f"arm {arm.key}: a LoCo arm keeps error on some hop; error_feedback False is a plain arm")
    feedback = feedback if arm.kind == "loco" else False
    return {**settings, "intra_node_bits": arm.intra_bits, "inter_node_bits": arm.inter_bits,
            "hadamard": arm.hadamard, "error_feedback": feedback}
