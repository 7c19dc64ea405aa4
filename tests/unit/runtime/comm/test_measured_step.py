"""A reducer's measured step (``LocoReducer.begin_measured_step`` / ``end_measured_step``), on a simulated cluster of
2 nodes x 2 ranks (the library's reducer and kernels; the all-to-alls in-process copies): the measurement changes no
partition and no error buffer, its sums are the reduces', and a step is begun once and ended once."""
import pytest
import torch

from deepspeed_loco.config import LocoConfig
from deepspeed_loco.runtime.comm import noise_stats
from deepspeed_loco.runtime.comm.error_sample import FIELDS
from deepspeed_loco.simulation import SimulatedCluster

SHAPES = [(40, 3), (77, ), (300, 2)]  # the last one sampled, the others whole
NAMES = ["a", "b", "c"]


def _cluster():
    return SimulatedCluster(LocoConfig(group_size=32, intra_node_bits=4, inter_node_bits=2), 2, 2)


def _grads(step):
    gen = torch.Generator().manual_seed(step)
    return [[torch.randn(shape, generator=gen) for shape in SHAPES] for _ in range(4)]


def test_a_measured_step_changes_no_partition_or_buffer_and_ends_with_the_reduces_sums():
    measured, plain = _cluster(), _cluster()
    try:
        for step in (1, 2):  # step 2's reduce carries step 1's remembered error
            grads = _grads(step)
            measured.measure_noise(step)
            got = measured.reduce_scatter(grads, NAMES)
            totals = measured.noise_totals("cpu")
            want = plain.reduce_scatter(grads, NAMES)
            assert all(torch.equal(g, w) for rank_g, rank_w in zip(got, want) for g, w in zip(rank_g, rank_w))
            assert all(torch.equal(a.dequantize(), b.dequantize())
                       for state_a, state_b in zip(measured.states, plain.states)
                       for a, b in zip(state_a.buffers(), state_b.buffers()))
            hops = len(measured.plan.hops)
            sampled = sum(min(torch.Size(shape).numel(), 256) for shape in SHAPES)
            assert totals.shape == (2 * hops + 1 + FIELDS * sampled, )
            inputs = sum(float(g.double().pow(2).sum()) for rank in grads for g in rank)  # sum_r ||g_r||^2
            outputs = sum(float(p.double().pow(2).sum()) for rank in got for p in rank)  # sum_r ||out_r||^2
            assert float(totals[0]) == pytest.approx(inputs, rel=1e-5)
            assert float(totals[2 * hops]) == pytest.approx(outputs, rel=1e-5)
            assert all(not reducer.measuring for reducer in measured.reducers)
    finally:
        measured.close()
        plain.close()


def test_a_measured_step_is_begun_once_and_ended_once():
    cluster = _cluster()
    reducer = cluster.reducers[0]
    try:
        assert not reducer.measuring
        with pytest.raises(RuntimeError, match="rank 0 ended a measured step it never began"):
            noise_stats.end_measured_step(reducer, "cpu")
        noise_stats.begin_measured_step(reducer, 3)
        assert reducer.measuring
        with pytest.raises(RuntimeError, match="rank 0 began a measured step inside another one"):
            noise_stats.begin_measured_step(reducer, 4)
        totals = noise_stats.end_measured_step(reducer, "cpu")  # no reduce ran: zero sums, nothing sampled
        assert not reducer.measuring and torch.equal(totals, torch.zeros(2 * len(cluster.plan.hops) + 1))
    finally:
        cluster.close()
