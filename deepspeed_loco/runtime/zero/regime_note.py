"""What the regime map says about LoCo at a bit setting (:func:`map_reading`) and the start-up note it gives a run
(:func:`regime_note`).

The regime map (``docs/config.md``, "When LoCo pays") measured three settings on the default grid: 2 bits on
every hop (mid-rise: plain qgZ lost loss and LoCo won part of it back, pooled over its regimes; on the symmetric
grid LoCo's sign flipped with the model), 4/4 and 8/2 + Hadamard (LoCo did not lower the loss: pooled, +0.0002 and
-0.0009 nats, both within noise). A run whose hops all send 2 bits on the mid-rise grid without error feedback, or
that keeps error buffers where the map found them useless, gets a note naming the key to change; every other run
gets none (the map says nothing about it). ``advise`` (``deepspeed_loco.simulation``) takes its prior from the same
reading.
"""
from typing import Optional, Sequence

from deepspeed_loco.layout import HopPlan

MAP = 'docs/config.md, "When LoCo pays"'
LOCO_PAYS = "pays"  # the map's pooled LoCo - plain lies below 0
LOCO_IDLE = "idle"  # the map's pooled LoCo - plain is 0 within noise


def map_reading(bits: Sequence[int], hadamard: bool, grid: str) -> Optional[str]:
    """What the map measured for LoCo on hops sending ``bits`` (intra-node first; one entry for a one-hop run) with
    ``hadamard`` on the resolved ``grid`` ("symmetric" or "midrise"): :data:`LOCO_PAYS` for 2 bits on every hop on
    the mid-rise grid without Hadamard, :data:`LOCO_IDLE` for >= 4 bits on every hop or 8/2 + Hadamard, None for
    what it did not measure or resolve (no hop, 2/2 on the symmetric grid or with Hadamard, 3 bits, 4/2, ...)."""
    bits = list(bits)
    if not bits:
        return None
    if max(bits) == 2 and grid == "midrise" and not hadamard:
        return LOCO_PAYS
    if min(bits) >= 4 or (hadamard and bits == [8, 2]):
        return LOCO_IDLE
    return None


def regime_note(plan: HopPlan, error_feedback: bool) -> Optional[str]:
    """The note for a run of ``plan``'s hops with ``error_feedback`` on or off, or None (no hop, or a setting the
    map did not measure, or one it agrees with)."""
    bits = [hop.bits for hop in plan.hops]  # intra-node first
    reading = map_reading(bits, plan.hadamard, plan.grid)
    if reading == LOCO_PAYS and not error_feedback:
        return (f"deepspeed-loco: every hop sends 2 bits without error feedback; in the regime map ({MAP}) plain "
                f"qgZ lost loss at 2 bits and LoCo won part of it back: consider zeropp_loco_param.error_feedback: "
                f"true")
    if reading == LOCO_IDLE and error_feedback:
        return (f"deepspeed-loco: LoCo error feedback at {'/'.join(map(str, bits))} bits"
                f"{' + Hadamard' if plan.hadamard else ''}: in the regime map ({MAP}) LoCo did not lower the "
                f"loss at such bits; zeropp_loco_param.error_feedback: false saves its error buffers")
    return None
