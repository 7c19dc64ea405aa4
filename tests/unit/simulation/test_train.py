"""simulate(): arms trained on the simulated cluster, against a hand-written exact-mean training loop."""
import pytest
import torch

from deepspeed_loco.simulation import simulate

WORLD, MICRO, STEPS = 4, 4, 30


def _model():
    return torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))


def _data():
    gen = torch.Generator().manual_seed(3)
    teacher = torch.randn(8, 1, generator=gen)
    while True:
        x = torch.randn(WORLD * MICRO, 8, generator=gen)
        yield x, torch.sin(x @ teacher)


def _loss(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def _run(arms, **kw):
    return simulate(_model, _data, arms, steps=STEPS, nodes=2, local=2, loss_fn=_loss,
                    loco={"group_size": 32, **kw.pop("loco", {})}, **kw)


def test_full_arm_is_exactly_a_data_parallel_training_loop():
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
            p.grad = torch.stack([g[i] for g in grads]).sum(0) / WORLD
        opt.step()
        expected.append(sum(losses) / WORLD)
    (full, ) = _run(["full"])
    assert full.train_losses == expected
    assert full.grad_rel_errors == [0.0] * STEPS and full.bytes_per_step == 0


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
        simulate(_model, lambda: iter([(torch.zeros(6, 8), torch.zeros(6, 1))]), ["full"], steps=1, loss_fn=_loss)
