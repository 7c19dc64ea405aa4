"""The live rho's algebra (``noise_stats``) on synthetic per-rank gradients with a known covariance."""
import math

import pytest
import torch

from deepspeed_loco.runtime.comm.noise_stats import NoiseSample, ReduceSums, RhoEstimate, RhoEstimator, describe


def _totals(grads: torch.Tensor, hop_error_sq, micro_steps: int = 1):
    """Totals whose error terms are exactly ``hop_error_sq`` and whose communicated mean's norm is the exact mean's
    plus that error power (errors orthogonal to the mean): ``grads`` float64 ``(W, n)``."""
    world = grads.shape[0]
    mean = grads.mean(0)
    totals = []
    for h, error in enumerate(hop_error_sq):
        totals += [float(grads.pow(2).sum()) if h == 0 else 0.0, error * world**2]
    totals.append(float(mean.pow(2).sum()) + sum(hop_error_sq))
    return [t * micro_steps for t in totals]


@pytest.mark.parametrize("world", [2, 4, 16])
def test_noise_is_the_exact_spread_of_the_ranks_when_the_error_power_is_exact(world):
    grads = torch.randn(world, 1000, dtype=torch.float64) + 0.3
    errors = (0.7, 0.2)
    sample = NoiseSample.from_totals(_totals(grads, errors), world, 1)
    mean = grads.mean(0)
    exact_noise = float((grads - mean).pow(2).sum()) / (world * (world - 1))
    assert sample.hop_error_sq == pytest.approx(errors, rel=1e-12)
    assert sample.noise_sq == pytest.approx(exact_noise, rel=1e-10)
    assert sample.grad_sq == pytest.approx(float(mean.pow(2).sum()) - exact_noise, rel=1e-10)


def test_accumulated_micro_steps_give_the_per_micro_step_sample():
    grads = torch.randn(4, 300, dtype=torch.float64)
    one = NoiseSample.from_totals(_totals(grads, (0.5, )), 4, 1)
    three = NoiseSample.from_totals(_totals(grads, (0.5, ), micro_steps=3), 4, 3)
    assert three.noise_sq == pytest.approx(one.noise_sq, rel=1e-12)
    assert three.grad_sq == pytest.approx(one.grad_sq, rel=1e-12)
    assert three.hop_error_sq == pytest.approx(one.hop_error_sq, rel=1e-12)


def test_noise_and_signal_estimates_are_unbiased_for_a_known_covariance():
    """g_r = G + the mean of b samples of N(0, sigma^2 I_n): tr(Sigma) = n sigma^2, E[noise] = n sigma^2 / (W b).
    The noise estimate is (sigma^2/b) chi^2_{n(W-1)} / (W(W-1)): relative sd sqrt(2 / (n (W-1))) per trial."""
    torch.manual_seed(0)
    world, b, n, sigma, trials = 4, 8, 200, 1.5, 400
    signal = torch.randn(n, dtype=torch.float64) * 0.2
    noise, grad_sq = [], []
    for _ in range(trials):
        grads = signal + torch.randn(world, b, n, dtype=torch.float64).mul(sigma).mean(1)
        sample = NoiseSample.from_totals(_totals(grads, (0.1, 0.05)), world, 1)
        noise.append(sample.noise_sq)
        grad_sq.append(sample.grad_sq)
    expected = n * sigma**2 / (world * b)
    rel_sd = math.sqrt(2 / (n * (world - 1)) / trials)
    assert sum(noise) / trials == pytest.approx(expected, rel=5 * rel_sd)
    # grad_sq = ||mean||^2 - noise: its sd per trial is at most that of ||mean||^2 (sd ~ 2 sqrt(n) s^2 + ...) plus the
    # noise estimate's; 5 standard errors of the two together
    per = expected / n  # variance per coordinate of the exact mean
    sd = math.sqrt(2 * n * per**2 + 4 * per * float(signal.pow(2).sum())) + expected * math.sqrt(2 / (n * (world - 1)))
    assert sum(grad_sq) / trials == pytest.approx(float(signal.pow(2).sum()), abs=5 * sd / math.sqrt(trials))


def test_a_non_finite_sum_gives_no_sample_and_bad_shapes_are_refused():
    assert NoiseSample.from_totals([1.0, float("inf"), 2.0], 4, 1) is None
    with pytest.raises(ValueError, match="2H \\+ 1"):
        NoiseSample.from_totals([1.0, 2.0], 4, 1)
    with pytest.raises(ValueError, match="world_size"):
        NoiseSample.from_totals([1.0, 2.0, 3.0], 1, 1)


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


def test_reduce_sums_lay_out_hops_then_the_mean():
    sums = ReduceSums(2)
    assert sums.take("cpu").tolist() == [0.0] * 5  # no reduce ran
    hops, mean = sums.views("cpu")
    hops[1][1] += 3.0
    mean[0] += 7.0
    assert sums.take("cpu").tolist() == [0.0, 0.0, 0.0, 3.0, 7.0]
    assert sums.tensor is None
