"""simulate(): arms trained on the simulated cluster, against a hand-written exact-mean training loop."""
from dataclasses import FrozenInstanceError

import pytest
import torch

from deepspeed_loco.simulation import (ArmResult, SimulationSpec, StepObserver, TrainingSetup, gradient_noise_scale,
                                      parse_arm, simulate)
from tests.unit.simulation.toy import toy_batches, toy_loss, toy_model

WORLD, MICRO, STEPS = 4, 4, 30


_model, _loss = toy_model, toy_loss


def _data():
    return toy_batches(WORLD * MICRO)


def _run(arms, seed=0, **setup):
    setup = TrainingSetup(_model, _data, nodes=2, local=2, loss_fn=_loss,
                          loco={"group_size": 32, **setup.pop("loco", {})}, **setup)
    return simulate(SimulationSpec(setup, arms, STEPS, seed))


def test_full_arm_is_exactly_a_data_parallel_training_loop():
    """Bit for bit with one backward per rank, as the loop below (vmap's batched matmuls may sum in another order:
    ``test_vmap_and_loop_agree_within_rounding``)."""
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    expected, data = [], _data()
    for _ in range(STEPS):
        x, y = next(data)
        grads, losses = [], []
        for xs, ys in zip(x.chunk(WORLD), y.chunk(WORLD)):
            opt.zero_grad()
            loss = _loss(model, (xs, ys))
            loss.backward()
            grads.append([p.grad.clone() for p in model.parameters()])
            losses.append(float(loss.detach()))
        for i, p in enumerate(model.parameters()):
            stacked = torch.stack([g[i] for g in grads])
            p.grad = (stacked[:2].sum(0) + stacked[2:].sum(0)) / WORLD  # summed per node (2 x 2), then over nodes
        opt.step()
        expected.append(sum(losses) / WORLD)
    (full, ) = _run(["full"], grad_mode="loop")
    assert full.train_losses == expected
    assert full.grad_rel_errors == [0.0] * STEPS and full.bytes_per_step == full.full_precision_bytes_per_step


@pytest.mark.slow
def test_quantized_arms_send_their_wire_bytes_and_loco_removes_the_bias():
    plain, loco = _run(["plain2", "loco2"])
    params = sum(p.numel() for p in _model().parameters())
    # 2-bit values + an fp32 scale per 32-group on both hops, every partition padded to whole groups
    assert 0 < plain.bytes_per_step == loco.bytes_per_step < 0.2 * plain.full_precision_bytes_per_step
    assert plain.full_precision_bytes_per_step == 3 / 4 * params * 4
    # a 2-bit reduce is far from exact each step (at most the two hops' half steps, relative to absmax)
    assert all(0 < e < 1.5 for e in plain.grad_rel_errors)
    # error feedback: the running sum of what LoCo communicated stays close to the exact running sum
    assert loco.sum_rel_errors[-1] < 0.5 * plain.sum_rel_errors[-1]


@pytest.mark.slow
def test_same_seed_same_run_and_eval_is_recorded():
    evals = lambda model: float(model[0].weight.abs().sum())  # noqa: E731
    a, = _run(["loco4h"], eval_fn=evals, eval_every=10, seed=5)
    b, = _run(["loco4h"], eval_fn=evals, eval_every=10, seed=5)
    assert a.train_losses == b.train_losses and a.validation == b.validation
    assert [s for s, _ in a.validation] == [10, 20, 30] and a.final_val_loss == a.validation[-1][1]
    assert a.to_dict()["key"] == "loco4h"


def test_bad_arm_and_bad_batch_are_clear_errors():
    with pytest.raises(ValueError, match="arm 'loco5' is invalid"):
        _run(["loco5"])
    with pytest.raises(ValueError, match="global batch of 6 does not split into 4"):
        simulate(SimulationSpec(TrainingSetup(_model, lambda: iter([(torch.zeros(6, 8), torch.zeros(6, 1))]),
                                              loss_fn=_loss), ["full"], 1))


@pytest.mark.slow
def test_vmap_and_loop_agree_within_rounding():
    """vmap's one batched pass and the per-rank loop compute the same gradients, up to the order in which the CPU's
    matmul kernels sum (bit-identical on some CPUs, not on an AVX-512/AMX Xeon). AdamW turns a gradient's relative
    rounding into an update of about lr times it, so over 30 steps the full arm's losses stay within 1e-6
    (measured there: 7e-8); quantized arms can round an element to another level, so only their first loss,
    before any update, is held to that."""
    for arm in ("full", "plain4"):
        vmapped, = _run([arm], grad_mode="vmap")
        looped, = _run([arm], grad_mode="loop")
        steps = STEPS if arm == "full" else 1
        assert vmapped.train_losses[:steps] == pytest.approx(looped.train_losses[:steps], rel=1e-6, abs=0)


