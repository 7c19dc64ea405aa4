import pytest
import torch

from deepspeed_loco.config import LocoConfig
from deepspeed_loco.layout import plan_hops
from deepspeed_loco.runtime.comm.loco_reduce import LocoReducer
from deepspeed_loco.runtime.comm.topology import LocoTopology
from deepspeed_loco.runtime.comm.error_feedback import ErrorFeedbackState

GROUP = 32


def _state(config, world, local):
    return ErrorFeedbackState(config, plan_hops(world, local, config))


def check_reset_zeroes_every_buffer(local_size):
    topo = LocoTopology.build(local_size=local_size)
    reducer = LocoReducer.for_topology(LocoConfig(group_size=GROUP, reset_T=3), topo)
    state = reducer.state
    names = ["w", "b"]
    gen = torch.Generator().manual_seed(topo.rank)
    grads = [torch.randn(100, 7, generator=gen), torch.randn(5, generator=gen)]
    reducer.reduce_scatter(names, grads)
    nonzero_before = all(bool(b.dequantize().any()) for b in state.buffers())
    resets = [state.on_optimizer_step() for _ in range(7)]
    zero_after = not any(bool(b.dequantize().any()) for b in state.buffers())
    reducer.reduce_scatter(names, grads)
    state.reset()
    explicit_zero = not any(bool(b.dequantize().any()) for b in state.buffers())
    attached = state.names() == tuple(names)
    return nonzero_before, resets, zero_after, explicit_zero, attached


def test_reset_zeroes_all_buffers_every_reset_T_steps(process_pool):
    for nonzero, resets, zero_after, explicit_zero, attached in process_pool(4).run(check_reset_zeroes_every_buffer, 2):
        assert nonzero and attached
        assert resets == [False, False, True, False, False, True, False]
        assert zero_after and explicit_zero


@pytest.mark.parametrize("world,local", [(4, 2), (8, 4), (6, 1), (4, 4)])
def test_buffer_memory_is_one_plus_one_over_L_bytes_per_element_plus_scales(world, local):
    state = _state(LocoConfig(group_size=GROUP), world, local)
    numel = world * GROUP * 5
    state.buffers_for("w", numel, "cpu")
    rows = (world if local > 1 else 0) + (world // local if world // local > 1 else 0)
    per_row = numel // world
    assert state.memory_bytes() == rows * per_row * (1 + 4 / GROUP)
    if local > 1 and world // local > 1:
        assert state.memory_bytes() / numel == pytest.approx((1 + 1 / local) * (1 + 4 / GROUP))


def test_no_buffers_without_error_feedback_or_in_a_world_of_one():
    assert _state(LocoConfig(error_feedback=False), 4, 2).buffers_for("w", 100, "cpu") is None
    assert _state(LocoConfig(), 1, 1).buffers_for("w", 100, "cpu") is None


def test_rescale_multiplies_the_stored_error():
    state = _state(LocoConfig(group_size=GROUP), 4, 2)
    buffers = state.buffers_for("w", 4 * GROUP, "cpu")
    buffers["intra_node"].store_(torch.randn(4, GROUP))
    before = buffers["intra_node"].dequantize().clone()
    state.rescale(0.5)
    assert torch.equal(buffers["intra_node"].dequantize(), before * 0.5)


def test_state_dict_round_trips_into_a_fresh_state_by_parameter_name():
    state = _state(LocoConfig(group_size=GROUP), 4, 2)
    gen = torch.Generator().manual_seed(0)
    for name, numel in (("w", 700), ("b", 5)):
        for buffer in state.buffers_for(name, numel, "cpu").values():
            buffer.store_(torch.randn(buffer.shape, generator=gen))
    state.step = 3
    fresh = ErrorFeedbackState(state.config, state.plan)
    fresh.load_state_dict(state.state_dict())
    assert fresh.step == 3 and fresh.names() == ("w", "b")
    for (name, hop, a), (name_b, hop_b, b) in zip(state.named_buffers(), fresh.named_buffers(), strict=True):
        assert (name, hop) == (name_b, hop_b) and torch.equal(a.values, b.values) and torch.equal(a.scale, b.scale)
    assert fresh.buffers_of("w") is fresh.buffers_for("w", 700, "cpu")  # held by name, nothing on a parameter


def test_a_name_keeps_its_parameters_size():
    state = _state(LocoConfig(group_size=GROUP), 4, 2)
    state.buffers_for("w", 700, "cpu")
    with pytest.raises(ValueError, match="'w' has 700 elements, got a gradient of 701"):
        state.buffers_for("w", 701, "cpu")


@pytest.mark.parametrize("other", [dict(intra_node_bits=8), dict(group_size=64), dict(hadamard=True)])
def test_a_reducer_refuses_a_state_of_another_plan(other):
    config = LocoConfig(group_size=GROUP)
    plan = plan_hops(4, 2, config)
    with pytest.raises(ValueError, match="the error-feedback state belongs to another plan"):
        LocoReducer(plan, _state(LocoConfig(**{"group_size": GROUP, **other}), 4, 2), rank=0)
    with pytest.raises(ValueError, match="another plan"):
        LocoReducer(plan, _state(config, 8, 2), rank=0)
    # the algorithm's settings live in the state: another err_beta is the same plan
    assert LocoReducer(plan, _state(LocoConfig(group_size=GROUP, err_beta=0.5), 4, 2), rank=0).state.err_beta == 0.5


@pytest.mark.parametrize("world,local,feedback,hops,off", [
    (8, 4, True, ("intra_node", "inter_node"), None),
    (8, 4, "inter_node", ("inter_node", ), None),
    (8, 1, "inter_node", ("inter_node", ), None),  # one rank a node: the inter-node hop is the only hop
    (4, 4, "inter_node", (), "no inter-node hop"),  # one node: nothing keeps error
    (8, 4, False, (), None),  # not asked for: nothing to warn about
    (1, 1, True, (), "one rank"),
])
def test_hops_with_error_and_why_error_feedback_is_off(world, local, feedback, hops, off):
    from deepspeed_loco.runtime.comm.error_feedback import error_feedback_off_reason, hops_with_error
    plan = plan_hops(world, local, LocoConfig(error_feedback=feedback))
    assert hops_with_error(plan, feedback) == hops
    reason = error_feedback_off_reason(plan, feedback)
    assert (reason is None) if off is None else (off in reason)
