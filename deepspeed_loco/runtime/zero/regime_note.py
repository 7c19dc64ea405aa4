"""What the regime map says about a run's bits and error feedback, as one start-up note: :func:`regime_note`.

The regime map (``docs/config.md``, "When LoCo pays") measured three settings on the default grid: 2 bits on
every hop (mid-rise: plain qgZ lost loss and LoCo won part of it back; on the symmetric grid LoCo's sign flipped
with the model), 4/4 and 8/2 + Hadamard (LoCo did not lower the loss: pooled, +0.0005 and -0.0009 nats, both within
noise). A run whose hops all send 2 bits on the mid-rise grid without error feedback, or that keeps error buffers
where the map found them useless, gets a note naming the key to change; every other run gets none (the map says
nothing about it).
"""
from typing import Optional

from deepspeed_loco.layout import HopPlan

MAP = 'docs/config.md, "When LoCo pays"'


def regime_note(plan: HopPlan, error_feedback: bool) -> Optional[str]:
    """The note for a run of ``plan``'s hops with ``error_feedback`` on or off, or None (no hop, or a setting the
    map did not measure, or one it agrees with)."""
    per_hop = [hop.bits for hop in plan.hops]  # intra-node first
    if not per_hop:
        return None
    if max(per_hop) == 2 and not error_feedback and plan.grid == "midrise":
        return (f"deepspeed-loco: every hop sends 2 bits without error feedback; in the regime map ({MAP}) plain "
                f"qgZ lost loss at 2 bits and LoCo won part of it back: consider zeropp_loco_param.error_feedback: "
                f"true")
    if error_feedback and (min(per_hop) >= 4 or (plan.hadamard and per_hop == [8, 2])):
        return (f"deepspeed-loco: LoCo error feedback at {'/'.join(map(str, per_hop))} bits"
                f"{' + Hadamard' if plan.hadamard else ''}: in the regime map ({MAP}) LoCo did not lower the "
                f"loss at such bits; zeropp_loco_param.error_feedback: false saves its error buffers")
    return None
