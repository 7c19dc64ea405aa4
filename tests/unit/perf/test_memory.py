"""LoCo's error memory: the allocated buffers equal the plan's formula for every option, the per-parameter rate is
that formula for large tensors, and the table (``python -m deepspeed_loco.perf memory``) states it per GPU."""
import pytest

from deepspeed_loco.config import INTER_NODE_ONLY, LocoConfig
from deepspeed_loco.layout import plan_hops
from deepspeed_loco.perf import cli
from deepspeed_loco.perf.memory import OPTIONS, ZERO3_BYTES_PER_PARAMETER, memory_rows
from deepspeed_loco.runtime.comm.error_feedback import ErrorFeedbackState, error_bytes_per_parameter

GROUP = 64
LAYOUTS = [(8, 4), (8, 1), (4, 4), (16, 8)]  # (W, L): two hops, inter only (L = 1), intra only (one node), 2 x 8


@pytest.mark.parametrize("world,local", LAYOUTS)
@pytest.mark.parametrize("feedback,bits", [(f, b) for f, b in OPTIONS] + [(False, 8)])
@pytest.mark.parametrize("exact_own_block", [False, True])
def test_allocated_bytes_are_the_formula_for_every_option(world, local, feedback, bits, exact_own_block):
    """Whole groups per partition (``N`` a multiple of ``W * group``): bytes allocated = N x the per-parameter rate,
    exactly; ragged tensors allocate exactly ``planned_bytes`` (the padding included)."""
    config = LocoConfig(error_feedback=feedback, error_bits=bits, group_size=GROUP, exact_own_block=exact_own_block)
    state = ErrorFeedbackState(config, plan_hops(world, local, config))
    whole = [world * GROUP * k for k in (1, 3, 10)]
    for i, numel in enumerate(whole):
        state.buffers_for(f"w{i}", numel, "cpu")
    assert state.memory_bytes() == sum(whole) * error_bytes_per_parameter(world, local, config)
    ragged = [1, 7, 1000, 4099]
    for i, numel in enumerate(ragged):
        state.buffers_for(f"r{i}", numel, "cpu")
    assert state.memory_bytes() == sum(state.planned_bytes(n) for n in whole + ragged)


def test_the_rates_per_option_at_eight_ranks_a_node():
    """(1 + 4/S) values' bytes per value over W + M rows of W: int8 both hops (1 + 4/256)(1 + 1/8); int4 half the
    values; inter_node alone 1/8 of the rows; one node has no inter-node hop; one rank a node: inter_node = both."""
    rate = lambda world, local, **kw: error_bytes_per_parameter(world, local, LocoConfig(**kw))
    assert rate(64, 8) == pytest.approx((1 + 4 / 256) * (1 + 1 / 8))
    assert rate(512, 8, error_bits=4) == pytest.approx((0.5 + 4 / 256) * (1 + 1 / 8))
    assert rate(512, 8, error_feedback=INTER_NODE_ONLY, error_bits=4) == pytest.approx((0.5 + 4 / 256) / 8)
    assert rate(8, 8, error_feedback=INTER_NODE_ONLY) == 0
    assert rate(16, 1, error_feedback=INTER_NODE_ONLY) == rate(16, 1) == pytest.approx(1 + 4 / 256)
    assert rate(64, 8, error_feedback=False) == 0


def test_an_exact_own_block_keeps_w_minus_1_rows_of_w():
    """Intra-node ``W - M`` rows and inter-node ``M - 1`` rows of ``W``: ``(W - 1) / W`` values per parameter instead
    of ``1 + 1/L``; ``"inter_node"`` keeps ``(M - 1) / W`` instead of ``1/L``."""
    rate = lambda world, local, **kw: error_bytes_per_parameter(world, local, LocoConfig(exact_own_block=True, **kw))
    assert rate(64, 8) == pytest.approx((1 + 4 / 256) * 63 / 64)
    assert rate(16, 8, error_bits=4) == pytest.approx((0.5 + 4 / 256) * 15 / 16)
    assert rate(64, 8, error_feedback=INTER_NODE_ONLY) == pytest.approx((1 + 4 / 256) * 7 / 64)
    assert rate(8, 8) == pytest.approx((1 + 4 / 256) * 7 / 8)  # one node: the intra-node hop alone, W - 1 rows
    assert rate(16, 1) == pytest.approx((1 + 4 / 256) * 15 / 16)  # one rank a node: the inter-node hop, W - 1 rows


def test_the_leanest_option_holds_a_70b_model_under_5_gb_per_gpu_on_512():
    rows = {row.label: row for row in memory_rows([70e9], [512], 8)}
    lean = rows['error_feedback: "inter_node", error_bits: 4'].gb_per_gpu[0][0]
    today = rows["error_feedback: true, error_bits: 8"].gb_per_gpu[0][0]
    assert lean <= 5.0 < today and today / lean == pytest.approx((1 + 4 / 256) * 9 / (0.5 + 4 / 256), rel=1e-9)
    assert rows["ZeRO-3's model states (16 B / W)"].gb_per_gpu[0][0] == pytest.approx(
        ZERO3_BYTES_PER_PARAMETER * 70e9 / 512 / 1e9)


def test_the_memory_command_prints_the_table_and_refuses_a_shape_that_is_not_whole_nodes(capsys):
    cli.main(["memory", "--params", "7e9", "--gpus", "64", "--gpus-per-node", "8"])
    out = capsys.readouterr().out
    assert "| error_feedback: \"inter_node\", error_bits: 4 | 0.0645 | 0.45 GB |" in out
    with pytest.raises(SystemExit):
        cli.main(["memory", "--gpus", "60", "--gpus-per-node", "8"])
    assert "--gpus must be multiples of --gpus-per-node (8), got [60]" in capsys.readouterr().err
