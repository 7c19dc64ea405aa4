"""LoCo inside a real DeepSpeed ZeRO-3 engine: 4 gloo processes laid out as 2 nodes x 2 ranks."""
import json
import os
import subprocess
import sys

import pytest
import torch
from torch.distributed.elastic.utils.distributed import get_free_port

from deepspeed_loco.config import LocoConfig, LocoConfigError
from deepspeed_loco.layout import plan_hops

WORLD = 4
STEPS = 24
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))


def _ds_config(arm, dtype="fp32", accum=1, loco=None):
    zero = {"stage": 3, "reduce_bucket_size": 10_000}
    if arm != "full":
        zero["zero_quantized_gradients"] = True
        zero["zeropp_loco_param"] = {"group_size": 32, "error_feedback": arm == "loco", **(loco or {})}
    cfg = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": accum,
        # torch's Adam: DeepSpeed's CPU FusedAdam is a C++ op JIT-built on first use (minutes on a fresh machine)
        "optimizer": {"type": "Adam", "params": {"lr": 5e-3, "torch_adam": True}},
        "zero_optimization": zero,
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 4, "loss_scale_window": 2, "hysteresis": 1}
    return cfg


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(13, 33), torch.nn.Tanh(), torch.nn.Linear(33, 5))


def _batch(rank, step, dtype):
    gen = torch.Generator().manual_seed(10_000 * step + rank)
    teacher = torch.Generator().manual_seed(123)
    x = torch.randn(8, 13, generator=gen)
    y = torch.tanh(x @ torch.randn(13, 5, generator=teacher))
    cast = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    return x.to(cast), y.to(cast)


def _allow_fp16_on_cpu():
    """DeepSpeed's CPU accelerator refuses fp16 where oneDNN lacks fp16 kernels; torch's CPU fp16 math suffices
    for this tiny model, so the capability check is lifted in the test processes only."""
    from deepspeed.accelerator import get_accelerator
    accelerator = get_accelerator()
    accelerator.is_fp16_supported = lambda: True


def _gathered_params(engine):
    import deepspeed
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return torch.cat([p.detach().float().reshape(-1) for p in params])


def _buffers_state(hook):
    values = [b.dequantize() for b in hook.state.buffers()]
    if not values:
        return {"zero": True, "finite": True, "absmax": 0.0}
    return {
        "zero": all(not v.any() for v in values),
        "finite": all(bool(torch.isfinite(v).all()) for v in values),
        "absmax": max(float(v.abs().max()) for v in values),
    }


