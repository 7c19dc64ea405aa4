"""Observers of the bucket reduce (``deepspeed_loco.add_reduce_observer``), with LoCo and around DeepSpeed's own
reduce: 4 gloo processes, 2 nodes x 2 ranks, 2 optimizer steps."""
import math

import pytest
import torch

from deepspeed_loco.runtime.zero.deepspeed_seam import private_names
from tests.unit.runtime.zero.test_stage3_hook import WORLD, _batch, _ds_config, _model


def observe(arm):
    """Step 1 with two observers, step 2 after the later one's ``remove()``; then the earlier one is removed too."""
    import deepspeed_loco
    model = _model()
    engine, _, _, _ = deepspeed_loco.initialize(model=model, model_parameters=model.parameters(),
                                                config=_ds_config(arm))
    seen, counted = [], []
    second = deepspeed_loco.add_reduce_observer(engine, lambda names, grads, partitions: counted.append(len(names)))
    first = deepspeed_loco.add_reduce_observer(engine, lambda names, grads, partitions: seen.append(
        (list(names), [tuple(g.shape) for g in grads], [p.numel() for p in partitions])))
    rank = torch.distributed.get_rank()
    for step in range(2):
        if step == 1:
            first.remove()
            first.remove()  # a second remove does nothing
        x, y = _batch(rank, step, "fp32")
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
    second.remove()
    hook = deepspeed_loco.loco_hook(engine)
    return {"seen": seen, "counted": counted, "reduces": hook.reducer.stats.reduces if hook else None,
            "patched": private_names().reduce in vars(engine.optimizer)}


@pytest.mark.parametrize("arm", ["loco", "full"])
def test_an_observer_sees_each_bucket_once_until_removed(process_pool, arm):
    shapes = {name: tuple(p.shape) for name, p in _model().named_parameters()}
    results = process_pool(WORLD).run(observe, arm)
    for result in results:
        buckets = result["seen"]  # step 1 only: removed before step 2
        names = [name for bucket_names, _, _ in buckets for name in bucket_names]
        assert sorted(names) == sorted(shapes)  # every parameter once
        for bucket_names, grad_shapes, partition_numels in buckets:
            assert grad_shapes == [shapes[n] for n in bucket_names]
            chunks = [math.ceil(math.prod(shapes[n]) / WORLD) for n in bucket_names]
            if arm == "loco":  # ceil(N / W) elements, zero past N
                assert partition_numels == chunks
            else:  # DeepSpeed's own partitions stop at N
                assert all(got <= chunk for got, chunk in zip(partition_numels, chunks))
        assert result["counted"] == [len(b[0]) for b in buckets] * 2  # the other observer saw both steps
        if arm == "loco":
            assert result["reduces"] == 2 * len(buckets)
            assert result["patched"]  # LoCo's own reduce stays
        else:
            assert not result["patched"]  # the observation of DeepSpeed's reduce is gone
    if arm == "full":  # the ranks' partitions of a parameter add up to it
        for bucket in zip(*(result["seen"] for result in results)):
            per_rank = [numels for _, _, numels in bucket]
            assert [sum(n) for n in zip(*per_rank)] == [math.prod(shapes[n]) for n in bucket[0][0]]


def listen():
    """3 optimizer steps with ``reset_T: 2`` and the live rho measuring every step: one step listener for all
    three, another removed after step 2. Each records ``(step, cleared, whether the live rho had its estimate)``."""
    import deepspeed_loco
    model = _model()
    engine, _, _, _ = deepspeed_loco.initialize(model=model, model_parameters=model.parameters(), config=_ds_config(
        "loco", loco={"reset_T": 2, "rho_every": 1}))
    hook = deepspeed_loco.loco_hook(engine)
    early, late = [], []
    handle = hook.add_step_listener(
        lambda step, cleared: early.append((step, cleared, hook.live_rho.fresh is not None)))
    hook.add_step_listener(lambda step, cleared: late.append((step, cleared, hook.state.step)))
    rank = torch.distributed.get_rank()
    for step in range(3):
        if step == 2:
            handle.remove()
        x, y = _batch(rank, step, "fp32")
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
    return early, late


def test_step_listeners_hear_each_step_after_the_live_rho_until_removed(process_pool):
    for early, late in process_pool(WORLD).run(listen):
        assert early == [(1, False, True), (2, True, True)]  # the reset_T reset at step 2; the live rho ran first
        assert late == [(1, False, 1), (2, True, 2), (3, False, 3)]  # after the step rules: the step counted
