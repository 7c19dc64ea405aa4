"""The start-up note from the regime map: 2 bits on every hop without error feedback at a size where LoCo paid,
error feedback at 2 bits where its gain is unproven, error feedback where the map found it changed nothing, and
silence for what the map did not measure or agrees with."""
import pytest

from deepspeed_loco.config import LocoConfig
from deepspeed_loco.layout import plan_hops
from deepspeed_loco.runtime.zero.regime_note import (LOCO_GAIN_MAX_PARAMS, LOCO_IDLE, LOCO_PAYS, LOCO_UNPROVEN,
                                                     map_reading, regime_note)

SMALL, LARGE = 10_820_000, 116_430_720  # the map's 10.8M and 116M models


def _note(world, local, params=SMALL, **keys):
    config = LocoConfig.from_dict(keys)
    return regime_note(plan_hops(world, local, config), config.error_feedback, params)


def test_two_bits_on_every_hop_without_error_feedback_suggests_it_where_loco_paid():
    for world, local in ((8, 4), (4, 4), (4, 1)):  # two hops; one intra-node hop; one inter-node hop
        note = _note(world, local, intra_node_bits=2, inter_node_bits=2, error_feedback=False)
        assert "every hop sends 2 bits" in note and "error_feedback: true" in note and "When LoCo pays" in note
        assert "up to 10.8M parameters" in note


def test_error_feedback_at_two_bits_on_a_model_larger_than_the_resolved_gain_says_to_measure_it():
    note = _note(8, 4, params=LARGE, intra_node_bits=2, inter_node_bits=2, error_feedback=True)
    assert "for 116M parameters" in note and "only up to 10.8M" in note and "started behind" in note
    assert "advise" in note and "When LoCo pays" in note


@pytest.mark.parametrize("keys,shown", [
    (dict(intra_node_bits=4, inter_node_bits=4), "4/4 bits:"),
    (dict(intra_node_bits=8, inter_node_bits=4), "8/4 bits:"),
    (dict(intra_node_bits=8, inter_node_bits=2, hadamard=True), "8/2 bits + Hadamard:"),
])
@pytest.mark.parametrize("params", [SMALL, LARGE])
def test_error_feedback_where_the_map_found_no_effect_says_what_it_costs(keys, shown, params):
    note = _note(8, 4, params=params, error_feedback=True, **keys)
    assert shown in note and "LoCo did not lower the loss" in note and "error_feedback: false" in note


@pytest.mark.parametrize("world,local,params,keys", [
    (8, 4, SMALL, dict(intra_node_bits=2, inter_node_bits=2, error_feedback=True)),  # what the map advises
    (8, 4, LARGE, dict(intra_node_bits=2, inter_node_bits=2, error_feedback=False)),  # LoCo unproven: no advice
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


@pytest.mark.parametrize("bits,hadamard,grid,params,reading", [
    ([2, 2], False, "midrise", SMALL, LOCO_PAYS), ([2], False, "midrise", SMALL, LOCO_PAYS),
    ([2, 2], False, "midrise", LOCO_GAIN_MAX_PARAMS, LOCO_PAYS),
    ([2, 2], False, "midrise", LOCO_GAIN_MAX_PARAMS + 1, LOCO_UNPROVEN), ([2], False, "midrise", LARGE, LOCO_UNPROVEN),
    ([4, 4], False, "symmetric", SMALL, LOCO_IDLE), ([4, 4], False, "symmetric", LARGE, LOCO_IDLE),
    ([8, 4], False, "symmetric", SMALL, LOCO_IDLE), ([8, 2], True, "midrise", LARGE, LOCO_IDLE),
    ([2, 2], False, "symmetric", SMALL, None), ([2, 2], True, "midrise", LARGE, None),
    ([8, 2], False, "midrise", SMALL, None), ([4, 2], False, "midrise", SMALL, None),
    ([3, 3], False, "symmetric", SMALL, None), ([], False, "symmetric", SMALL, None),
])
def test_map_reading_is_the_one_rule_of_the_note_and_of_advise(bits, hadamard, grid, params, reading):
    assert map_reading(bits, hadamard, grid, params) == reading
