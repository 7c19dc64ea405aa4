"""The LoCo reduce across real gloo processes, at several (M nodes, L ranks per node) layouts."""
import pytest
import torch
import torch.distributed as dist

from deepspeed_loco.config import LocoConfig, LocoConfigError
from deepspeed_loco.ops import loco_reference as ref
from deepspeed_loco.ops.quantizer import qmax
from deepspeed_loco.runtime.comm.loco_reduce import LocoReducer
from deepspeed_loco.runtime.comm.topology import LocoTopology
from deepspeed_loco.layout.wire import wire_bytes_per_element

SHAPES = [(7, ), (33, 5), (64, 64), (1000, 3)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
LAYOUTS = [(2, 2), (3, 2), (1, 4), (4, 1), (1, 1)]  # (M, L)
GROUP = 32


def _grads(rank, dtype, seed):
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    return [(torch.randn(shape, generator=gen) * 10**(i - 1)).to(dtype) for i, shape in enumerate(SHAPES)]


def _names():
    return [f"p{i}" for i in range(len(SHAPES))]


def _exact_mean_partition(grad, world, rank):
    """This rank's partition of the fp64 mean, through a real full-precision all-reduce."""
    total = grad.double().reshape(-1).clone()
    dist.all_reduce(total)
    part = ref.partition_size(grad.numel(), world)
    padded = torch.zeros(world * part, dtype=torch.float64)
    padded[:grad.numel()] = total / world
    return padded[rank * part:(rank + 1) * part]


def _error_bound(grad, topo, cfg):
    """Per element of this rank's partition, from the quantizer: each hop adds at most half a step.

    Hop 1 quantizes each rank's group g (absmax a_r) with step a_r / qmax1; hop 2 quantizes the node's sum,
    whose absmax is at most the sum of its ranks' a_r, with step <= sum a_r / qmax2. So
    |out - mean| <= (sum_r a_r / W) * (1/(2 qmax1) [L > 1] + 1/(2 qmax2) [M > 1]), plus fp32 rounding.
    """
    part = ref.partition_size(grad.numel(), topo.world_size)
    rows = ref.partition_rows(grad, topo.world_size, GROUP)
    absmax = rows.view(topo.world_size, -1, GROUP).abs().amax(-1).double()
    dist.all_reduce(absmax)  # every partition's sum over ranks; keep this rank's
    absmax = absmax[topo.rank]
    factor = 0.0
    if topo.local_size > 1:
        factor += 0.5 / qmax(cfg.intra_node_bits)
    if topo.num_nodes > 1:
        factor += 0.5 / qmax(cfg.inter_node_bits)
    per_group = absmax / topo.world_size * (factor * (1 + 1e-5) + 1e-6)
    return per_group.repeat_interleave(GROUP)[:part]


def check_matches_exact_mean(local_size):
    """Returns (largest gap / bound, failures); failures are collected, not raised, so no rank leaves a collective."""
    topo = LocoTopology.build(local_size=local_size)
    worst, failures = 0.0, []
    for error_feedback in (True, False):
        for dtype in DTYPES:
            cfg = LocoConfig(group_size=GROUP, error_feedback=error_feedback, local_world_size=local_size)
            grads = _grads(topo.rank, dtype, seed=1)
            outs = LocoReducer.for_topology(cfg, topo).reduce_scatter(_names(), grads)
            for grad, out in zip(grads, outs):
                exact = _exact_mean_partition(grad, topo.world_size, topo.rank)
                bound = _error_bound(grad, topo, cfg)
                if out.dtype != dtype or out.shape != exact.shape:
                    failures.append(f"{dtype} {tuple(grad.shape)}: got {out.dtype} {tuple(out.shape)}")
                    continue
                # the result is rounded once more to the gradient's dtype
                bound = bound + exact.abs() * torch.finfo(dtype).eps
                gap = (out.double() - exact).abs()
                if topo.world_size == 1 and not torch.equal(out, grad.reshape(-1)):
                    failures.append(f"{dtype} {tuple(grad.shape)}: a world of one rank must return the gradient")
                if not torch.all(gap <= bound):
                    failures.append(f"{dtype} {tuple(grad.shape)} ef={error_feedback}: gap over bound by "
                                    f"{float((gap - bound).max())}")
                worst = max(worst, float((gap / bound.clamp_min(1e-30)).max()))
    return worst, failures


def check_one_all_to_all_per_hop(local_size):
    topo = LocoTopology.build(local_size=local_size)
    calls = []
    original = dist.all_to_all_single

    def counting(*args, **kwargs):
        calls.append(kwargs.get("group"))
        return original(*args, **kwargs)

    dist.all_to_all_single = counting
    try:
        reducer = LocoReducer.for_topology(LocoConfig(group_size=GROUP), topo)
        reducer.reduce_scatter(_names(), _grads(topo.rank, torch.float32, 2))
    finally:
        dist.all_to_all_single = original
    return len(calls)


def check_first_step_equals_plain_and_feedback_removes_bias(local_size, steps):
    """Same fixed gradients every step: LoCo's running mean converges to the exact mean, plain qgZ's does not."""
    topo = LocoTopology.build(local_size=local_size)
    grads = _grads(topo.rank, torch.float32, seed=3)
    exact = [_exact_mean_partition(g, topo.world_size, topo.rank) for g in grads]
    results = {}
    for error_feedback in (True, False):
        reducer = LocoReducer.for_topology(LocoConfig(group_size=GROUP, error_feedback=error_feedback), topo)
        names = _names()
        outs = [reducer.reduce_scatter(names, grads) for _ in range(steps)]
        running = [torch.stack([o[i].double() for o in outs]).mean(0) for i in range(len(grads))]
        results[error_feedback] = {
            "first": [o.clone() for o in outs[0]],
            "one_step": _rel_error(outs[0], exact),
            "running16": _rel_error([torch.stack([o[i].double() for o in outs[:16]]).mean(0)
                                     for i in range(len(grads))], exact),
            "running": _rel_error(running, exact),
        }
    for a, b in zip(results[True]["first"], results[False]["first"]):
        assert torch.equal(a, b), "with zero buffers LoCo's first step must equal plain qgZ"
    return {k: {n: v for n, v in r.items() if n != "first"} for k, r in results.items()}


def _rel_error(outs, exact):
    """Relative L2 error of the whole bucket, all ranks together."""
    num = torch.tensor([sum(float(((o.double() - e)**2).sum()) for o, e in zip(outs, exact))], dtype=torch.float64)
    den = torch.tensor([sum(float((e**2).sum()) for e in exact)], dtype=torch.float64)
    dist.all_reduce(num)
    dist.all_reduce(den)
    return float((num / den).sqrt())


def check_hadamard_matches_exact_mean(local_size):
    """With rotated groups the quantization error is bounded per group in L2 (the rotation is orthonormal):
    a hop's error on group g of rank r is at most sqrt(S)/2 * (rotated absmax)/qmax <= sqrt(S)/2 * ||x_rg||/qmax,
    so ||out_g - mean_g|| <= sqrt(S)/(2W) * sum_r ||x_rg|| * (1/qmax1 [L > 1] + 1/qmax2 [M > 1]).
    Returns (largest ratio of error to bound, failures)."""
    topo = LocoTopology.build(local_size=local_size)
    failures, worst = [], 0.0
    for error_feedback in (True, False):
        cfg = LocoConfig(group_size=GROUP, hadamard=True, error_feedback=error_feedback)
        grads = _grads(topo.rank, torch.float32, seed=4)
        outs = LocoReducer.for_topology(cfg, topo).reduce_scatter(_names(), grads)
        for grad, out in zip(grads, outs):
            exact = _exact_mean_partition(grad, topo.world_size, topo.rank)
            norms = ref.partition_rows(grad, topo.world_size, GROUP).view(topo.world_size, -1, GROUP).norm(dim=-1)
            norms = norms.double()
            dist.all_reduce(norms)
            factor = (1 / qmax(cfg.intra_node_bits) if topo.local_size > 1 else 0) + (
                1 / qmax(cfg.inter_node_bits) if topo.num_nodes > 1 else 0)
            bound = GROUP**0.5 / (2 * topo.world_size) * norms[topo.rank] * factor * (1 + 1e-4) + 1e-6
            padded = torch.zeros(bound.numel() * GROUP, dtype=torch.float64)
            padded[:out.numel()] = out.double() - exact
            gap = padded.view(-1, GROUP).norm(dim=-1)
            if not torch.all(gap <= bound):
                failures.append(f"{tuple(grad.shape)} ef={error_feedback}: group error over bound")
            worst = max(worst, float((gap / bound).max()))
    return worst, failures


def check_wire_stats(local_size, intra_bits, inter_bits, reduces):
    """The reducer's telemetry after ``reduces`` reduces of the same bucket."""
    topo = LocoTopology.build(local_size=local_size)
    cfg = LocoConfig(group_size=GROUP, intra_node_bits=intra_bits, inter_node_bits=inter_bits)
    reducer = LocoReducer.for_topology(cfg, topo)
    for _ in range(reduces):
        reducer.reduce_scatter(_names(), _grads(topo.rank, torch.float32, 5))
    return reducer.stats


def check_bad_layout_is_rejected(local_size):
    try:
        LocoTopology.build(local_size=local_size)
    except LocoConfigError as err:
        return str(err)
    return None


@pytest.mark.parametrize("nodes,local", LAYOUTS)
def test_every_rank_gets_the_mean_partition_within_the_quantizer_bound(process_pool, nodes, local):
    results = process_pool(nodes * local).run(check_matches_exact_mean, local)
    assert [f for _, fails in results for f in fails] == []
    ratios = [ratio for ratio, _ in results]
    assert max(ratios) <= 1.0
    if nodes * local > 1:
        # the bound is not vacuous: the observed error uses a real share of it
        assert max(ratios) > 0.05


@pytest.mark.parametrize("nodes,local", [(2, 2), (1, 4), (4, 1)])
def test_hadamard_rotated_reduce_is_within_its_l2_bound(process_pool, nodes, local):
    results = process_pool(nodes * local).run(check_hadamard_matches_exact_mean, local)
    assert [f for _, fails in results for f in fails] == []
    assert 0.01 < max(ratio for ratio, _ in results) <= 1.0


@pytest.mark.parametrize("nodes,local,expected", [(2, 2, 2), (3, 2, 2), (1, 4, 1), (4, 1, 1), (1, 1, 0)])
def test_a_bucket_costs_one_all_to_all_per_hop(process_pool, nodes, local, expected):
    assert process_pool(nodes * local).run(check_one_all_to_all_per_hop, local) == [expected] * (nodes * local)


@pytest.mark.parametrize("nodes,local", [(2, 2), (1, 4), (4, 1)])
def test_error_feedback_removes_the_bias_of_repeated_quantization(process_pool, nodes, local):
    result = process_pool(nodes * local).run(check_first_step_equals_plain_and_feedback_removes_bias, local, 64)[0]
    loco, plain = result[True], result[False]
    assert plain["running"] == pytest.approx(plain["one_step"], rel=1e-9)  # deterministic: the bias stays
    assert loco["running"] < 0.1 * plain["running"]
    assert loco["running"] < 0.5 * loco["running16"]  # and keeps shrinking with more steps


@pytest.mark.parametrize("world,local", [(4, 3), (6, 4)])
def test_layout_that_does_not_tile_the_world_is_a_clear_error(process_pool, world, local):
    messages = process_pool(world).run(check_bad_layout_is_rejected, local)
    assert all(m is not None and f"local_world_size = {local}" in m and str(world) in m for m in messages)


@pytest.mark.parametrize("nodes,local", [(2, 2), (1, 4), (4, 1)])
def test_telemetry_counts_the_bytes_per_element_of_each_hop_scales_included(process_pool, nodes, local):
    world, intra_bits, inter_bits, reduces = nodes * local, 8, 2, 2
    # every parameter's partition padded to whole groups: the columns of one row on either wire
    columns = sum(ref.padded_partition_size(torch.Size(shape).numel(), world, GROUP) for shape in SHAPES)
    for stats in process_pool(world).run(check_wire_stats, local, intra_bits, inter_bits, reduces):
        assert stats.reduces == reduces
        # hop 1 sends all but the M rows a rank keeps, hop 2 all but one row
        assert stats.elements.get("intra_node", 0) == reduces * (local - 1) * nodes * columns
        assert stats.elements.get("inter_node", 0) == reduces * (nodes - 1) * columns
        intra = wire_bytes_per_element(intra_bits, GROUP) if local > 1 else 0.0
        inter = wire_bytes_per_element(inter_bits, GROUP) if nodes > 1 else 0.0
        assert (stats.bytes_per_element("intra_node"), stats.bytes_per_element("inter_node")) == (intra, inter)
        for hop in stats.bytes:
            assert stats.bytes[hop] == {"intra_node": intra, "inter_node": inter}[hop] * stats.elements[hop]
    assert wire_bytes_per_element(intra_bits, GROUP) == 8 / 8 + 4 / GROUP == 1.125  # the figures, spelled out
    assert wire_bytes_per_element(inter_bits, GROUP) == 2 / 8 + 4 / GROUP == 0.375



def check_profiler_ranges(local_size):
    """The ``deepspeed_loco.*`` ranges of a profile of one reduce, with their call counts."""
    from torch.profiler import ProfilerActivity, profile
    topo = LocoTopology.build(local_size=local_size)
    reducer = LocoReducer.for_topology(LocoConfig(group_size=GROUP), topo)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        reducer.reduce_scatter(_names(), _grads(topo.rank, torch.float32, 3))
    return {e.key: e.count for e in prof.key_averages() if e.key.startswith("deepspeed_loco.")}


def test_a_profile_names_each_kernel_and_exchange_of_each_hop(process_pool):
    from deepspeed_loco.runtime.comm.loco_reduce import profiler_range
    names = [profiler_range("intra_node", "quantize_bucket_"), profiler_range("intra_node", "all_to_all"),
             profiler_range("inter_node", "requantize_bucket_"), profiler_range("inter_node", "all_to_all"),
             profiler_range(None, "final_mean_bucket")]
    assert names[0] == "deepspeed_loco.intra_node.quantize_bucket_"
    assert process_pool(4).run(check_profiler_ranges, 2) == [dict.fromkeys(names, 1)] * 4


def test_inter_node_error_feedback_keeps_error_on_the_inter_node_hop_only():
    """``error_feedback: "inter_node"`` on 2 x 2 ranks: the intra-node hop reduces with no error buffer, the
    inter-node hop with one. From zero buffers the first step's means and inter-node errors are those of error
    feedback on every hop, bit for bit (a zero error compensates nothing); the second step's means differ (the
    intra-node hop's error is not fed back)."""
    from deepspeed_loco.simulation import SimulatedCluster
    config = dict(group_size=GROUP, intra_node_bits=4, inter_node_bits=2)
    inter = SimulatedCluster(LocoConfig(error_feedback="inter_node", **config), 2, 2)
    every = SimulatedCluster(LocoConfig(error_feedback=True, **config), 2, 2)
    try:
        first = [_grads(rank, torch.float32, 1) for rank in range(4)]
        assert _equal_means(inter.reduce_scatter(first, _names()), every.reduce_scatter(first, _names()))
        for state_inter, state_every in zip(inter.states, every.states):
            for name in _names():
                assert list(state_inter.buffers_of(name)) == ["inter_node"]
                assert torch.equal(state_inter.buffers_of(name)["inter_node"].dequantize(),
                                   state_every.buffers_of(name)["inter_node"].dequantize())
        second = [_grads(rank, torch.float32, 2) for rank in range(4)]
        assert not _equal_means(inter.reduce_scatter(second, _names()), every.reduce_scatter(second, _names()))
    finally:
        inter.close()
        every.close()


def _equal_means(got, want) -> bool:
    return all(torch.equal(g, w) for rank_g, rank_w in zip(got, want) for g, w in zip(rank_g, rank_w))
