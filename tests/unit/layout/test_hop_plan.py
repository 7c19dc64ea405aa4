"""The hop plan: which hops a layout gets, and the quantization grid that ``quant_grid: "auto"`` resolves to."""
import pytest

from deepspeed_loco.config import LocoConfig
from deepspeed_loco.layout import plan_hops
from deepspeed_loco.layout.hop_plan import INTER_NODE, INTRA_NODE


@pytest.mark.parametrize("world, local, names", [(8, 4, [INTRA_NODE, INTER_NODE]), (4, 4, [INTRA_NODE]),
                                                 (4, 1, [INTER_NODE]), (1, 1, [])])
def test_hops_follow_the_layout(world, local, names):
    assert [hop.name for hop in plan_hops(world, local, LocoConfig()).hops] == names


@pytest.mark.parametrize("intra, inter, world, local, grid", [
    (4, 4, 8, 4, "symmetric"),   # the DeepSpeed-compatible default stays symmetric
    (8, 2, 8, 4, "midrise"),     # a 2-bit hop anywhere: every hop on the mid-rise grid
    (2, 2, 8, 4, "midrise"),
    (2, 4, 8, 4, "midrise"),
    (3, 3, 8, 4, "symmetric"),
    (4, 2, 4, 4, "symmetric"),   # one node: the 2-bit inter-node hop does not exist
    (2, 4, 4, 1, "symmetric"),   # one rank per node: only the 4-bit inter-node hop runs
])
def test_auto_grid_is_midrise_exactly_when_a_hop_sends_two_bits(intra, inter, world, local, grid):
    plan = plan_hops(world, local, LocoConfig(intra_node_bits=intra, inter_node_bits=inter))
    assert LocoConfig().quant_grid == "auto"
    assert plan.grid == grid
    assert all(plan.args(i, 0.8, 0).grid == grid for i in range(len(plan.hops)))


@pytest.mark.parametrize("grid", ["symmetric", "midrise"])
def test_an_explicit_grid_is_kept_whatever_the_bits(grid):
    for bits in (2, 4):
        config = LocoConfig(intra_node_bits=bits, inter_node_bits=bits, quant_grid=grid)
        assert plan_hops(8, 4, config).grid == grid