def train(arm, dtype="fp32", accum=1, steps=STEPS, loco=None, poison_step=None):
    """Trains the tiny model; returns losses, the final parameters and what the LoCo hook saw at each step."""
    import deepspeed_loco
    if dtype == "fp16":
        _allow_fp16_on_cpu()
    model = _model()
    engine, _, _, _ = deepspeed_loco.initialize(model=model, model_parameters=model.parameters(),
                                                config=_ds_config(arm, dtype, accum, loco))
    hook = deepspeed_loco.loco_hook(engine)
    rank = torch.distributed.get_rank()
    losses, trace = [], []
    for step in range(steps):
        for micro in range(accum):
            x, y = _batch(rank, step * accum + micro, dtype)
            loss = torch.nn.functional.mse_loss(engine(x).float(), y.float())
            if step == poison_step:
                loss = loss * float("inf")
            engine.backward(loss)
            before = _buffers_state(hook) if hook else None
            scale_before = engine.optimizer.loss_scale
            engine.step()
        losses.append(float(loss))
        if hook:
            trace.append({"before": before, "after": _buffers_state(hook), "step": hook.state.step,
                          "scale": (scale_before, engine.optimizer.loss_scale), "overflow": engine.optimizer.overflow})
    params = _gathered_params(engine)
    everyone = [torch.empty_like(params) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(everyone, params)
    spread = max(float((p - params).abs().max()) for p in everyone)
    return {"losses": losses, "params": params, "rank_spread": spread, "trace": trace,
            "stats": hook.reducer.stats if hook else None,
            "startup": hook.describe([p for p in engine.module.parameters() if p.requires_grad]) if hook else None}


@pytest.fixture(scope="module")
def arms(process_pool):
    pool = process_pool(WORLD)
    return {arm: pool.run(train, arm) for arm in ("full", "plain", "loco")}


def test_every_arm_keeps_ranks_identical(arms):
    for arm, results in arms.items():
        assert all(r["rank_spread"] == 0.0 for r in results), arm


def test_loco_trains_like_full_precision(arms):
    full, loco = arms["full"][0], arms["loco"][0]
    assert full["losses"][-1] < 0.5 * full["losses"][0]  # the task is learnable in STEPS steps
    # stated tolerance: over the last 8 steps LoCo's mean loss is within 10% of full precision's
    tail = lambda r: sum(r["losses"][-8:]) / 8
    assert abs(tail(loco) - tail(full)) <= 0.10 * tail(full)
    drift = float((loco["params"] - full["params"]).norm() / full["params"].norm())
    assert drift < 0.05


def test_quantized_arms_send_quantized_bytes_through_both_hops(arms):
    for arm in ("plain", "loco"):
        stats = arms[arm][0]["stats"]
        assert stats.reduces >= STEPS and stats.bytes["intra_node"] > 0 and stats.bytes["inter_node"] > 0


def test_start_up_line_and_telemetry_report_the_wire_bytes_per_element_of_each_hop(arms):
    # 4-bit values and one fp32 scale per group of 32 on both hops: 0.5 + 4/32 bytes per element
    for arm in ("plain", "loco"):
        result = arms[arm][0]
        assert "; W=4 (M=2 nodes x L=2 ranks); bits intra/inter 4/4, group 32, grid symmetric (auto), hadamard off; wire per element: " \
               "intra-node 0.625 B (4-bit + fp32 scale/32), inter-node 0.625 B (4-bit + fp32 scale/32); " \
               in result["startup"]
        assert result["stats"].bytes_per_element("intra_node") == result["stats"].bytes_per_element("inter_node") == 0.625
    # the buffers' ErrorStorage.label, and none of it where error feedback is off
    assert "B per parameter element, int8) on this rank" in arms["loco"][0]["startup"]
    assert "err_beta" not in arms["plain"][0]["startup"] and "error buffers" not in arms["plain"][0]["startup"]


@pytest.mark.parametrize("nodes,local,expected", [
    (1, 4, "intra-node 1.125 B (8-bit + fp32 scale/32), inter-node n/a"),
    (4, 1, "intra-node n/a, inter-node 0.375 B (2-bit + fp32 scale/32)"),
])
def test_start_up_line_says_n_a_for_a_hop_the_layout_does_not_have(nodes, local, expected):
    from deepspeed_loco.runtime.zero.stage3_hook import describe_wire
    config = LocoConfig(group_size=32, intra_node_bits=8, inter_node_bits=2)
    assert describe_wire(plan_hops(nodes * local, local, config)) == f"wire per element: {expected}"


# (nodes, ranks per node, error_feedback, the mode and layout the line opens with, whether err_beta/buffers show)
ACTIVE_LINES = [
    (2, 2, True, "LoCo error feedback; W=4 (M=2 nodes x L=2 ranks); bits intra/inter 4/4,", True),
    (2, 2, False, "plain qgZ (error feedback off); W=4 (M=2 nodes x L=2 ranks); bits intra/inter 4/4,", False),
    (2, 2, "inter_node", "LoCo error feedback on the inter-node hop only; W=4 (M=2 nodes x L=2 ranks);", True),
    (1, 4, True, "LoCo error feedback; W=4 (M=1 node x L=4 ranks); bits intra 4,", True),
    (1, 4, "inter_node", "plain qgZ (error_feedback \"inter_node\" keeps error on the inter-node hop only, and one "
     "node has none: error feedback off); W=4 (M=1 node x L=4 ranks); bits intra 4,", False),
    (4, 1, False, "plain qgZ (error feedback off); W=4 (M=4 nodes x L=1 rank); bits inter 4,", False),
]


@pytest.mark.parametrize("nodes,local,error_feedback,opening,with_error", ACTIVE_LINES)
def test_start_up_line_says_only_what_acts(nodes, local, error_feedback, opening, with_error):
    from deepspeed_loco.runtime.comm.error_feedback import ErrorFeedbackState
    from deepspeed_loco.runtime.comm.topology import LocoTopology
    from deepspeed_loco.runtime.zero.stage3_hook import describe_active, planned_buffer_bytes

    config = LocoConfig(group_size=32, error_feedback=error_feedback)
    state = ErrorFeedbackState(config, plan_hops(nodes * local, local, config))
    params = [torch.zeros(1000), torch.zeros(24)]
    line = describe_active(LocoTopology(nodes * local, local, 0), config, state, params)
    assert line.startswith(f"deepspeed-loco active: {opening}"), line
    assert ("err_beta 0.8, reset_T 1024; error buffers" in line) == with_error, line
    assert (planned_buffer_bytes(state, params) > 0) == with_error  # the line and the state agree on the buffers
    assert line.endswith("; live rho every 10 steps")


def test_start_up_line_names_an_exact_own_block_and_its_smaller_buffers():
    from deepspeed_loco.runtime.comm.error_feedback import ErrorFeedbackState
    from deepspeed_loco.runtime.comm.topology import LocoTopology
    from deepspeed_loco.runtime.zero.stage3_hook import describe_active

    params = [torch.zeros(1000), torch.zeros(24)]
    lines = {}
    for exact in (False, True):
        config = LocoConfig(group_size=32, exact_own_block=exact)
        state = ErrorFeedbackState(config, plan_hops(4, 2, config))
        lines[exact] = describe_active(LocoTopology(4, 2, 0), config, state, params)
    assert "hadamard off; wire" in lines[False] and "own blocks" not in lines[False]
    assert "hadamard off, own blocks exact; wire" in lines[True]
    rate = {exact: float(line.split(" MiB (")[1].split(" B per")[0]) for exact, line in lines.items()}
    assert 0 < rate[True] < rate[False]


def test_plain_arm_holds_no_error_buffers_and_loco_does(arms):
    assert all(t["after"]["absmax"] == 0.0 for t in arms["plain"][0]["trace"])
    assert any(t["after"]["absmax"] > 0.0 for t in arms["loco"][0]["trace"])


def test_reset_happens_every_reset_T_optimizer_steps(process_pool):
    result = process_pool(WORLD).run(train, "loco", "fp32", 1, 7, {"reset_T": 3})[0]
    zero_after = [t["after"]["zero"] for t in result["trace"]]
    assert [t["step"] for t in result["trace"]] == list(range(1, 8))
    assert zero_after == [False, False, True, False, False, True, False]


def test_gradient_accumulation_counts_optimizer_steps_not_micro_steps(process_pool):
    result = process_pool(WORLD).run(train, "loco", "fp32", 2, 6, {"reset_T": 2})[0]
    assert [t["step"] for t in result["trace"]] == list(range(1, 7))
    assert [t["after"]["zero"] for t in result["trace"]] == [False, True] * 3
    assert result["stats"].reduces >= 12  # ZeRO-3 reduces every micro-step
    assert result["losses"][-1] < result["losses"][0]


def test_bf16_trains_and_ranks_agree(process_pool):
    results = process_pool(WORLD).run(train, "loco", "bf16", 1, 12)
    assert all(r["rank_spread"] == 0.0 for r in results)
    assert results[0]["losses"][-1] < results[0]["losses"][0]


def test_fp16_loss_scale_changes_rescale_and_overflow_clears_the_buffers(process_pool):
    results = process_pool(WORLD).run(train, "loco", "fp16", 1, 10, None, 6)
    trace = results[0]["trace"]
    assert all(r["rank_spread"] == 0.0 for r in results)
    assert trace[6]["overflow"] and trace[6]["after"]["zero"]
    assert all(t["after"]["finite"] for t in trace)
    grown = [t for t in trace if not t["overflow"] and t["scale"][1] != t["scale"][0] and not t["after"]["zero"]]
    assert grown, "the test must see at least one loss-scale growth"
    for t in grown:
        ratio = t["scale"][1] / t["scale"][0]
        assert t["after"]["absmax"] == pytest.approx(t["before"]["absmax"] * ratio, rel=1e-6)


def initialize_with(zero_update):
    import deepspeed_loco
    cfg = _ds_config("loco")
    cfg["zero_optimization"].update(zero_update)
    model = _model()
    try:
        deepspeed_loco.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    except LocoConfigError as err:
        return str(err)
    return None


@pytest.mark.parametrize("update,expected", [
    ({"stage": 2}, "needs ZeRO stage 3"),
    ({"zero_quantized_gradients": False}, "set \"zero_quantized_gradients\": true"),
    ({"zeropp_loco_param": {"err_beta": 2}}, "zeropp_loco_param.err_beta = 2"),
    ({"zeropp_loco_param": {"reset_t": 5}}, "unknown key(s) ['reset_t']"),
    ({"zero_hpz_partition_size": 3}, "zero_hpz_partition_size = 3 does not divide the world size 4"),
    ({"zero_hpz_partition_size": 4}, "zero_hpz_partition_size = 4 does not fit the node layout (M=2 nodes x L=2"),
])
def test_config_errors_are_clear_on_every_rank(process_pool, update, expected):
    messages = process_pool(WORLD).run(initialize_with, update)
    assert all(m is not None and expected in m for m in messages)


def test_old_deepspeed_is_refused_at_start_up(monkeypatch):
    import deepspeed

    from deepspeed_loco.runtime.zero import deepspeed_seam
    monkeypatch.setattr(deepspeed, "__version__", "0.19.7")
    with pytest.raises(RuntimeError, match="needs DeepSpeed >= 0.19.8"):
        deepspeed_seam.check_deepspeed_version()


@pytest.mark.slow
def test_unmodified_script_runs_with_loco_through_the_module_runner(tmp_path):
    """``torchrun ... -m deepspeed_loco.run unmodified_train.py --deepspeed_config cfg.json``, 2 nodes x 2."""
    cfg = _ds_config("loco", loco={"local_world_size": 2})
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    # as in the process pool, skip DeepSpeed's unused CPU shared-memory op (a JIT C++ build of minutes on a fresh
    # machine): a sitecustomize in the test's own directory, so the training script itself stays unmodified
    (tmp_path / "sitecustomize.py").write_text(
        "import deepspeed.ops\ndeepspeed.ops.__compatible_ops__['deepspeed_shm_comm'] = False\n")
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", LOCAL_SIZE="4",
               PYTHONPATH=os.pathsep.join([str(tmp_path), REPO]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port",
           str(get_free_port()),
           "-m", "deepspeed_loco.run", os.path.join(REPO, "tests", "unit", "runtime", "zero", "unmodified_train.py"),
           "--deepspeed_config", str(tmp_path / "ds.json"), "--steps", "3"]
    # generous: on a fresh machine DeepSpeed first JIT-builds its CPU shared-memory op here (cached afterwards)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    startup = [line for line in (proc.stdout + proc.stderr).splitlines() if "deepspeed-loco active" in line]
    assert len(startup) == 1, proc.stdout[-3000:] + proc.stderr[-3000:]  # rank 0 only, printed once by default
    assert "deepspeed-loco active: LoCo error feedback; W=4 (M=2 nodes x L=2 ranks)" in startup[0]
    assert "hadamard off; wire per element: intra-node 0.625 B (4-bit + fp32 scale/32), inter-node 0.625 B" \
        in startup[0]
    notes = [line for line in (proc.stdout + proc.stderr).splitlines() if "in the measurements (" in line]
    assert len(notes) == 1 and "LoCo error feedback at 4/4 bits" in notes[0]  # rank 0's note after the line
    assert "final loss" in proc.stdout
