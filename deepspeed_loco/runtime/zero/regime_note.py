"""The start-up note a run gets from the findings (:func:`regime_note`), read through
:func:`deepspeed_loco.findings.read_map`: one short line. Inside a measured window, error feedback off where LoCo
paid, on where its gain is unproven, and on where it changed nothing each get what was measured (the row's few-word
note) and what to change or check; a run with error feedback on, of a measured setting outside every window
measured for it (or with inter-node error only, where the one gain measured had error feedback on both hops), gets
"not in the measurements" and where to look; every other run gets none. Each note names the command that prints the
whole table."""
from typing import Optional

from deepspeed_loco.config import INTER_NODE_ONLY
from deepspeed_loco.findings import LOCO_IDLE, LOCO_PAYS, LOCO_UNPROVEN, MAP, measured_window, read_map
from deepspeed_loco.layout import HopPlan
from deepspeed_loco.utils.sizes import parameter_count

ACTIONS = {  # (reading, error feedback on) -> what the note asks for; other pairs: the map agrees, no note
    (LOCO_PAYS, False): "consider error_feedback: true",
    (LOCO_UNPROVEN, True): "measure it first (deepspeed-loco-advise)",
    (LOCO_IDLE, True): "error_feedback: false saves memory",
}
TABLE_COMMAND = "python -m deepspeed_loco.findings"
NOT_MEASURED = "measure it: deepspeed-loco-advise, the live rho (rho_every)"
NOTE_MAX_CHARS = 250  # the note is one line a user reads at start-up


FEEDBACK_WORDS = {True: "LoCo error feedback", INTER_NODE_ONLY: "inter-node LoCo",
                  False: "no LoCo error feedback"}


def regime_note(plan: HopPlan, error_feedback, params: int, tokens_per_step: Optional[int] = None,
                error_bits: int = 8) -> Optional[str]:
    """The note for a run of ``plan``'s hops with ``zeropp_loco_param.error_feedback`` (True, False or
    ``"inter_node"``) and ``error_bits`` training ``params`` parameters at a global batch of ``tokens_per_step``
    tokens (None: unknown), or None (no hop, a setting never measured, or one whose measurement agrees with the run).
    A row measured for the run's error-state options alone (``findings.Finding.options``) wins over the setting's
    general row, and its own action over the reading's."""
    bits = [hop.bits for hop in plan.hops]  # intra-node first
    rows = [row for row in MAP if row.same_setting(bits, plan.hadamard, plan.grid)]
    if not rows:
        return None
    finding = read_map(bits, plan.hadamard, plan.grid, params, tokens_per_step,
                       options={"error_feedback": error_feedback, "error_bits": error_bits})
    head = (f"deepspeed-loco: {FEEDBACK_WORDS[error_feedback]} at {'/'.join(map(str, bits))} bits"
            f"{' + Hadamard' if plan.hadamard else ''} for {parameter_count(params)}")
    if finding is not None and _gain_of_both_hops_only(finding, error_feedback):
        rows = [row for row in rows if dict(row.options).get("error_feedback") == INTER_NODE_ONLY] or rows
        finding = None  # not in the measurements, with the option's own window
    if finding is None:  # a setting measured elsewhere: said where LoCo runs (plain qgZ needs no evidence of ours)
        return (f"{head}: not in the measurements ({TABLE_COMMAND}: {measured_window(rows)}); {NOT_MEASURED}"
                if error_feedback else None)
    action = finding.action or ACTIONS.get((finding.reading, bool(error_feedback)))
    return f"{head}: in the measurements ({TABLE_COMMAND}) {finding.note}; {action}" if action else None


def _gain_of_both_hops_only(finding, error_feedback) -> bool:
    """Whether ``finding`` is a gain measured with error feedback on both hops that a run with inter-node error
    alone would borrow: at 10.8M that option kept none of it, so a gain never speaks for it without its own row."""
    return finding.reading == LOCO_PAYS and error_feedback == INTER_NODE_ONLY and not finding.options
