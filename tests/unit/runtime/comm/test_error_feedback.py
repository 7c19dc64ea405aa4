import pytest
import torch

from deepspeed_loco.config import LocoConfig
from deepspeed_loco.runtime.comm.loco_reduce import LocoReducer
from deepspeed_loco.runtime.comm.topology import LocoTopology
from deepspeed_loco.runtime.comm.error_feedback import PARAM_ATTRIBUTE, ErrorFeedbackState

GROUP = 32


def check_reset_zeroes_every_buffer(local_size):
    topo = LocoTopology.build(local_size=local_size)
    state = ErrorFeedbackState(LocoConfig(group_size=GROUP, reset_T=3), topo)
    reducer = LocoReducer(state.config, topo, state)
    params = [torch.zeros(1), torch.zeros(1)]
    gen = torch.Generator().manual_seed(topo.rank)
    grads = [torch.randn(100, 7, generator=gen), torch.randn(5, generator=gen)]
    reducer.reduce_scatter(params, grads)
    nonzero_before = all(bool(b.dequantize().any()) for b in state.buffers())
    resets = [state.on_optimizer_step() for _ in range(7)]
    zero_after = not any(bool(b.dequantize().any()) for b in state.buffers())
    reducer.reduce_scatter(params, grads)
    state.reset()
    explicit_zero = not any(bool(b.dequantize().any()) for b in state.buffers())
    attached = all(getattr(p, PARAM_ATTRIBUTE) is not None for p in params)
    return nonzero_before, resets, zero_after, explicit_zero, attached


def test_reset_zeroes_all_buffers_every_reset_T_steps(process_pool):
    for nonzero, resets, zero_after, explicit_zero, attached in process_pool(4).run(check_reset_zeroes_every_buffer, 2):
        assert nonzero and attached
        assert resets == [False, False, True, False, False, True, False]
        assert zero_after and explicit_zero


@pytest.mark.parametrize("world,local", [(4, 2), (8, 4), (6, 1), (4, 4)])
def test_buffer_memory_is_one_plus_one_over_L_bytes_per_element_plus_scales(world, local):
    topo = LocoTopology(world_size=world, local_size=local, rank=0)
    state = ErrorFeedbackState(LocoConfig(group_size=GROUP), topo)
    numel = world * GROUP * 5
    state.for_param(torch.zeros(1), numel, "cpu")
    rows = (world if local > 1 else 0) + (world // local if world // local > 1 else 0)
    per_row = numel // world
    assert state.memory_bytes() == rows * per_row * (1 + 4 / GROUP)
    if local > 1 and world // local > 1:
        assert state.memory_bytes() / numel == pytest.approx((1 + 1 / local) * (1 + 4 / GROUP))


def test_no_buffers_without_error_feedback_or_in_a_world_of_one():
    assert ErrorFeedbackState(LocoConfig(error_feedback=False), LocoTopology(4, 2, 0)).for_param(
        torch.zeros(1), 100, "cpu") is None
    assert ErrorFeedbackState(LocoConfig(), LocoTopology(1, 1, 0)).for_param(torch.zeros(1), 100, "cpu") is None


def test_rescale_multiplies_the_stored_error():
    state = ErrorFeedbackState(LocoConfig(group_size=GROUP), LocoTopology(4, 2, 0))
    buffers = state.for_param(torch.zeros(1), 4 * GROUP, "cpu")
    buffers["intra_node"].store_(torch.randn(4, GROUP))
    before = buffers["intra_node"].dequantize().clone()
    state.rescale(0.5)
    assert torch.equal(buffers["intra_node"].dequantize(), before * 0.5)
