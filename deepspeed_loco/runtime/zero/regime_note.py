"""The start-up note a run gets from the regime map (:func:`regime_note`), read through
:func:`deepspeed_loco.findings.read_map`: error feedback off where LoCo paid, on where its gain is unproven, and on
where it changed nothing each get a note naming what to change or check; every other run gets none."""
from typing import Optional

from deepspeed_loco.findings import LOCO_IDLE, LOCO_PAYS, LOCO_UNPROVEN, MAP_DOC, read_map
from deepspeed_loco.layout import HopPlan
from deepspeed_loco.utils.sizes import parameter_count

ACTIONS = {  # (reading, error feedback on) -> what the note asks for; other pairs: the map agrees, no note
    (LOCO_PAYS, False): "consider zeropp_loco_param.error_feedback: true",
    (LOCO_UNPROVEN, True): "measure it on your model before a long run (deepspeed_loco.simulation.advise)",
    (LOCO_IDLE, True): "zeropp_loco_param.error_feedback: false saves its error buffers",
}


def regime_note(plan: HopPlan, error_feedback: bool, params: int,
                tokens_per_step: Optional[int] = None) -> Optional[str]:
    """The note for a run of ``plan``'s hops with ``error_feedback`` on or off training ``params`` parameters at a
    global batch of ``tokens_per_step`` tokens (None: unknown), or None (no hop, a setting the map did not
    measure, or one it agrees with)."""
    bits = [hop.bits for hop in plan.hops]  # intra-node first
    finding = read_map(bits, plan.hadamard, plan.grid, params, tokens_per_step)
    action = ACTIONS.get((finding.reading, error_feedback)) if finding else None
    if action is None:
        return None
    setting = f"{'/'.join(map(str, bits))} bits{' + Hadamard' if plan.hadamard else ''}"
    return (f"deepspeed-loco: {'LoCo error feedback' if error_feedback else 'no LoCo error feedback'} at {setting} "
            f"for {parameter_count(params)}: in the measurements ({MAP_DOC}) {finding.summary}; {action}")

