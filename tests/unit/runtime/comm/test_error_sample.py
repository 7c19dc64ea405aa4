"""The live rho's shared sample of coordinates (``error_sample``): which coordinates every rank picks, what each
rank keeps of them, and the powers estimated from their sum over ranks, against ranks played by hand."""
import math

import pytest
import torch

from deepspeed_loco.ops.loco_reference import gather_sample
from deepspeed_loco.runtime.comm.error_sample import (PER_TENSOR, MeanErrorSample, SampledPowers, sample_indices,
                                                      sample_many)
from tests.unit.runtime.comm.ranks_by_hand import partition, rank_vectors, summed_vectors


@pytest.mark.parametrize("numel", [1, 100, PER_TENSOR, PER_TENSOR + 1, 1000, 123_457])
def test_sample_indices_are_a_deterministic_increasing_sample_in_range_weighted_to_the_whole(numel):
    indices, weight = sample_indices("layers.0.weight", numel, 7)
    again, same_weight = sample_indices("layers.0.weight", numel, 7)
    assert torch.equal(indices, again) and weight == same_weight
    assert indices.dtype == torch.int64 and indices.numel() == min(numel, PER_TENSOR)
    assert int(indices[0]) >= 0 and int(indices[-1]) < numel
    assert bool((indices[1:] > indices[:-1]).all())
    assert weight * indices.numel() == pytest.approx(numel, rel=1e-12)
    if numel <= PER_TENSOR:
        assert torch.equal(indices, torch.arange(numel)) and weight == 1.0
    else:
        assert not torch.equal(indices, sample_indices("layers.0.weight", numel, 8)[0])
        assert not torch.equal(indices, sample_indices("layers.1.weight", numel, 7)[0])


def test_parameters_sampled_together_get_what_each_gets_alone():
    """``sample_many`` computes the large tensors' coordinates in one pass: row for row what each name alone gives,
    and a name repeated in one reduce is sampled once (its first place)."""
    names, numels = ["a", "b", "c", "d", "e"], [10, 1000, PER_TENSOR, 123_457, PER_TENSOR + 1]
    together = sample_many(names, numels, 3)
    for name, numel, (indices, weight) in zip(names, numels, together):
        alone, alone_weight = sample_many([name], [numel], 3)[0]
        assert torch.equal(indices, alone) and weight == alone_weight
    picks = MeanErrorSample(3, 0).pick(["b", "d", "b"], [1000, 123_457, 1000])
    assert torch.equal(picks[0][0], together[1][0]) and torch.equal(picks[1][0], together[3][0]) and picks[2] is None


def test_every_coordinate_is_picked_with_probability_one_over_the_weight():
    """Over ``T`` steps a coordinate's picks are Binomial(T, 1/w) when the offset is uniform: every count within
    5 standard deviations (1000 coordinates: a miss by chance about 6e-4)."""
    numel, steps = 1000, 2000
    counts = torch.zeros(numel)
    for step in range(steps):
        indices, weight = sample_indices("embed.weight", numel, step)
        counts[indices] += 1
    p = 1 / weight
    sd = math.sqrt(steps * p * (1 - p))
    assert float((counts - steps * p).abs().max()) < 5 * sd


def _exact_values(world, shapes, gen):
    """Gradients and errors of the mean on a grid of 1/64: every value, product and sum below is exact in fp32."""
    grads = [[torch.randint(-32, 33, shape, generator=gen).float() / 8 for shape in shapes] for _ in range(world)]
    exact = [sum(g[i] for g in grads).reshape(-1) / world for i in range(len(shapes))]
    errors = [torch.randint(-8, 9, (e.numel(), ), generator=gen).float() / 64 for e in exact]
    return grads, exact, errors


@pytest.mark.parametrize("world", [2, 4, 8])
def test_tensors_of_at_most_256_elements_give_the_exact_powers(world):
    shapes = [(7, ), (16, 16), (5, 33), (1, )]
    grads, exact, errors = _exact_values(world, shapes, torch.Generator().manual_seed(world))
    means = [e + d for e, d in zip(exact, errors)]
    p = SampledPowers.of(summed_vectors(3, ["a", "b", "c", "d"], grads, means), world)
    stacked = [torch.stack([g[i].reshape(-1) for g in grads]).double() for i in range(len(shapes))]
    spread = sum(float((s - s.mean(0)).pow(2).sum()) for s in stacked) / (world * (world - 1))
    exact_sq = sum(float(e.double().pow(2).sum()) for e in exact)
    assert p.error_sq == pytest.approx(sum(float(d.double().pow(2).sum()) for d in errors), rel=1e-12)
    assert p.noise_sq == pytest.approx(spread, rel=1e-12)
    assert p.mean_sq == pytest.approx(exact_sq, rel=1e-12)
    assert p.excess_sq == pytest.approx(sum(float(m.double().pow(2).sum()) for m in means) - exact_sq, rel=1e-12)


