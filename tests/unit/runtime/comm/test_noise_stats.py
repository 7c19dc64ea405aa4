"""The live rho's algebra (``noise_stats``) on totals made as a real run makes them: reduces of a simulated cluster
(the library's reducer, kernels and sample; the all-reduce a sum over its virtual ranks) or ranks played by hand,
against the exact powers of the communicated and the exact mean."""
import math

import pytest
import torch

from deepspeed_loco.config import LocoConfig
from deepspeed_loco.ops.loco_reference import gather_sample
from deepspeed_loco.runtime.comm.error_sample import MeanErrorSample, SampledPowers
from deepspeed_loco.runtime.comm.noise_stats import NoiseSample, ReduceSums, RhoEstimate, RhoEstimator, describe
from deepspeed_loco.simulation import SimulatedCluster
from tests.unit.runtime.comm.ranks_by_hand import partition, summed_vectors

SMALL = [(7, ), (16, 16), (5, 33)]  # every coordinate sampled: the live powers are the exact ones
LARGE = [(1000, 3), (300, )]  # sampled


def _cluster(nodes, local, bits, error_feedback=True):
    return SimulatedCluster(LocoConfig(group_size=32, intra_node_bits=bits[0], inter_node_bits=bits[1],
                                       error_feedback=error_feedback), nodes, local)


def _grads(world, shapes, gen):
    """``[r][i]``: rank ``r``'s gradient of shape ``shapes[i]``, fp32, unit noise about a signal of 0.3."""
    return [[torch.randn(shape, generator=gen) + 0.3 for shape in shapes] for _ in range(world)]


def _measure(cluster, step, grads, micro_steps=1):
    """Optimizer step ``step`` measured, each of its ``micro_steps`` reducing ``grads``: the summed totals and the
    first micro-step's full means."""
    names = [f"p{i}" for i in range(len(grads[0]))]
    cluster.measure_noise(step)
    means = [cluster.mean_gradients(grads, names) for _ in range(micro_steps)][0]
    return cluster.noise_totals("cpu"), means


def _exact(grads, means):
    """``||mean - exact mean||^2``, ``sum_r ||g_r - exact mean||^2 / (W (W - 1))`` and ``||exact mean||^2``, fp64."""
    world = len(grads)
    error = noise = exact_sq = 0.0
    for i, mean in enumerate(means):
        ranks = torch.stack([g[i].double() for g in grads])
        exact = ranks.mean(0)
        error += float((mean.double() - exact).pow(2).sum())
        noise += float((ranks - exact).pow(2).sum()) / (world * (world - 1))
        exact_sq += float(exact.pow(2).sum())
    return error, noise, exact_sq


@pytest.mark.parametrize("nodes,local", [(1, 2), (2, 2), (2, 4), (4, 4)])
def test_small_parameters_give_the_exact_error_and_noise_split_by_the_quantizers_error(nodes, local):
    """Step 2 of a LoCo run (its mean carries step 1's remembered error): all coordinates sampled, so the error is
    the communicated mean's own, the noise the ranks' exact spread (both estimates of it exact), to fp32 rounding."""
    world = nodes * local
    gen = torch.Generator().manual_seed(world)
    cluster = _cluster(nodes, local, (4, 2))
    try:
        cluster.mean_gradients(_grads(world, SMALL, gen), [f"p{i}" for i in range(len(SMALL))])
        cluster.on_optimizer_step()
        grads = _grads(world, SMALL, gen)
        totals, means = _measure(cluster, 2, grads)
    finally:
        cluster.close()
    hops = len(cluster.plan.hops)
    sample = NoiseSample.from_totals(totals, hops, world, 1)
    error, noise, exact_sq = _exact(grads, means)
    assert sample.error_sq == pytest.approx(error, rel=1e-4)
    assert sample.noise_sq == pytest.approx(noise, rel=1e-4)
    assert sample.grad_sq == pytest.approx(exact_sq - noise, rel=1e-4)
    quantizer = [float(totals[2 * h + 1]) for h in range(hops)]
    assert [e / sample.error_sq for e in sample.hop_error_sq] == pytest.approx([q / sum(quantizer) for q in quantizer],
                                                                               rel=1e-9)
    if hops == 2:
        assert sample.hop_error_sq[1] > sample.hop_error_sq[0]  # the 2-bit hop's error exceeds the 4-bit hop's


