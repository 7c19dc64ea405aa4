"""Faults: non-finite gradients (bf16, fp16 overflow), frozen and gradient-less parameters, an exception in the
middle of a reduce (a kernel that raises, a collective that times out). Real gloo processes, 2 nodes x 2 ranks;
every rank returns what it saw and the asserts run in the parent, so no rank is left inside a collective."""
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from deepspeed_loco.config import LocoConfig
from deepspeed_loco.runtime.comm.loco_reduce import LocoReducer
from deepspeed_loco.runtime.comm.topology import LocoTopology
from tests.unit.runtime.zero.test_checkpoint import Net, batch, ds_config, gathered, loco_warnings

WORLD = 4
GROUP = 32
SHAPES = [(100, 7), (33, 5), (9, )]


def _names():
    return [f"p{i}" for i in range(len(SHAPES))]


def _grads(seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(1000 * seed + dist.get_rank())
    return [torch.randn(shape, generator=gen).to(dtype) for shape in SHAPES]


def _buffers(state):
    return [b.dequantize().clone() for b in state.buffers()]


def _facts(state):
    values = _buffers(state)
    return {"count": len(values), "finite": all(bool(torch.isfinite(v).all()) for v in values),
            "zero": all(not v.any() for v in values), "nonzero": all(bool(v.any()) for v in values)}


# --------------------------------------------------------------------------- an exception in the middle of a reduce
def exception_in_a_reduce():
    topo = LocoTopology.build(local_size=2)
    reducer = LocoReducer.for_topology(LocoConfig(group_size=GROUP), topo)
    names = _names()
    reducer.reduce_scatter(names, _grads(1))  # every parameter now has nonzero buffers
    out = {"before": _facts(reducer.state)}

    # checks that fail before any buffer is touched leave the buffers as they were
    kept = _buffers(reducer.state)
    for name, grads in (("int", _grads(2)[:1] + [torch.ones(33, 5, dtype=torch.int32)]),
                        ("none", _grads(2)[:1] + [None])):
        with loco_warnings() as warned:
            try:
                reducer.reduce_scatter(names[:2], grads)
                out[name] = "no error"
            except (TypeError, ValueError) as err:
                out[name] = str(err)
        out[name + "_unchanged"] = all(torch.equal(a, b) for a, b in zip(kept, _buffers(reducer.state)))
        out[name + "_warnings"] = warned

    # the first parameter's hop-1 kernel updates its buffer, the second one's raises (a sparse gradient: its
    # dtype passes the checks, the kernel cannot reshape it): the defined state afterwards is all buffers zero
    step = reducer.state.step
    with loco_warnings() as warned:
        try:
            reducer.reduce_scatter(names[:2], [_grads(3)[0], _grads(3)[1].to_sparse()])
            out["kernel"] = "no error"
        except RuntimeError as err:
            out["kernel"] = str(err)
    out["kernel_after"] = _facts(reducer.state)  # includes names[2], which was not in the failing bucket
    out["kernel_warnings"] = warned
    out["kernel_step_kept"] = reducer.state.step == step
    # and the reducer keeps working from there
    outputs = reducer.reduce_scatter(names, _grads(4))
    out["recovered"] = all(bool(torch.isfinite(o).all()) for o in outputs) and _facts(reducer.state)["nonzero"]
    return out


def _short_timeout_topology(seconds):
    """The 2 x 2 layout with subgroups whose collectives give up after ``seconds`` (a dead peer is noticed)."""
    rank, timeout = dist.get_rank(), timedelta(seconds=seconds)
    intra = [dist.new_group(ranks, timeout=timeout) for ranks in ([0, 1], [2, 3])][rank // 2]
    inter = [dist.new_group(ranks, timeout=timeout) for ranks in ([0, 2], [1, 3])][rank % 2]
    return LocoTopology(WORLD, 2, rank, None, intra, inter)


def collective_fails_in_a_reduce():
    """Ranks 1 and 3 stop taking part (a dead peer); ranks 0 and 2 time out in the intra-node all-to-all, after
    their hop-1 kernels updated the buffers. The first, successful reduce runs over the ordinary subgroups (no
    short timeout to trip over on a loaded machine); the failing one over subgroups with a 2 s timeout, sharing the
    same error-feedback state (the buffers' layout depends only on W and L)."""
    topo = LocoTopology.build(local_size=2)
    short = _short_timeout_topology(2)
    reducer = LocoReducer.for_topology(LocoConfig(group_size=GROUP), topo)
    names = _names()
    reducer.reduce_scatter(names, _grads(1))
    out = {"before": _facts(reducer.state), "rank": topo.rank}
    if topo.rank % 2 == 0:
        failing = LocoReducer(reducer.plan.with_exchanges(short.exchanges), reducer.state, short.rank)
        started = time.time()
        with loco_warnings() as warned:
            try:
                failing.reduce_scatter(names, _grads(2))
                out["error"] = None
            except RuntimeError as err:
                out["error"] = str(err)
        out["seconds"] = time.time() - started
        out["warnings"] = warned
    out["after"] = _facts(reducer.state)
    dist.barrier()  # everyone back in step on the default group
    return out


def test_failed_checks_leave_buffers_as_they_were_and_a_kernel_failure_zeroes_all(process_pool):
    for r in process_pool(WORLD).run(exception_in_a_reduce):
        assert r["before"]["count"] == 2 * len(SHAPES) and r["before"]["nonzero"]
        assert "is torch.int32; supported are float32, float16 and bfloat16" in r["int"]
        assert "has no gradient to reduce" in r["none"]
        assert r["int_unchanged"] and r["none_unchanged"] and r["int_warnings"] == r["none_warnings"] == []
        assert "reshape is not implemented for sparse tensors" in r["kernel"]
        assert r["kernel_after"]["zero"] and r["kernel_after"]["count"] == 2 * len(SHAPES) and r["kernel_step_kept"]
        assert len(r["kernel_warnings"]) == 1
        assert "RuntimeError during a LoCo reduce; all error-feedback buffers" in r["kernel_warnings"][0]
        assert r["recovered"]


def test_a_collective_that_fails_mid_reduce_zeroes_that_ranks_buffers(process_pool):
    for r in process_pool(WORLD).run(collective_fails_in_a_reduce):
        assert r["before"]["nonzero"] and r["after"]["finite"]
        if r["rank"] % 2 == 0:
            assert r["error"] is not None and "Timed out" in r["error"], r["error"]
            assert r["after"]["zero"] and r["seconds"] < 60
            assert len(r["warnings"]) == 1
            assert f"rank {r['rank']}: RuntimeError during a LoCo reduce" in r["warnings"][0]
        else:  # the ranks that never entered the reduce keep their (valid) buffers
            assert r["after"]["nonzero"]


# ------------------------------------------------------------------------------------------ non-finite gradients
def non_finite_through_the_reduce():
    topo = LocoTopology.build(local_size=2)
    out = {}
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        reducer = LocoReducer.for_topology(LocoConfig(group_size=GROUP), topo)
        names = _names()
        reducer.reduce_scatter(names, _grads(1, dtype))
        grads = _grads(2, dtype)
        if topo.rank == 1:
            grads[0][3, 2] = float("nan")
        if topo.rank == 2:
            grads[1][30, 1] = float("inf")
            grads[2][0] = float("-inf")
        poisoned = reducer.reduce_scatter(names, grads)
        after_poison = _facts(reducer.state)
        some_error_kept = sum(int(bool(b.any())) for b in _buffers(reducer.state))
        non_finite_out = sum(int((~torch.isfinite(o.float())).sum()) for o in poisoned)
        total = torch.tensor([non_finite_out])
        dist.all_reduce(total)
        clean = reducer.reduce_scatter(names, _grads(3, dtype))
        out[str(dtype)] = {"after_poison": after_poison, "kept": some_error_kept, "non_finite_out": int(total),
                           "clean_out_finite": all(bool(torch.isfinite(o.float()).all()) for o in clean),
                           "after_clean": _facts(reducer.state)}
    return out


def test_non_finite_gradients_leave_no_non_finite_value_in_any_buffer(process_pool):
    for r in process_pool(WORLD).run(non_finite_through_the_reduce):
        for dtype, facts in r.items():
            assert facts["after_poison"]["finite"] and facts["after_clean"]["finite"], dtype
            assert facts["kept"] > 0, dtype  # groups without a non-finite value keep their error
            assert facts["non_finite_out"] > 0, dtype  # DeepSpeed's overflow check still sees the poison
            assert facts["clean_out_finite"], dtype  # and the next reduce is clean: nothing was carried over


class PoisonableNet(Net):
    """``Net`` whose first layer's output gradient becomes Inf on ``poison_rank`` when ``poison`` is set."""
    poison = False
    poison_rank = 1

    def forward(self, x):
        h = self.a(x)
        if self.poison and dist.get_rank() == self.poison_rank:
            h.register_hook(lambda g: g * float("inf"))
        return self.b(torch.tanh(self.frozen(torch.tanh(h))))


def train_with_a_poisoned_step(dtype, steps=5, poison_step=2):
    """``Net`` in bf16 or fp16; on ``poison_step`` rank 1's gradient of layer ``a`` is Inf/NaN, layer ``b``'s is
    finite. Records the buffers after each backward (ZeRO-3 reduces during backward) and after each step."""
    import deepspeed_loco
    cfg = ds_config()
    cast = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    else:
        from deepspeed.accelerator import get_accelerator
        get_accelerator().is_fp16_supported = lambda: True  # as test_stage3_hook.py: torch's CPU fp16 suffices
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 4, "loss_scale_window": 100, "hysteresis": 1}
    torch.manual_seed(0)
    model = PoisonableNet()
    engine, _, _, _ = deepspeed_loco.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    hook = deepspeed_loco.loco_hook(engine)

    def layer_nonzero(prefix):
        return any(bool(b.dequantize().any()) for n, _, b in hook.state.named_buffers() if n.startswith(prefix))

    trace = []
    for step in range(steps):
        model.poison = step == poison_step
        x, y = batch(dist.get_rank(), step)
        engine.backward(torch.nn.functional.mse_loss(engine(x.to(cast)).float(), y))
        reduced = {"facts": _facts(hook.state), "b_nonzero": layer_nonzero("b.")}
        engine.step()
        trace.append({"reduced": reduced, "stepped": _facts(hook.state), "overflow": bool(engine.optimizer.overflow)})
    params = gathered(engine)
    everyone = [torch.empty_like(params) for _ in range(WORLD)]
    dist.all_gather(everyone, params)
    return {"trace": trace, "ranks_agree": all(torch.equal(p, params) for p in everyone),
            "params_finite": bool(torch.isfinite(params).all())}


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_inf_gradients_on_one_rank_leave_every_buffer_finite_and_the_skipped_step_clears_them(process_pool, dtype):
    for r in process_pool(WORLD).run(train_with_a_poisoned_step, dtype):
        trace = r["trace"]
        assert r["ranks_agree"] and r["params_finite"]
        assert all(t["reduced"]["facts"]["finite"] and t["stepped"]["finite"] for t in trace)
        assert not trace[1]["stepped"]["zero"]
        # the poisoned reduce: no non-finite value in any buffer, and layer b (finite gradient) kept its error
        assert trace[2]["reduced"]["b_nonzero"]
        # DeepSpeed 0.19.8 sees the overflow in bf16 too and skips the step; the hook then clears every buffer
        assert trace[2]["overflow"] and trace[2]["stepped"]["zero"]
        assert not trace[3]["overflow"] and not trace[4]["stepped"]["zero"]  # and training goes on


# ----------------------------------------------------------------------------- frozen and gradient-less parameters
def train_with_frozen_and_unused_parameters(steps=7):  # reset_T is 8
    import deepspeed_loco
    torch.manual_seed(0)
    model = Net()
    engine, _, _, _ = deepspeed_loco.initialize(model=model, model_parameters=model.parameters(), config=ds_config())
    hook = deepspeed_loco.loco_hook(engine)
    frozen_before = gathered(engine)
    x_eval, y_eval = batch(dist.get_rank(), 999)

    def eval_loss():
        with torch.no_grad():
            return float(torch.nn.functional.mse_loss(engine(x_eval), y_eval))

    losses = [eval_loss()]
    for step in range(steps):
        x, y = batch(dist.get_rank(), step)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
    losses.append(eval_loss())
    named = dict(engine.module.named_parameters())
    after = gathered(engine)
    offsets, start = {}, 0
    for n, p in named.items():
        offsets[n] = (start, start + p.ds_numel)
        start += p.ds_numel
    unchanged = {n: torch.equal(frozen_before[a:b], after[a:b]) for n, (a, b) in offsets.items()}
    return {"losses": losses, "with_buffers": sorted(hook.state.names()),
            "attribute": sorted({n for n, _, _ in hook.state.named_buffers()}),
            "unchanged": unchanged, "buffers": _facts(hook.state)}


def test_frozen_and_gradient_less_parameters_are_skipped(process_pool):
    for r in process_pool(WORLD).run(train_with_frozen_and_unused_parameters):
        assert r["with_buffers"] == r["attribute"] == ["a.bias", "a.weight", "b.bias", "b.weight"]
        assert r["buffers"]["finite"] and r["buffers"]["nonzero"]
        assert r["losses"][-1] < r["losses"][0]
        assert all(r["unchanged"][n] for n in ("frozen.weight", "frozen.bias", "unused.weight", "unused.bias"))
        assert not any(r["unchanged"][n] for n in ("a.weight", "b.weight"))