@pytest.mark.parametrize("intra,inter", [(8, 8), (4, 4), (8, 2), (2, 2)])
def test_plain_mean_is_within_the_two_hops_half_steps(intra, inter):
    """Per element, |mean - exact| <= A/(2 q1) + A (1 + 1/(2 q1)) / (2 q2): hop 1 rounds each rank's value to half a
    step of its group's absmax (<= A, the largest gradient magnitude), hop 2 the per-node partial sums (a mean of
    at most A (1 + 1/(2 q1)) per rank); q = 2^(bits-1) - 1."""
    from deepspeed_loco.config import LocoConfig
    from deepspeed_loco.simulation import SimulatedCluster
    gen = torch.Generator().manual_seed(intra * 10 + inter)
    grads = [[torch.randn(700, generator=gen) * (1 + r), torch.randn(33, 5, generator=gen)] for r in range(WORLD)]
    cluster = SimulatedCluster(LocoConfig(intra_node_bits=intra, inter_node_bits=inter, group_size=32,
                                          error_feedback=False, local_world_size=2), 2, 2)
    try:
        mean = cluster.mean_gradients(grads)
    finally:
        cluster.close()
    q1, q2 = 2**(intra - 1) - 1, 2**(inter - 1) - 1
    for i, got in enumerate(mean):
        stacked = torch.stack([g[i] for g in grads])
        top = stacked.abs().max()
        bound = top / (2 * q1) + top * (1 + 1 / (2 * q1)) / (2 * q2)
        assert float((got - stacked.mean(0)).abs().max()) <= float(bound) * (1 + 1e-5)


def test_bad_options_are_clear_errors():
    with pytest.raises(ValueError, match="grad_mode = 'batched'"):
        _run(["full"], grad_mode="batched")
    with pytest.raises(ValueError, match="compile = 'fastest' is invalid: it must be None or a torch.compile backend"):
        _run(["full"], grad_mode="loop", compile="fastest")
    with pytest.raises(ValueError, match="compile = 'inductor' is invalid with grad_mode = 'vmap'"):
        _run(["full"], grad_mode="vmap", compile="inductor")


_COMPILED_GRAPHS = []


@torch._dynamo.register_backend
def _counting_backend(graph, example_inputs):
    """A torch.compile backend that records each graph it is given and runs it as traced (eager kernels)."""
    _COMPILED_GRAPHS.append(graph)
    return graph.forward


@pytest.mark.slow
def test_compile_runs_the_loop_passes_through_the_compiled_model():
    """With ``compile``, the ranks' passes go through ``torch.compile`` (the backend sees the model's graph) and,
    with a backend that runs the traced graph on the eager kernels, train exactly as without it."""
    _COMPILED_GRAPHS.clear()
    eager, = _run(["loco4"], grad_mode="loop")
    assert not _COMPILED_GRAPHS
    compiled, = _run(["loco4"], grad_mode="loop", compile="_counting_backend")
    assert _COMPILED_GRAPHS, "the compiled model was never called"
    assert compiled.train_losses == eager.train_losses and compiled.grad_rel_errors == eager.grad_rel_errors


@pytest.mark.slow
def test_fidelity_is_measured_before_clipping():
    """Clipping scales the communicated mean in place; the error is of what was communicated, not of the clip."""
    free, = _run(["plain4"])
    clipped, = _run(["plain4"], grad_clip=1e-6)
    assert clipped.grad_rel_errors[0] == free.grad_rel_errors[0] and clipped.sum_rel_errors[0] == free.sum_rel_errors[0]
    assert all(e < 0.2 for e in clipped.grad_rel_errors)


@pytest.mark.slow
def test_rank_chunks_give_the_same_training_as_one_pass():
    whole, = _run(["loco2"])
    for chunk in (1, 3):  # 3 leaves a short last chunk
        chunked, = _run(["loco2"], rank_chunk=chunk)
        assert chunked.train_losses == whole.train_losses and chunked.sum_rel_errors == whole.sum_rel_errors
    with pytest.raises(ValueError, match="rank_chunk = 0"):
        _run(["full"], rank_chunk=0)


@pytest.mark.slow
def test_gradient_spread_is_of_the_exact_gradients():
    full, plain = _run(["full", "plain2"])
    assert full.world_size == WORLD and full.rank_batch == MICRO
    # the same weights at step 1 whatever the arm; the exact mean's norm never exceeds the ranks' mean norm
    assert full.rank_grad_sq[0] == plain.rank_grad_sq[0] and full.mean_grad_sq[0] == plain.mean_grad_sq[0]
    assert all(0 < m <= r for m, r in zip(full.mean_grad_sq, full.rank_grad_sq))
    assert gradient_noise_scale(full) > 0


def test_gradient_noise_scale_inverts_the_two_batch_norms():
    """With ||G||^2 = 4 and tr(Sigma) = 8 per sample, b = 2 samples per rank and W = 4: E||g_r||^2 = 4 + 8/2 and
    E||g_mean||^2 = 4 + 8/8, so B = 8 / 4 = 2 samples; steps before ``first_step`` are left out."""
    result = ArmResult("full", "full precision", 0, rank_grad_sq=[100.0, 8.0, 8.0], mean_grad_sq=[1.0, 5.0, 5.0],
                       rank_batch=2, world_size=4)
    assert gradient_noise_scale(result, first_step=2) == pytest.approx(2.0, rel=1e-12)
    assert gradient_noise_scale(ArmResult("full", "", 0, rank_grad_sq=[8.0], mean_grad_sq=[5.0], rank_batch=2,
                                          world_size=1)) is None
    # noise swamps the signal: the ||G||^2 estimate is not positive
    assert gradient_noise_scale(ArmResult("full", "", 0, rank_grad_sq=[8.0], mean_grad_sq=[1.0], rank_batch=2,
                                          world_size=4)) is None


