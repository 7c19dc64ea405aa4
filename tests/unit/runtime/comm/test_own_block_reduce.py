"""The reducer with ``zeropp_loco_param.exact_own_block`` (each rank's own block of every hop kept exact), on a
simulated cluster (in-process ranks, the library's reducer and kernels) and on real gloo processes, at one node, one
rank per node and 2 x 2:

* the means are within the quantizer's bound of the exact mean;
* the own block's contribution is exact: where every other rank's gradient is zero, a rank's mean partition is its
  own gradient's partition over ``W``, bit for bit (not so with every block quantized);
* the error buffers have ``W - M`` (intra-node) and ``M - 1`` (inter-node) rows;
* the live rho's sums: the input's power over every row, the quantizer's error over the quantized rows only;
* with the key false the reducer calls every kernel as before (no own block, no own buffer).
"""
import pytest
import torch
import torch.distributed as dist

from deepspeed_loco.config import LocoConfig
from deepspeed_loco.layout import INTER_NODE, INTRA_NODE, plan_hops, slot_to_row
from deepspeed_loco.ops import library
from deepspeed_loco.ops import loco_reference as ref
from deepspeed_loco.ops.quantizer import dequantize_groups, qmax, quantize_groups
from deepspeed_loco.runtime.comm import loco_reduce
from deepspeed_loco.runtime.comm.loco_reduce import LocoReducer
from deepspeed_loco.runtime.comm.topology import LocoTopology
from deepspeed_loco.simulation import SimulatedCluster

SHAPES = [(7, ), (33, 5), (64, 64), (1000, 3)]
NAMES = [f"p{i}" for i in range(len(SHAPES))]
GROUP = 32
LAYOUTS = [(2, 2), (1, 4), (4, 1)]  # (M, L): 2 x 2, one node, one rank per node


def _config(**kw):
    return LocoConfig(**{"group_size": GROUP, "exact_own_block": True, **kw})


def _grads(rank, dtype=torch.float32, seed=1):
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    return [(torch.randn(shape, generator=gen) * 10**(i - 1)).to(dtype) for i, shape in enumerate(SHAPES)]


def _alone(owner, world, dtype=torch.float32):
    """Every rank's gradients: ``owner``'s random, every other rank's zero."""
    return [[g if rank == owner else torch.zeros_like(g) for g in _grads(owner, dtype)] for rank in range(world)]


def _partition(grad, world, rank):
    """Rank ``rank``'s partition of ``grad`` in fp32, zero past its end."""
    part = ref.partition_size(grad.numel(), world)
    flat = torch.zeros(world * part)
    flat[:grad.numel()] = grad.reshape(-1).float()
    return flat[rank * part:(rank + 1) * part]


def _gaps_over_bound(all_grads, outs, rank, nodes, local, config):
    """Per parameter, the largest ``|out - exact mean| / bound`` of rank ``rank``'s partition (above 1: outside).
    The bound (``test_loco_reduce._error_bound``): each hop adds at most half a step of the quantizer, whose scale
    is at most the sum of the ranks' group absmax; plus fp32 slack and the rounding to the gradient's dtype."""
    world = nodes * local
    factor = (0.5 / qmax(config.intra_node_bits) if local > 1 else 0) + (
        0.5 / qmax(config.inter_node_bits) if nodes > 1 else 0)
    worst = []
    for i, out in enumerate(outs):
        grads = [g[i] for g in all_grads]
        exact = sum(_partition(g, world, rank).double() for g in grads) / world
        absmax = sum(ref.partition_rows(g, world, GROUP)[rank].view(-1, GROUP).abs().amax(-1).double() for g in grads)
        bound = (absmax / world * (factor * (1 + 1e-5) + 1e-6)).repeat_interleave(GROUP)[:exact.numel()]
        bound = bound + exact.abs() * torch.finfo(out.dtype).eps
        worst.append(float(((out.double() - exact).abs() / bound.clamp_min(1e-30)).max()))
    return worst


