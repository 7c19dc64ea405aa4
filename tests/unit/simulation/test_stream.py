"""TrainingSetup(stream_nodes=True): the gradients go into hop 1 node by node, the same results with one node's
alive."""
import threading
import time
import weakref

import pytest
import torch

from deepspeed_loco.config import LocoConfig
from deepspeed_loco.simulation import SimulatedCluster, SimulationSpec, StepObserver, TrainingSetup, simulate
from deepspeed_loco.simulation.train import _ArmRun
from tests.unit.simulation.toy import toy_batches, toy_loss, toy_model

MICRO, STEPS = 2, 12
ARMS = ["full", "plain4", "loco2"]


class _PlainShadow(StepObserver):
    """Reduces every LoCo arm's gradients through plain qgZ too (in the same stream), keeping each step's shadow
    mean's nonzero share in ``shares``."""

    def __init__(self):
        self.shares = []

    def shadow_blocks(self, arm, block):
        return [dict(block, error_feedback=False)] if arm.kind == "loco" else []

    def after_reduce(self, reduced):
        if reduced.shadows:
            self.shares.append(float(torch.cat([g.reshape(-1) for g in reduced.shadows[0]]).ne(0).double().mean()))


def _run(nodes, local, observer=None, **kw):
    evals = lambda model: float(model[0].weight.abs().sum())  # noqa: E731
    setup = TrainingSetup(toy_model, lambda: toy_batches(nodes * local * MICRO), nodes=nodes, local=local,
                          loss_fn=toy_loss, loco={"group_size": 32}, eval_fn=evals, eval_every=5, **kw)
    return simulate(SimulationSpec(setup, ARMS, STEPS), observer or _PlainShadow())


def _same(a, b):
    return [dict(r.to_dict(), wall_s=0.0) for r in a] == [dict(r.to_dict(), wall_s=0.0) for r in b]


@pytest.mark.slow
@pytest.mark.parametrize("nodes,local,default_chunk", [(2, 2, 2), (3, 2, 2), (2, 3, 3), (4, 1, 1), (2, 2, None)])
def test_streaming_nodes_gives_the_same_results_bit_for_bit(nodes, local, default_chunk):
    """Every arm (plain and LoCo, with an observer's plain shadow): losses, validation and every per-step
    series equal to the default's with the same batched passes (``rank_chunk = L``: streaming computes a node's
    ``L`` ranks per pass); (4, 1) has only the inter-node hop. With the default's one pass over all ``W`` ranks the
    gradients round alike only where the pass size does not change the kernels' rounding: on CPU it does not for the
    toy at 2 x 2 (4 ranks against 2 per pass) and does at 2 x 3 and 4 x 1."""
    default_shadow, streamed_shadow = _PlainShadow(), _PlainShadow()
    default = _run(nodes, local, default_shadow, rank_chunk=default_chunk)
    streamed = _run(nodes, local, streamed_shadow, stream_nodes=True)
    assert _same(default, streamed) and default_shadow.shares == streamed_shadow.shares
    assert all(len(r.grad_rel_errors) == STEPS and len(r.validation) == 3 for r in streamed)
    assert len(streamed_shadow.shares) == STEPS and streamed[2].grad_rel_errors != streamed[1].grad_rel_errors


class _LiveGradients:
    """Counts the bytes of the stacked fp32 rank gradients that ``_ArmRun._rank_grads`` returned and that are still
    alive, and their peak at each new batch of them. They are returned as clones: a view's ``_base`` is the root of
    its views, so the finalizer of a tensor that is no view itself runs when the last view of it dies (the vmap's
    outputs may be views of another tensor)."""

    def __init__(self, monkeypatch):
        self.live, self.peaks, self._lock = 0, [], threading.Lock()
        original = _ArmRun._rank_grads

        def tracked(run, *args):
            grads, losses = original(run, *args)
            grads = [grad.clone() for grad in grads]
            for grad in grads:
                assert grad.dtype == torch.float32
                self._change(grad.numel() * 4)
                weakref.finalize(grad, self._change, -grad.numel() * 4)
            self.peaks.append(self.live)
            return grads, losses

        monkeypatch.setattr(_ArmRun, "_rank_grads", tracked)

    def _change(self, nbytes):
        with self._lock:
            self.live += nbytes


@pytest.mark.slow
@pytest.mark.parametrize("stream_nodes", [False, True])
def test_streaming_keeps_at_most_one_nodes_gradients_alive(monkeypatch, stream_nodes):
    nodes, local = 3, 2
    params = sum(p.numel() for p in toy_model().parameters())
    live = _LiveGradients(monkeypatch)
    _run(nodes, local, stream_nodes=stream_nodes)
    ranks = local if stream_nodes else nodes * local
    assert len(live.peaks) == len(ARMS) * STEPS * nodes * local // ranks
    # when a batch of gradients is computed, the previous node's (or step's) are gone: every reduce (the arm's and
    # the observer's shadow's) let go of them after its first hop
    assert max(live.peaks) == ranks * params * 4
    assert live.live == 0


def test_a_failure_while_streaming_releases_the_waiting_ranks():
    cluster = SimulatedCluster(LocoConfig(group_size=32, local_world_size=2), 2, 2)
    grads = [[torch.randn(100), torch.randn(7, 3)] for _ in range(4)]
    started = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="node 1 failed"):
            with cluster.stream(["a", "b"]) as reduce:
                reduce.add(grads[:2])
                reduce.wait_released()  # node 0 through hop 1, its ranks waiting at hop 2
                raise RuntimeError("node 1 failed")
    finally:
        cluster.close()
    assert time.monotonic() - started < 60  # not the exchanges' 600 s timeout


def test_a_cluster_streamed_node_by_node_reduces_as_at_once():
    """Two reduces in a row (the second with the first's error buffers): the same partitions either way."""
    config = LocoConfig(intra_node_bits=4, inter_node_bits=2, group_size=32, local_world_size=2)
    gen = torch.Generator().manual_seed(1)
    steps = [[[torch.randn(300, generator=gen), torch.randn(9, 4, generator=gen)] for _ in range(6)]
             for _ in range(2)]
    whole, streamed = SimulatedCluster(config, 3, 2), SimulatedCluster(config, 3, 2)
    try:
        for grads in steps:
            expected = whole.mean_gradients(grads, ["a", "b"])
            with streamed.stream(["a", "b"]) as reduce:
                for node in range(3):
                    reduce.add(grads[2 * node:2 * node + 2])
                    reduce.wait_released()
            got = reduce.mean_gradients()
            assert all(torch.equal(g, e) for g, e in zip(got, expected)) and got[1].shape == (9, 4)
        with pytest.raises(ValueError, match="gradients of 7 ranks"):
            with streamed.stream(["a", "b"]) as reduce:
                reduce.add(steps[0][0:1] * 7)
    finally:
        whole.close()
        streamed.close()
