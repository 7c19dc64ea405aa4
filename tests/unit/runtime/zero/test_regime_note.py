"""The start-up note from the regime map (``deepspeed_loco.findings``): 2 bits on every hop without error feedback
at a size where LoCo paid, error feedback at 2 bits where its gain is unproven, error feedback where the map found
it changed nothing, "not measured" outside a measured setting's windows, silence for a setting never measured or
one the map agrees with; every note one line of at most ``NOTE_MAX_CHARS`` naming the table's command."""
import pytest

from deepspeed_loco.config import LocoConfig
from deepspeed_loco.findings import LOCO_PAYS, LOCO_UNPROVEN, MAP, MAP_DOC, read_map
from deepspeed_loco.layout import plan_hops
from deepspeed_loco.runtime.zero.regime_note import (ACTIONS, NOT_MEASURED, NOTE_MAX_CHARS, TABLE_COMMAND,
                                                     regime_note)
from deepspeed_loco.utils.sizes import parameter_count

SMALL, LARGE = 10_818_432, 116_430_720  # the map's 10.8M and 116M models
GAIN_MAX_PARAMS = max(row.params[1] for row in MAP if row.reading == LOCO_PAYS and row.intra_bits == (2, 2)
                      and not row.options)  # the 2/2 gain's largest size


def _note(world, local, params=SMALL, tokens_per_step=None, **keys):
    config = LocoConfig.from_dict(keys)
    note = regime_note(plan_hops(world, local, config), config.error_feedback, params, tokens_per_step,
                       error_bits=config.error_bits)
    assert note is None or (len(note) <= NOTE_MAX_CHARS and "\n" not in note and f"({TABLE_COMMAND}" in note)
    assert note is None or MAP_DOC not in note  # a pip user has no docs/ folder
    return note


def _expected(bits, error_feedback, params, hadamard=False, grid="midrise"):
    """The note's parts: the setting it names, the row's note and the action for (reading, error feedback)."""
    row = read_map(bits, hadamard, grid, params)
    setting = f"{'LoCo error feedback' if error_feedback else 'no LoCo error feedback'} at " \
              f"{'/'.join(map(str, bits))} bits{' + Hadamard' if hadamard else ''} for {parameter_count(params)}"
    return setting, row.note, ACTIONS[row.reading, error_feedback]


@pytest.mark.parametrize("world,local,bits", [(8, 4, [2, 2]), (4, 4, [2]), (4, 1, [2])])
@pytest.mark.parametrize("params,window", [(SMALL, "<=10.8M"), (GAIN_MAX_PARAMS, "at 116M over a whole 1000-step")])
def test_two_bits_on_every_hop_without_error_feedback_suggests_it_where_loco_paid(world, local, bits, params, window):
    note = _note(world, local, params=params, intra_node_bits=2, inter_node_bits=2, error_feedback=False)
    for part in _expected(bits, False, params):
        assert part in note
    assert "error_feedback: true" in note and window in note


def test_error_feedback_at_two_bits_where_its_gain_is_unproven_says_to_measure_it():
    """At 1M tokens a step (the batch axis) LoCo's 2/2 gain was not shown: the note asks for a measurement."""
    note = _note(8, 4, tokens_per_step=1 << 20, intra_node_bits=2, inter_node_bits=2, error_feedback=True)
    row = read_map([2, 2], False, "midrise", SMALL, 1 << 20)
    assert row.reading == LOCO_UNPROVEN and row.note in note and ACTIONS[LOCO_UNPROVEN, True] in note


def test_error_feedback_at_two_bits_above_every_size_measured_reads_not_measured():
    note = _note(8, 4, params=GAIN_MAX_PARAMS + 1, intra_node_bits=2, inter_node_bits=2, error_feedback=True)
    assert "not in the measurements" in note and NOT_MEASURED in note and "up to 116M parameters" in note


@pytest.mark.parametrize("keys,bits,params", [
    (dict(intra_node_bits=4, inter_node_bits=4), [4, 4], SMALL), (dict(intra_node_bits=4, inter_node_bits=4), [4, 4],
                                                                  LARGE),
    (dict(intra_node_bits=8, inter_node_bits=4), [8, 4], SMALL), (dict(intra_node_bits=8, inter_node_bits=4), [8, 4],
                                                                  LARGE),
    (dict(intra_node_bits=8, inter_node_bits=2, hadamard=True), [8, 2], SMALL),  # 116M not measured at 8/2 + H
])
def test_error_feedback_where_the_map_found_no_effect_says_what_it_costs(keys, bits, params):
    note = _note(8, 4, params=params, error_feedback=True, **keys)
    for part in _expected(bits, True, params, hadamard=keys.get("hadamard", False), grid="symmetric"):
        assert part in note
    assert "error_feedback: false" in note


