"""The start-up note from the regime map: 2 bits on every hop without error feedback, error feedback where the map
found it changed nothing, and silence for what the map did not measure or agrees with."""
import pytest

from deepspeed_loco.config import LocoConfig
from deepspeed_loco.layout import plan_hops
from deepspeed_loco.runtime.zero.regime_note import LOCO_IDLE, LOCO_PAYS, map_reading, regime_note


def _note(world, local, **keys):
    config = LocoConfig.from_dict(keys)
    return regime_note(plan_hops(world, local, config), config.error_feedback)


def test_two_bits_on_every_hop_without_error_feedback_suggests_it():
    for world, local in ((8, 4), (4, 4), (4, 1)):  # two hops; one intra-node hop; one inter-node hop
        note = _note(world, local, intra_node_bits=2, inter_node_bits=2, error_feedback=False)
        assert "every hop sends 2 bits" in note and "error_feedback: true" in note and "When LoCo pays" in note


@pytest.mark.parametrize("keys,shown", [
    (dict(intra_node_bits=4, inter_node_bits=4), "4/4 bits:"),
    (dict(intra_node_bits=8, inter_node_bits=4), "8/4 bits:"),
    (dict(intra_node_bits=8, inter_node_bits=2, hadamard=True), "8/2 bits + Hadamard:"),
])
def test_error_feedback_where_the_map_found_no_effect_says_what_it_costs(keys, shown):
    note = _note(8, 4, error_feedback=True, **keys)
    assert shown in note and "LoCo did not lower the loss" in note and "error_feedback: false" in note


@pytest.mark.parametrize("world,local,keys", [
    (8, 4, dict(intra_node_bits=2, inter_node_bits=2, error_feedback=True)),  # what the map advises
    (8, 4, dict(intra_node_bits=4, inter_node_bits=4, error_feedback=False)),
    (8, 4, dict(intra_node_bits=8, inter_node_bits=2, error_feedback=True)),  # 8/2 without Hadamard: not measured
    (8, 4, dict(intra_node_bits=3, inter_node_bits=3, error_feedback=True)),  # 3 bits: not measured
    (8, 4, dict(intra_node_bits=4, inter_node_bits=2, error_feedback=False)),  # one 2-bit hop: not measured
    (1, 1, dict(intra_node_bits=2, inter_node_bits=2, error_feedback=False)),  # one rank: no hop
    # 2/2 on the symmetric grid: LoCo's sign flipped with the model size there
    (8, 4, dict(intra_node_bits=2, inter_node_bits=2, error_feedback=False, quant_grid="symmetric")),
    (8, 4, dict(intra_node_bits=2, inter_node_bits=2, error_feedback=False, hadamard=True)),  # not measured
])
def test_no_note_where_the_map_agrees_or_did_not_measure(world, local, keys):
    assert _note(world, local, **keys) is None


@pytest.mark.parametrize("bits,hadamard,grid,reading", [
    ([2, 2], False, "midrise", LOCO_PAYS), ([2], False, "midrise", LOCO_PAYS),
    ([4, 4], False, "symmetric", LOCO_IDLE), ([8, 4], False, "symmetric", LOCO_IDLE),
    ([8, 2], True, "midrise", LOCO_IDLE),
    ([2, 2], False, "symmetric", None), ([2, 2], True, "midrise", None), ([8, 2], False, "midrise", None),
    ([4, 2], False, "midrise", None), ([3, 3], False, "symmetric", None), ([], False, "symmetric", None),
])
def test_map_reading_is_the_one_rule_of_the_note_and_of_advise(bits, hadamard, grid, reading):
    assert map_reading(bits, hadamard, grid) == reading