def test_accumulated_micro_steps_give_the_per_micro_step_sample_and_sample_the_first_only():
    """Plain qgZ reduces the same gradients to the same mean: three micro-steps give the sums three times over, the
    same sampled values and so the same per-micro-step sample."""
    gen = torch.Generator().manual_seed(0)
    grads = _grads(4, SMALL + LARGE, gen)
    cluster = _cluster(2, 2, (4, 4), error_feedback=False)
    try:
        one, _ = _measure(cluster, 1, grads)
        three, _ = _measure(cluster, 1, grads, micro_steps=3)
    finally:
        cluster.close()
    hops = len(cluster.plan.hops)
    assert three.numel() == one.numel()
    assert torch.allclose(three[:2 * hops + 1], 3 * one[:2 * hops + 1], rtol=1e-6, atol=0)
    assert torch.equal(three[2 * hops + 1:], one[2 * hops + 1:])
    a, b = NoiseSample.from_totals(one, hops, 4, 1), NoiseSample.from_totals(three, hops, 4, 3)
    assert b.noise_sq == pytest.approx(a.noise_sq, rel=1e-6)
    assert b.grad_sq == pytest.approx(a.grad_sq, rel=1e-6)
    assert b.hop_error_sq == pytest.approx(a.hop_error_sq, rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("bits", [(8, 8), (2, 2)])
def test_sampled_error_noise_and_signal_are_unbiased(bits):
    """g_r = G + the mean of b samples of N(0, sigma^2 I_n), parameters larger than the sample: per trial the live
    error, noise and signal less the exact ones of that trial; their means over the trials within 5 standard errors
    of 0. At 8 bits the full sums carry the noise estimate, at 2 bits the sample does (the error swamps them)."""
    world, b, sigma, trials = 4, 8, 1.5, 200
    gen = torch.Generator().manual_seed(bits[0])
    signal = [torch.randn(shape, generator=gen) * 0.2 for shape in LARGE]
    cluster = _cluster(2, 2, bits, error_feedback=False)
    differences = []
    try:
        for trial in range(1, trials + 1):
            grads = [[s + torch.randn(b, *s.shape, generator=gen).mul(sigma).mean(0) for s in signal]
                     for _ in range(world)]
            totals, means = _measure(cluster, trial, grads)
            sample = NoiseSample.from_totals(totals, len(cluster.plan.hops), world, 1)
            error, noise, exact_sq = _exact(grads, means)
            differences.append([sample.error_sq - error, sample.noise_sq - noise,
                                sample.grad_sq - (exact_sq - noise)])
    finally:
        cluster.close()
    differences = torch.tensor(differences, dtype=torch.float64)
    standard_error = differences.std(0) / math.sqrt(trials)
    assert (differences.mean(0).abs() < 5 * standard_error).all(), (differences.mean(0), standard_error)
    noise_sq = sum(s.numel() for s in signal) * sigma**2 / (world * b)
    assert float(standard_error[1]) < 0.01 * noise_sq  # the test resolves a bias of a few percent


def test_noise_is_the_full_sums_estimate_without_error_on_the_wire_and_between_the_two_with_it():
    """Ranks by hand, two micro-steps (so the full sums' noise, of both, differs from the sample's, of the first):
    values on a grid of 1/64, exact in fp32. A mean without error has no excess and no excess variance: the full
    sums' estimate is exact and taken as is. With an error, inverse-variance weights put the noise between them,
    nearer the one of smaller variance."""
    world, names = 4, ["a", "b"]
    gen = torch.Generator().manual_seed(3)
    grads = [[[torch.randint(-32, 33, shape, generator=gen).float() / 8 for shape in SMALL[:2]] for _ in range(world)]
             for _ in range(2)]
    exact = [[sum(g[i] for g in step).reshape(-1) / world for i in range(2)] for step in grads]
    for error in (0, 1):
        means = [[e + error * torch.randint(-8, 9, e.shape, generator=gen).float() / 64 for e in step]
                 for step in exact]
        sums = torch.tensor([sum(float(g.double().pow(2).sum()) for step in grads for rank in step for g in rank), 0.0,
                             sum(float(m.double().pow(2).sum()) for step in means for m in step)], dtype=torch.float64)
        vector = summed_vectors(1, names, grads[0], means[0])
        sample = NoiseSample.from_totals(torch.cat([sums, vector]), 1, world, 2)
        p = SampledPowers.of(vector, world)
        full = (float(sums[0]) / 2 / world - (float(sums[2]) / 2 - p.excess_sq)) / (world - 1)
        assert abs(full - p.noise_sq) > 0.01 * p.noise_sq  # the two estimates differ: the test can tell them apart
        if error:
            assert p.excess_var > 0 and min(full, p.noise_sq) < sample.noise_sq < max(full, p.noise_sq)
            closer_to_full = abs(sample.noise_sq - full) < abs(sample.noise_sq - p.noise_sq)
            assert closer_to_full == (p.excess_var / (world - 1)**2 < p.noise_var)  # the more precise one weighs more
        else:
            assert p.excess_sq == 0 and p.excess_var == 0 and sample.noise_sq == full
        assert sample.grad_sq == pytest.approx(float(sums[2]) / 2 - p.excess_sq - sample.noise_sq, rel=1e-12)


def test_a_non_finite_total_gives_no_sample_and_bad_shapes_are_refused():
    assert NoiseSample.from_totals(torch.tensor([1.0, float("inf"), 2.0]), 1, 4, 1) is None
    assert NoiseSample.from_totals(torch.tensor([1.0, 2.0, 3.0, 0.5, float("nan"), 1.0]), 1, 4, 1) is None
    with pytest.raises(ValueError, match="2H \\+ 1"):
        NoiseSample.from_totals(torch.tensor([1.0, 2.0]), 1, 4, 1)
    with pytest.raises(ValueError, match="per sampled coordinate"):
        NoiseSample.from_totals(torch.tensor([1.0, 2.0, 3.0, 4.0]), 1, 4, 1)
    with pytest.raises(ValueError, match="world_size"):
        NoiseSample.from_totals(torch.tensor([1.0, 2.0, 3.0]), 1, 1, 1)


def test_estimator_averages_numerator_and_denominator_before_dividing_over_its_window():
    estimator = RhoEstimator(["intra_node", "inter_node"], world_size=4, rank_batch=2, window=3)
    samples = [NoiseSample((1.0, 2.0), 10.0, 5.0), NoiseSample((3.0, 0.0), 2.0, 1.0), NoiseSample((0.5, 0.5), 3.0, 0.0),
               NoiseSample((2.0, 1.0), 1.0, 2.0)]
    for sample in samples:
        estimator.add(sample)
    window = samples[1:]  # the oldest fell out
    error = [sum(s.hop_error_sq[h] for s in window) / 3 for h in range(2)]
    noise, grad = sum(s.noise_sq for s in window) / 3, sum(s.grad_sq for s in window) / 3
    est = estimator.estimate()
    assert est.steps == 3
    assert est.rho == pytest.approx(sum(error) / noise, rel=1e-12)
    assert est.hop_rho == pytest.approx({"intra_node": error[0] / noise, "inter_node": error[1] / noise}, rel=1e-12)
    assert est.noise_scale == pytest.approx(4 * 2 * noise / grad, rel=1e-12)
    residuals = [s.error_sq - est.rho * s.noise_sq for s in window]
    assert est.rho_spread == pytest.approx(math.sqrt(sum(r * r for r in residuals) / 6) / noise, rel=1e-12)


def test_estimator_without_positive_noise_or_signal_says_so():
    estimator = RhoEstimator(["intra_node"], world_size=2, rank_batch=1)
    assert estimator.estimate() is None
    estimator.add(NoiseSample((1.0, ), -0.5, -1.0))
    est = estimator.estimate()
    assert math.isnan(est.rho) and est.rho_spread is None and est.noise_scale is None
    assert "not resolved" in describe(est, "2/2", 2, 1, False)
    with pytest.raises(ValueError, match="2 hops"):
        estimator.add(NoiseSample((1.0, 2.0), 1.0, 1.0))


@pytest.mark.parametrize("rho,error_feedback,words", [(1.4, False, "error_feedback: true"),
                                                      (1.4, True, "error feedback (on)"),
                                                      (0.2, False, "hides in the noise")])
def test_log_line_says_what_rho_means(rho, error_feedback, words):
    est = RhoEstimate(rho, 0.1, {"intra_node": rho / 2, "inter_node": rho / 2}, {}, 1.0, 1.0, 64.0, 10)
    line = describe(est, "4/4", 16, 4, error_feedback)
    assert f"live rho {rho:.3g}" in line and "intra-node" in line and "inter-node" in line
    assert "sampling noise" in line and "16 ranks x 4 samples" in line and "noise scale 64 samples" in line
    assert words in line


def test_reduce_sums_lay_out_hops_then_the_mean_then_the_sample():
    sums = ReduceSums(2, MeanErrorSample(1, 0))
    assert sums.take("cpu").tolist() == [0.0] * 5  # no reduce ran
    hops, mean = sums.stats("cpu")
    hops[1][1] += 3.0
    mean[0] += 7.0
    grad = torch.arange(5.0)
    sums.outputs(sums.inputs(["a"], [grad], gather_sample), [partition(grad / 2, 0, 2)])  # the reducer's calls
    assert sums.take("cpu").tolist() == [0.0, 0.0, 0.0, 3.0, 7.0] + grad.tolist() + grad.pow(2).tolist() + [
        0.0, 0.5, 1.0, 0.0, 0.0]  # rank 0 owns coordinates 0 to 2 of the mean
    assert sums.tensor is None