def _error_rows(nodes, local):
    """The error rows the key leaves each hop: ``W - M`` intra-node, ``M - 1`` inter-node."""
    rows = {}
    if local > 1:
        rows[INTRA_NODE] = nodes * local - nodes
    if nodes > 1:
        rows[INTER_NODE] = nodes - 1
    return rows


def _buffer_rows(state):
    return {name: {hop: b.shape[0] for hop, b in state.buffers_of(name).items()} for name in state.names()}


# ------------------------------------------------------------------------------------------- simulated cluster
@pytest.mark.parametrize("nodes,local", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_means_are_within_the_quantizer_bound_of_the_exact_mean(nodes, local, dtype):
    world = nodes * local
    config = _config(intra_node_bits=4, inter_node_bits=2)
    grads = [_grads(rank, dtype) for rank in range(world)]
    cluster = SimulatedCluster(config, nodes, local)
    try:
        means = cluster.reduce_scatter(grads, NAMES)
    finally:
        cluster.close()
    ratios = [r for rank in range(world) for r in _gaps_over_bound(grads, means[rank], rank, nodes, local, config)]
    assert max(ratios) <= 1.0
    assert max(ratios) > 0.05  # the bound is not vacuous


@pytest.mark.parametrize("nodes,local", LAYOUTS)
@pytest.mark.parametrize("error_feedback", [True, False])
def test_a_rank_alone_gets_its_own_partition_over_w_exactly(nodes, local, error_feedback):
    world = nodes * local
    exact, quantized = SimulatedCluster(_config(error_feedback=error_feedback), nodes, local), SimulatedCluster(
        _config(error_feedback=error_feedback, exact_own_block=False), nodes, local)
    try:
        for owner in range(world):
            for state in exact.states + quantized.states:
                state.reset()  # the zero gradients must send zeros: no remembered error
            grads = _alone(owner, world)
            want = [_partition(g, world, owner) / world for g in grads[owner]]
            got = exact.reduce_scatter(grads, NAMES)[owner]
            assert all(torch.equal(g, w) for g, w in zip(got, want))
            plain = quantized.reduce_scatter(grads, NAMES)[owner]
            assert not all(torch.equal(p, w) for p, w in zip(plain, want))  # every block quantized: not exact
    finally:
        exact.close()
        quantized.close()


@pytest.mark.parametrize("nodes,local", LAYOUTS + [(2, 4)])
def test_the_error_buffers_have_w_minus_m_and_m_minus_1_rows(nodes, local):
    cluster = SimulatedCluster(_config(), nodes, local)
    try:
        cluster.reduce_scatter([_grads(rank) for rank in range(nodes * local)], NAMES)
    finally:
        cluster.close()
    for state in cluster.states:
        assert dict(state.rows()) == _error_rows(nodes, local)
        assert _buffer_rows(state) == {name: _error_rows(nodes, local) for name in NAMES}
        assert state.memory_bytes() == sum(state.planned_bytes(torch.Size(s).numel()) for s in SHAPES)


def test_the_live_rho_sums_count_the_quantizers_error_on_the_quantized_rows_only():
    """2 x 2, a measured first step (no remembered error): the input power and the mean's power are what they are
    with every block quantized; hop 1's quantizer error is the error without the key less each rank's error on its
    own slots (its quantized rows are the same), so the live rho splits the mean's error between the hops by the
    error their quantizers really made."""
    nodes, local, world = 2, 2, 4
    grads = [_grads(rank) for rank in range(world)]
    totals = {}
    for exact_own_block in (True, False):
        cluster = SimulatedCluster(_config(exact_own_block=exact_own_block), nodes, local)
        try:
            cluster.measure_noise(1)
            means = cluster.reduce_scatter(grads, NAMES)
            totals[exact_own_block] = cluster.noise_totals("cpu")[:5].tolist()
        finally:
            cluster.close()
        outputs = sum(float(m.double().pow(2).sum()) for rank in means for m in rank)
        assert totals[exact_own_block][4] == pytest.approx(outputs, rel=1e-5)
    on, off = totals[True], totals[False]
    assert on[0] == pytest.approx(off[0], rel=1e-6)
    assert on[0] == pytest.approx(sum(float(g.double().pow(2).sum()) for rank in grads for g in rank), rel=1e-5)
    grid = plan_hops(world, local, _config()).grid
    own_error = 0.0
    for rank, rank_grads in enumerate(grads):
        own = slice(rank % local * nodes, (rank % local + 1) * nodes)  # its own slots: M rows for local peer d
        for grad in rank_grads:
            rows = ref.partition_rows(grad, world, GROUP)[slot_to_row(world, local)][own]
            q, scale = quantize_groups(rows, 4, GROUP, grid)
            own_error += float((rows - dequantize_groups(q, scale, GROUP, grid)).double().pow(2).sum())
    assert on[1] == pytest.approx(off[1] - own_error, rel=1e-4)
    assert 0 < own_error < off[1]


def test_with_the_key_false_every_kernel_is_called_without_an_own_block(monkeypatch):
    """The reducer's calls as before the key: every ``own`` and ``in_own`` -1 and no own buffer passed."""
    calls = []

    def spy(name):
        def call(*args):
            calls.append((name, args))
            return getattr(library.REFERENCE, name)(*args)
        return call

    kernels = library.Kernels("spy", spy("quantize_bucket_"), spy("requantize_bucket_"), spy("final_mean_bucket"),
                              library.REFERENCE.gather_sample)
    monkeypatch.setattr(loco_reduce, "kernels_for", lambda device, mode: kernels)
    cluster = SimulatedCluster(LocoConfig(group_size=GROUP), 2, 2)
    try:
        cluster.reduce_scatter([_grads(rank) for rank in range(4)], NAMES)
    finally:
        cluster.close()
    assert sorted({name for name, _ in calls}) == ["final_mean_bucket", "quantize_bucket_", "requantize_bucket_"]
    for name, args in calls:
        hop_args = args[3] if name == "requantize_bucket_" else args[2]
        own_buffers = {"quantize_bucket_": args[6:], "requantize_bucket_": args[7:], "final_mean_bucket": args[7:]}
        assert (getattr(hop_args, "own", -1), hop_args.in_own) == (-1, -1)
        assert all(buffer is None for buffer in own_buffers[name])


# ---------------------------------------------------------------------------------------------------- real gloo
def check_exact_own_block(local_size):
    """On every rank: the gaps over the bound, whether the partition of a rank alone was exact, the error rows."""
    topo = LocoTopology.build(local_size=local_size)
    world, nodes, rank = topo.world_size, topo.num_nodes, topo.rank
    config = _config(intra_node_bits=4, inter_node_bits=2, local_world_size=local_size)
    ratios = []
    for dtype in (torch.float32, torch.bfloat16):
        grads = _grads(rank, dtype)
        gathered = [[torch.empty_like(g) for g in grads] for _ in range(world)]
        for i, grad in enumerate(grads):
            dist.all_gather([other[i] for other in gathered], grad)
        outs = LocoReducer.for_topology(config, topo).reduce_scatter(NAMES, grads)
        ratios += _gaps_over_bound(gathered, outs, rank, nodes, local_size, config)
    alone = []
    for owner in range(world):
        reducer = LocoReducer.for_topology(config, topo)
        grads = _alone(owner, world)[rank]
        outs = reducer.reduce_scatter(NAMES, grads)
        if rank == owner:
            alone.append(all(torch.equal(o, _partition(g, world, rank) / world) for o, g in zip(outs, grads)))
    return max(ratios), alone, _buffer_rows(reducer.state)


@pytest.mark.parametrize("nodes,local", LAYOUTS)
def test_the_reducer_on_gloo_keeps_each_ranks_own_block_exact(process_pool, nodes, local):
    results = process_pool(nodes * local).run(check_exact_own_block, local)
    assert 0.05 < max(ratio for ratio, _, _ in results) <= 1.0
    assert [alone for _, alone, _ in results] == [[True]] * (nodes * local)
    assert all(rows == {name: _error_rows(nodes, local) for name in NAMES} for _, _, rows in results)
