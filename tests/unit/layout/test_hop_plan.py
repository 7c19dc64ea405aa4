"""The hop plan: which hops a layout gets, the quantization grid that ``quant_grid: "auto"`` resolves to, and each
rank's own block (``exact_own_block``): its peer index per hop, the hops' kernel arguments and the error rows."""
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


@pytest.mark.parametrize("world, local", [(8, 4), (4, 4), (4, 1), (6, 2)])
def test_a_ranks_own_block_is_its_local_index_intra_node_and_its_node_inter_node(world, local):
    exact = plan_hops(world, local, LocoConfig(exact_own_block=True))
    plain = plan_hops(world, local, LocoConfig())
    assert exact.exact_own_block and not plain.exact_own_block and exact != plain
    for rank in range(world):
        peers = {hop.name: hop.peer_index(rank, local) for hop in exact.hops}
        assert peers == {name: rank % local if name == INTRA_NODE else rank // local for name in peers}
        args = [exact.args(i, 0.8, rank) for i in range(len(exact.hops))]
        assert [a.own for a in args] == [peers[hop.name] for hop in exact.hops]
        assert [a.in_own for a in args] == [-1] + [a.own for a in args[:-1]]
        assert args[-1].mean().in_own == args[-1].own
        for hop, a in zip(exact.hops, args):  # the kernel arguments' view of the hop
            assert (a.kept_rows, a.peers, 0 <= a.own < a.peers) == (hop.kept_rows, hop.peers, True)
            assert (a.rows, a.error_rows) == (hop.rows, exact.error_rows()[hop.name])
        off = [plain.args(i, 0.8, rank) for i in range(len(plain.hops))]
        assert all((a.own, a.in_own, a.mean().in_own) == (-1, -1, -1) for a in off)
        assert [a.error_rows for a in off] == list(plain.error_rows().values())


@pytest.mark.parametrize("world, local, rows, exact_rows", [
    (8, 4, {INTRA_NODE: 8, INTER_NODE: 2}, {INTRA_NODE: 6, INTER_NODE: 1}),
    (16, 8, {INTRA_NODE: 16, INTER_NODE: 2}, {INTRA_NODE: 14, INTER_NODE: 1}),
    (4, 4, {INTRA_NODE: 4}, {INTRA_NODE: 3}),
    (4, 1, {INTER_NODE: 4}, {INTER_NODE: 3}),
])
def test_an_exact_own_block_saves_its_rows_of_each_error_buffer(world, local, rows, exact_rows):
    """``W - M`` instead of ``W`` intra-node (1/L fewer), ``M - 1`` instead of ``M`` inter-node."""
    assert dict(plan_hops(world, local, LocoConfig()).error_rows()) == rows
    assert dict(plan_hops(world, local, LocoConfig(exact_own_block=True)).error_rows()) == exact_rows
