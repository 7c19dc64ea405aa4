"""What the regime map says about LoCo at a bit setting and model size (:func:`map_reading`) and the start-up note
it gives a run (:func:`regime_note`).

The regime map (``docs/config.md``, "When LoCo pays") measured three settings on the default grid. 2 bits on every
hop on the mid-rise grid: plain qgZ lost loss at every model size, and LoCo won part of it back, resolved for the
0.87M and 10.8M models (:data:`LOCO_GAIN_MAX_PARAMS`); for the 116M model LoCo from step 1 started behind plain qgZ
(an early update burst; resolved at 16 ranks after 100 steps) and was catching up, so above that size its gain is
unproven. 4/4 and 8/2 + Hadamard: LoCo did not lower the loss (pooled within noise; at 4/4 it raised the 116M
model's). On the symmetric 2-bit grid LoCo's sign flipped with the model. A run whose hops all send 2 bits on the
mid-rise grid without error feedback at a size where LoCo paid, one with error feedback at a size where it is
unproven, and one that keeps error buffers where the map found them useless get a note naming what to change or
check; every other run gets none. ``advise`` (``deepspeed_loco.simulation``) takes its prior from the same reading.
"""
from typing import Optional, Sequence

from deepspeed_loco.layout import HopPlan

MAP = 'docs/config.md, "When LoCo pays"'
LOCO_PAYS = "pays"  # 2/2 mid-rise up to LOCO_GAIN_MAX_PARAMS: LoCo - plain below 0
LOCO_UNPROVEN = "unproven"  # 2/2 mid-rise above LOCO_GAIN_MAX_PARAMS: no gain resolved; 116M started behind
LOCO_IDLE = "idle"  # >= 4 bits or 8/2 + Hadamard: LoCo - plain 0 within noise, pooled (a cost at 4/4 at 116M)
LOCO_GAIN_MAX_PARAMS = 11_000_000  # LoCo's 2/2 gain resolved up to the map's 10.8M model: GAIN_RESOLVED_UP_TO
GAIN_RESOLVED_UP_TO = "10.8M parameters"


def map_reading(bits: Sequence[int], hadamard: bool, grid: str, params: int) -> Optional[str]:
    """What the map measured for LoCo on hops sending ``bits`` (intra-node first; one entry for a one-hop run) with
    ``hadamard`` on the resolved ``grid`` ("symmetric" or "midrise") for a model of ``params`` parameters:
    :data:`LOCO_PAYS` (2 bits on every hop, mid-rise, no Hadamard, at most :data:`LOCO_GAIN_MAX_PARAMS`),
    :data:`LOCO_UNPROVEN` (the same above it), :data:`LOCO_IDLE` (>= 4 bits on every hop, or 8/2 + Hadamard), or None
    for what it did not measure or resolve (no hop, 2/2 on the symmetric grid or with Hadamard, 3 bits, 4/2, ...)."""
    bits = list(bits)
    if not bits:
        return None
    if max(bits) == 2 and grid == "midrise" and not hadamard:
        return LOCO_PAYS if params <= LOCO_GAIN_MAX_PARAMS else LOCO_UNPROVEN
    if min(bits) >= 4 or (hadamard and bits == [8, 2]):
        return LOCO_IDLE
    return None


def regime_note(plan: HopPlan, error_feedback: bool, params: int) -> Optional[str]:
    """The note for a run of ``plan``'s hops with ``error_feedback`` on or off training ``params`` parameters, or
    None (no hop, a setting the map did not measure, or one it agrees with)."""
    bits = [hop.bits for hop in plan.hops]  # intra-node first
    reading = map_reading(bits, plan.hadamard, plan.grid, params)
    if reading == LOCO_PAYS and not error_feedback:
        return (f"deepspeed-loco: every hop sends 2 bits without error feedback; in the regime map ({MAP}) plain "
                f"qgZ lost loss at 2 bits and LoCo won part of it back at models of up to {GAIN_RESOLVED_UP_TO}: "
                f"consider zeropp_loco_param.error_feedback: true")
    if reading == LOCO_UNPROVEN and error_feedback:
        return (f"deepspeed-loco: LoCo error feedback at 2 bits on every hop for {params / 1e6:.0f}M parameters: "
                f"in the regime map ({MAP}) LoCo's gain at 2 bits was resolved only up to {GAIN_RESOLVED_UP_TO}, "
                f"and for the 116M model LoCo from step 1 started behind plain qgZ (an early burst of larger "
                f"updates) and was still behind after 100 steps on 16 and 64 ranks; measure it on your model before "
                f"a long run (deepspeed_loco.simulation.advise)")
    if reading == LOCO_IDLE and error_feedback:
        return (f"deepspeed-loco: LoCo error feedback at {'/'.join(map(str, bits))} bits"
                f"{' + Hadamard' if plan.hadamard else ''}: in the regime map ({MAP}) LoCo did not lower the "
                f"loss at such bits (at 4/4 it raised the 116M model's); zeropp_loco_param.error_feedback: false "
                f"saves its error buffers")
    return None