@pytest.mark.parametrize("world,local,params,keys", [
    (8, 4, SMALL, dict(intra_node_bits=2, inter_node_bits=2, error_feedback=True)),  # what the map advises
    (8, 4, LARGE, dict(intra_node_bits=2, inter_node_bits=2, error_feedback=True)),  # what the map advises at 116M
    (8, 4, SMALL, dict(intra_node_bits=4, inter_node_bits=4, error_feedback=False)),
    (8, 4, SMALL, dict(intra_node_bits=8, inter_node_bits=2, error_feedback=True)),  # 8/2 without Hadamard
    (8, 4, SMALL, dict(intra_node_bits=3, inter_node_bits=3, error_feedback=True)),  # 3 bits: not measured
    (8, 4, SMALL, dict(intra_node_bits=4, inter_node_bits=2, error_feedback=False)),  # one 2-bit hop
    (1, 1, SMALL, dict(intra_node_bits=2, inter_node_bits=2, error_feedback=False)),  # one rank: no hop
    # 2/2 on the symmetric grid: LoCo's sign flipped with the model size there
    (8, 4, SMALL, dict(intra_node_bits=2, inter_node_bits=2, error_feedback=False, quant_grid="symmetric")),
    (8, 4, SMALL, dict(intra_node_bits=2, inter_node_bits=2, error_feedback=False, hadamard=True)),  # not measured
])
def test_no_note_where_the_map_agrees_or_did_not_measure(world, local, params, keys):
    assert _note(world, local, params=params, **keys) is None


@pytest.mark.parametrize("params,tokens", [(7_000_000_000, None), (SMALL, 1 << 22)])
def test_a_measured_setting_outside_every_window_measured_reads_not_measured(params, tokens):
    """4/4 beyond the largest model or batch the findings measured it at: no reading is carried over."""
    row = read_map([4, 4], False, "symmetric", SMALL)
    assert params > row.params[1] or tokens > row.tokens_per_step[1]
    note = _note(8, 4, params=params, tokens_per_step=tokens, error_feedback=True, intra_node_bits=4,
                 inter_node_bits=4)
    assert "not in the measurements" in note and NOT_MEASURED in note and "262K tokens a step" in note
    assert row.note not in note


def test_plain_qgz_outside_every_window_measured_gets_no_note():
    """Plain qgZ is DeepSpeed's own numerics: only a run with LoCo on is told its setting was not measured."""
    assert _note(8, 4, params=7_000_000_000, intra_node_bits=4, inter_node_bits=4, error_feedback=False) is None

@pytest.mark.parametrize("params, said", [(3_217, "3,217 parameters"), (99_999, "99,999 parameters"),
                                          (870_000, "0.87M parameters"), (10_818_432, "10.8M parameters"),
                                          (116_430_720, "116M parameters"), (7_000_000_000, "7B parameters")])
def test_a_models_size_reads_as_its_count_never_as_zero_millions(params, said):
    assert parameter_count(params) == said


def test_a_small_models_note_states_its_size():
    note = _note(8, 4, params=3_217, intra_node_bits=2, inter_node_bits=2, error_feedback=False)
    assert "at 2/2 bits for 3,217 parameters: in the measurements" in note and "0.0M" not in note


def test_inter_node_error_only_at_two_bits_says_it_kept_none_of_the_gain_and_what_did():
    """The lean-error-state study's rows, read for the options they were measured with alone: ``"inter_node"``
    (any storage) gets its own note and action; 4-bit errors on both hops, like int8, get none (the map agrees)."""
    row = read_map([2, 2], False, "midrise", SMALL, options={"error_feedback": "inter_node", "error_bits": 4})
    for bits in (8, 4):
        note = _note(8, 4, intra_node_bits=2, inter_node_bits=2, error_feedback="inter_node", error_bits=bits)
        assert note.startswith("deepspeed-loco: inter-node LoCo at 2/2 bits for 10.8M parameters")
        assert row.note in note and note.endswith(row.action) and "error_bits: 4" in row.action
    assert _note(8, 4, intra_node_bits=2, inter_node_bits=2, error_feedback=True, error_bits=4) is None
    # beyond the study's model the gain of error feedback on both hops does not speak for it: not measured, with
    # the option's own window
    note = _note(8, 4, params=LARGE, intra_node_bits=2, inter_node_bits=2, error_feedback="inter_node")
    assert row.note not in note and "not in the measurements" in note and "up to 11M parameters" in note


def test_inter_node_error_only_where_the_map_found_no_effect_says_what_it_costs():
    note = _note(8, 4, intra_node_bits=4, inter_node_bits=4, error_feedback="inter_node")
    assert note.startswith("deepspeed-loco: inter-node LoCo at 4/4 bits") and "error_feedback: false" in note


def test_every_note_fits_one_line_over_every_setting_and_option():
    """Every setting, option and size a note can name: at most ``NOTE_MAX_CHARS`` (``_note`` checks)."""
    import itertools
    bits = [(2, 2), (4, 4), (8, 2), (8, 8), (2, 4), (4, 2), (3, 3)]
    for (intra, inter), feedback, error_bits, hadamard, params, (world, local) in itertools.product(
            bits, (True, False, "inter_node"), (4, 8, 32), (False, True), (3_217, SMALL, LARGE, 7 * 10**9),
            ((16, 8), (16, 1), (2, 2))):
        _note(world, local, params=params, intra_node_bits=intra, inter_node_bits=inter, error_feedback=feedback,
              error_bits=error_bits, hadamard=hadamard)
