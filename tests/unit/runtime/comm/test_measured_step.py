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


class _RecordingProbe:
    """A probe of the reducer's interface (``loco_reduce.ReduceProbe``) that is not the live rho's: zero stats
    tensors, and what the reducer hands it."""

    def __init__(self, hops):
        self.hops, self.calls = hops, []
        self.sums = None

    def stats(self, device):
        if self.sums is None:
            self.sums = [torch.zeros(2, dtype=torch.float64, device=device) for _ in range(self.hops)]
            self.sums.append(torch.zeros(1, dtype=torch.float64, device=device))
        return self.sums[:-1], self.sums[-1]

    def inputs(self, names, grads, gather):
        self.calls.append(("inputs", list(names), [g.clone() for g in grads]))
        return len(self.calls)

    def outputs(self, token, means):
        self.calls.append(("outputs", token, [m.clone() for m in means]))


def test_the_reducer_reports_to_any_probe_of_its_interface():
    """The reducer knows only the probe's interface: it hands the bucket's names and gradients before the first hop
    and its means after (with the token ``inputs`` returned), and the probe's tensors are the kernels' ``stats``:
    hop 1's first sum is ``||g||^2`` of this rank's gradients, the last ``||out||^2`` of its means."""
    cluster = _cluster()
    try:
        probes = [_RecordingProbe(len(cluster.plan.hops)) for _ in cluster.reducers]
        for reducer, probe in zip(cluster.reducers, probes):
            reducer.begin_measured_step(probe)
        grads = _grads(1)
        means = cluster.reduce_scatter(grads, NAMES)
        for rank, (reducer, probe) in enumerate(zip(cluster.reducers, probes)):
            assert reducer.end_measured_step() is probe and not reducer.measuring
            (kind, names, seen), (done, token, outs) = probe.calls
            assert (kind, names, done, token) == ("inputs", NAMES, "outputs", 1)
            assert all(torch.equal(s, g) for s, g in zip(seen, grads[rank]))
            assert all(torch.equal(o, m) for o, m in zip(outs, means[rank]))
            squares = sum(float(g.double().pow(2).sum()) for g in grads[rank])
            assert float(probe.sums[0][0]) == pytest.approx(squares, rel=1e-6)
            assert float(probe.sums[-1][0]) == pytest.approx(sum(float(m.double().pow(2).sum()) for m in outs),
                                                             rel=1e-6)
    finally:
        cluster.close()