def test_a_large_tensor_gives_unbiased_powers_over_steps_with_the_variance_it_reports():
    """One tensor of ``N`` coordinates in random order: a systematic sample of ``n`` at a uniform offset is a simple
    random sample, so the weighted sum of a per-coordinate term ``x`` has variance ``N^2 S^2 / n (1 - n / N)``
    (``S^2`` the variance of ``x`` over the ``N`` coordinates). Over ``T`` steps (independent offsets) the mean of
    the estimates is within 5 of its standard errors of the truth; the reported ``noise_var`` and ``excess_var``
    average to that variance within 10% (the sample variance of 256 terms, averaged over ``T``, varies by a few
    percent), and so does the estimates' own spread over the steps within 30% (a variance from ``T`` values)."""
    world, numel, steps = 4, 50_000, 300
    gen = torch.Generator().manual_seed(0)
    grads = [[torch.randn(numel, generator=gen) * 0.5 + 0.2] for _ in range(world)]
    exact = sum(g[0] for g in grads) / world
    mean = exact + torch.randn(numel, generator=gen) * 0.3
    stacked = torch.stack([g[0] for g in grads]).double()
    terms = {  # per coordinate, exact in fp64
        "error_sq": (mean.double() - stacked.mean(0)).pow(2),
        "noise_sq": (stacked - stacked.mean(0)).pow(2).sum(0) / (world * (world - 1)),
        "excess_sq": mean.double().pow(2) - stacked.mean(0).pow(2),
    }
    powers = [SampledPowers.of(summed_vectors(step, ["w"], grads, [mean]), world) for step in range(steps)]
    for name, term in terms.items():
        variance = numel**2 * float(term.var()) / PER_TENSOR * (1 - PER_TENSOR / numel)
        estimates = torch.tensor([getattr(p, name) for p in powers], dtype=torch.float64)
        assert float(estimates.mean()) == pytest.approx(float(term.sum()), abs=5 * math.sqrt(variance / steps)), name
        assert float(estimates.var()) == pytest.approx(variance, rel=0.3), name
    for name, term in (("noise_var", terms["noise_sq"]), ("excess_var", terms["excess_sq"])):
        reported = sum(getattr(p, name) for p in powers) / steps
        assert reported == pytest.approx(numel**2 * float(term.var()) / PER_TENSOR, rel=0.1), name


def test_each_picked_coordinate_comes_from_exactly_the_rank_that_owns_it():
    """``N = 10007`` on 4 ranks: partitions of 2502, the last padded; every picked coordinate's ``out`` is nonzero on
    one rank only, the one whose partition holds it, and the sum over ranks is ``sqrt(w) out`` bit for bit."""
    world, numel = 4, 10_007
    mean = torch.arange(1, numel + 1, dtype=torch.float32)
    grads = [[torch.ones(numel)] for _ in range(world)]
    vectors = rank_vectors(2, ["w"], grads, [mean])
    indices, weight = sample_indices("w", numel, 2)
    out = vectors.reshape(world, 3, -1)[:, 2]  # (W, picked)
    width = math.ceil(numel / world)
    for rank in range(world):
        assert torch.equal(out[rank] != 0, indices // width == rank)
    assert torch.equal(out.sum(0), mean[indices] * math.sqrt(weight))


def test_a_parameter_reduced_again_in_the_same_step_is_sampled_once():
    gen = torch.Generator().manual_seed(1)
    sample = MeanErrorSample(5, 0)
    first = [torch.randn(10, generator=gen), torch.randn(1000, generator=gen)]
    picks = sample.pick(["a", "b"], [10, 1000])
    sample.take_inputs(picks, first)
    sample.take_outputs(picks, [partition(g, 0, 2) for g in first])
    later = [torch.randn(1000, generator=gen), torch.randn(20, generator=gen)]  # "b" again, in a later micro-step
    picks = sample.pick(["b", "c"], [1000, 20])
    assert picks[0] is None and picks[1] is not None
    sample.take_inputs(picks, later)
    sample.take_outputs(picks, [partition(g, 0, 2) for g in later])
    g = sample.vector("cpu").reshape(3, -1)[0]
    assert g.numel() == 10 + PER_TENSOR + 20
    indices, weight = sample_indices("b", 1000, 5)
    assert torch.equal(g[10:10 + PER_TENSOR], first[1][indices] * math.sqrt(weight))  # the first reduce's values
    assert MeanErrorSample(6, 0).pick(["b"], [1000])[0] is not None  # the next step samples it again


def test_a_reduce_that_took_its_inputs_but_not_its_outputs_gives_no_vector():
    sample = MeanErrorSample(1, 0)
    sample.take_inputs(sample.pick(["a"], [300]), [torch.randn(300)])
    with pytest.raises(RuntimeError, match="not its outputs"):
        sample.vector("cpu")


def test_a_reduce_gathers_its_sample_in_two_calls_whatever_its_number_of_parameters():
    """The measured reduce's cost does not grow in calls with the parameters: one gather for the gradients, one for
    the mean partitions (``Kernels.gather_sample``: one launch each on CUDA), with the values of the reference."""
    calls = []

    def counting(tensors, owners, coords, scales):
        calls.append(len(tensors))
        return gather_sample(tensors, owners, coords, scales)

    names, numels = [f"p{i}" for i in range(40)], [10 + 97 * i for i in range(40)]
    grads = [torch.randn(n) for n in numels]
    counted, plain = MeanErrorSample(2, 1), MeanErrorSample(2, 1)
    for sample, gather in ((counted, counting), (plain, gather_sample)):
        picks = sample.pick(names, numels)
        sample.take_inputs(picks, grads, gather)
        sample.take_outputs(picks, [partition(g, 1, 2) for g in grads])
    assert calls == [40, 40]
    assert torch.equal(counted.vector("cpu"), plain.vector("cpu"))