class _Watcher(StepObserver):
    """Records what each step's reduce showed, with a plain 2-bit shadow for every qgZ arm."""

    def __init__(self):
        self.seen = []

    def shadow_blocks(self, arm, block):
        return [dict(block, inter_node_bits=2, intra_node_bits=2, error_feedback=False)] if block else []

    def after_reduce(self, reduced):
        self.seen.append((reduced.arm.key, reduced.step, reduced.cluster is None, reduced.communicated is reduced.exact,
                          len(reduced.shadows), len(reduced.result.train_losses)))


def test_an_observer_sees_every_step_s_reduce_and_its_shadow_changes_nothing():
    watcher = _Watcher()
    setup = TrainingSetup(_model, _data, nodes=2, local=2, loss_fn=_loss, loco={"group_size": 32})
    full, loco = simulate(SimulationSpec(setup, ["full", "loco4"], 3), watcher)
    assert watcher.seen == [("full", t, True, True, 0, t - 1) for t in (1, 2, 3)] + [
        ("loco4", t, False, False, 1, t - 1) for t in (1, 2, 3)]  # before the step is recorded
    alone, = simulate(SimulationSpec(setup, ["loco4"], 3))
    assert alone.train_losses == loco.train_losses and alone.bytes_per_step == loco.bytes_per_step


def test_a_spec_is_frozen_and_checked_when_built():
    setup = TrainingSetup(_model, _data, loss_fn=_loss)
    spec = SimulationSpec(setup, ["full", "loco4"], 2)
    assert spec.arms == (parse_arm("full"), parse_arm("loco4")) and spec.blocks[0] is None
    assert spec.blocks[1]["inter_node_bits"] == 4 and spec.blocks[1]["local_world_size"] == 2
    with pytest.raises(FrozenInstanceError):
        spec.steps = 3
    with pytest.raises(TypeError, match="SimulationSpec: setup = 3 is invalid: it must be a TrainingSetup"):
        SimulationSpec(3, ["full"], 2)
    with pytest.raises(TypeError, match="simulate: spec = .* is invalid: it must be a SimulationSpec"):
        simulate(setup)


def test_live_rho_of_measured_steps_is_the_exact_error_and_spread_when_every_coordinate_is_sampled():
    """Hidden 16: no parameter above the sample's 256 coordinates, so on the steps ``rho_every`` measures the live
    error is the communicated mean's exact error (LoCo's remembered error included) and the live noise the ranks'
    exact spread ``(mean_r ||g_r||^2 - ||exact mean||^2) / (W - 1)``, to fp32 rounding."""
    setup = TrainingSetup(lambda: toy_model(16), _data, nodes=2, local=2, loss_fn=_loss,
                          loco={"group_size": 32, "rho_every": 2})
    for result in simulate(SimulationSpec(setup, ["plain2", "loco4"], 6, 0)):
        assert result.live_rho_steps == [2, 4, 6]
        for step, errors, noise in zip(result.live_rho_steps, result.live_hop_error_sq, result.live_noise_sq):
            exact_sq = result.mean_grad_sq[step - 1]
            assert sum(errors) == pytest.approx(result.grad_rel_errors[step - 1]**2 * exact_sq, rel=1e-4)
            assert noise == pytest.approx((result.rank_grad_sq[step - 1] - exact_sq) / (WORLD - 1), rel=1e-4)


class _Attention(torch.nn.Module):
    """A self-attention layer through scaled_dot_product_attention, which vmap runs without a batching rule (a
    loop), and a warning of the model's own."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(8, 24), torch.nn.Linear(8, 1)

    def forward(self, x):
        import warnings
        warnings.warn("the model's own warning", UserWarning)
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)
        return self.out(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).squeeze(1))


def test_a_vmap_pass_does_not_repeat_pytorchs_fallback_warning_and_keeps_others():
    """PyTorch warns that vmap loops over an operator without a batching rule (attention here): the simulator's
    batched pass does not show that warning (documented instead), and every other warning still reaches the user."""
    import warnings

    def batches():
        gen = torch.Generator().manual_seed(0)
        while True:
            yield torch.randn(WORLD * 2, 5, 8, generator=gen)

    setup = TrainingSetup(_Attention, batches, nodes=2, local=2, loss_fn=lambda model, x: model(x).pow(2).mean(),
                          loco={"group_size": 32}, grad_mode="vmap")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        simulate(SimulationSpec(setup, ["plain4"], 2, 0))
    messages = [str(w.message) for w in caught]
    assert not [m for m in messages if "batching rule" in m], messages
    assert "the model's own warning" in messages
