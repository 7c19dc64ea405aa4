"""The simulated cluster against the real thing: the same gradients through ``W`` gloo processes and through
``W`` virtual ranks in one process give bit-identical partitions and error buffers, step after step (bits per
hop, Hadamard, both quantization grids)."""
import pytest
import torch

from deepspeed_loco.config import LocoConfig
from deepspeed_loco.runtime.comm.loco_reduce import LocoReducer
from deepspeed_loco.runtime.comm.topology import LocoTopology
from deepspeed_loco.simulation import SimulatedCluster

SHAPES = [(7, ), (33, 5), (64, 64), (1000, 3)]
GROUP = 32
STEPS = 3
VARIANTS = [(bits, hadamard, "symmetric") for bits in ((4, 4), (8, 2), (2, 2)) for hadamard in (False, True)] + [
    ((2, 2), False, "midrise"), ((8, 2), True, "midrise")]
LAYOUTS = [(2, 2), (3, 2), (1, 4), (4, 1)]  # (M, L)


def _config(local, bits, hadamard, grid):
    return LocoConfig(group_size=GROUP, intra_node_bits=bits[0], inter_node_bits=bits[1], hadamard=hadamard,
                      quant_grid=grid, local_world_size=local)


def _grads(rank, step):
    gen = torch.Generator().manual_seed(7919 * step + rank)
    return [torch.randn(shape, generator=gen) * 10**(i - 1) for i, shape in enumerate(SHAPES)]


def _snapshot(state):
    return [(b.values.clone(), None if b.scale is None else b.scale.clone()) for b in state.buffers()]


def reduce_on_real_ranks(local):
    """Every variant, ``STEPS`` reduces each through real gloo all-to-alls: ``{variant: [(partitions, buffers)]}``."""
    topo = LocoTopology.build(local_size=local)
    results = {}
    for variant in VARIANTS:
        reducer = LocoReducer.for_topology(_config(local, *variant), topo)
        names = [f"param{i}" for i in range(len(SHAPES))]
        results[variant] = [(reducer.reduce_scatter(names, _grads(topo.rank, step)),
                                    _snapshot(reducer.state)) for step in range(STEPS)]
    return results


@pytest.mark.parametrize("nodes,local", LAYOUTS)
def test_simulation_is_bit_identical_to_real_processes(process_pool, nodes, local):
    world = nodes * local
    real = process_pool(world).run(reduce_on_real_ranks, local)
    for variant in VARIANTS:
        cluster = SimulatedCluster(_config(local, *variant), nodes, local)
        try:
            for step in range(STEPS):
                simulated = cluster.reduce_scatter([_grads(rank, step) for rank in range(world)])
                for rank in range(world):
                    partitions, buffers = real[rank][variant][step]
                    assert all(torch.equal(a, b) for a, b in zip(partitions, simulated[rank])), (variant, rank)
                    mine = _snapshot(cluster.states[rank])
                    assert len(mine) == len(buffers) > 0
                    for (values, scale), (values_sim, scale_sim) in zip(buffers, mine):
                        assert torch.equal(values, values_sim) and torch.equal(scale, scale_sim)
        finally:
            cluster.close()


def test_mean_gradients_gathers_the_partitions_into_full_gradients():
    cluster = SimulatedCluster(LocoConfig(group_size=GROUP, error_feedback=False), 2, 2)
    grads = [_grads(rank, 0) for rank in range(4)]
    means = cluster.mean_gradients(grads)
    partitions = cluster.reduce_scatter(grads)
    for i, (mean, shape) in enumerate(zip(means, SHAPES)):
        assert mean.shape == shape
        flat = torch.cat([partitions[r][i] for r in range(4)])
        assert torch.equal(mean.reshape(-1), flat[:mean.numel()])
        exact = sum(g[i] for g in grads) / 4
        # two 4-bit hops: at most half a step each of the largest group absmax (a loose, quantizer-derived bound)
        step = max(g[i].abs().max() for g in grads) / 7
        assert (mean - exact).abs().max() <= step
    cluster.close()


def test_a_failing_rank_releases_its_peers_and_raises():
    cluster = SimulatedCluster(LocoConfig(group_size=GROUP), 2, 2)
    grads = [_grads(rank, 0) for rank in range(4)]
    grads[3] = [g.to(torch.int32) for g in grads[3]]  # rank 3 refuses before its first exchange
    with pytest.raises(TypeError, match="int32"):
        cluster.reduce_scatter(grads)
    cluster.close()


def test_reset_T_counts_steps_on_every_virtual_rank():
    cluster = SimulatedCluster(LocoConfig(group_size=GROUP, reset_T=2), 2, 2)
    cluster.reduce_scatter([_grads(rank, 0) for rank in range(4)])
    assert all(any(bool(b.values.any()) for b in s.buffers()) for s in cluster.states)
    assert cluster.on_optimizer_step() is False and cluster.on_optimizer_step() is True
    assert all(not any(bool(b.values.any()) for b in s.buffers()) for s in cluster.states)
    cluster.close()


def test_states_loaded_from_state_dicts_reduce_the_next_step_identically():
    """Every rank's error state goes through ``state_dict`` into a fresh cluster; the next reduce of both clusters
    gives the same partitions and buffers, bit for bit (the buffers belong to the state, by parameter name)."""
    config = _config(2, (4, 4), False, "symmetric")
    names = [f"layer{i}" for i in range(len(SHAPES))]
    trained, fresh = SimulatedCluster(config, 2, 2), SimulatedCluster(config, 2, 2)
    try:
        trained.reduce_scatter([_grads(rank, 0) for rank in range(4)], names)
        for source, target in zip(trained.states, fresh.states):
            target.load_state_dict(source.state_dict())
            assert target.names() == tuple(names)
        grads = [_grads(rank, 1) for rank in range(4)]
        want, got = trained.reduce_scatter(grads, names), fresh.reduce_scatter(grads, names)
        assert all(torch.equal(a, b) for r in range(4) for a, b in zip(want[r], got[r]))
        for source, target in zip(trained.states, fresh.states):
            assert all(torch.equal(a, b) for (a, _), (b, _) in zip(_snapshot(source), _snapshot(target), strict=True))
            assert all(torch.equal(a, b) for (_, a), (_, b) in zip(_snapshot(source), _snapshot(target)))
    finally:
        trained.close()
        fresh.close()


def test_one_plan_per_cluster_and_each_rank_exchanges_with_its_own_peers():
    cluster = SimulatedCluster(LocoConfig(group_size=GROUP), 2, 2)
    try:
        assert all(state.plan == cluster.plan for state in cluster.states)
        exchanges = {id(hop.exchange) for reducer in cluster.reducers for hop in reducer.plan.hops}
        assert len(exchanges) == 4 * len(cluster.plan.hops)
    finally:
        cluster.close()


def test_names_that_do_not_match_the_gradients_are_refused_and_the_cluster_stays_usable():
    cluster = SimulatedCluster(LocoConfig(group_size=GROUP), 2, 2)
    try:
        grads = [_grads(rank, 0) for rank in range(4)]
        with pytest.raises(ValueError, match="3 names for"):
            cluster.reduce_scatter(grads, ["a", "b", "c"])
        assert len(cluster.reduce_scatter(grads, ["a", "b", "c", "d"])[0]) == len(SHAPES)
        assert cluster.states[0].names() == ("a", "b", "c", "d")
    finally:
        cluster.close()
