"""benchmarks/gpu_e2e.py on CPU (gloo, the PyTorch reference kernels): every arm through real DeepSpeed ZeRO-3
engines with the tiny model, as one process that starts its own world of 1 and as 2 torchrun processes that our
arms treat as 2 nodes of 1 (``--local-world-size 1``: the inter-node qgZ hop runs) while DeepSpeed, told one node
by ``LOCAL_SIZE``, reduce-scatters. About 25 s on 2 cores."""
import json
import os
import subprocess
import sys

import pytest
from torch.distributed.elastic.utils.distributed import get_free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "benchmarks", "gpu_e2e.py")
TINY = ["--size", "tiny", "--micro-batch", "2", "--warmup", "1", "--steps", "2", "--profile-steps", "1"]
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_SIZE")


def _run(tmp_path, launcher, extra_env, *flags):
    """Runs the benchmark under ``launcher`` (argv before the script) on CPU; returns (report, printed output)."""
    out = tmp_path / "results.json"
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=REPO, **extra_env)
    proc = subprocess.run([*launcher, SCRIPT, *TINY, *flags, "--out", str(out)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    printed = proc.stdout + proc.stderr
    assert proc.returncode == 0, printed[-4000:]
    return json.loads(out.read_text()), printed


def _check_every_arm(report, rounds=1):
    assert [r["arm"] for r in report["arms"]] == ["zero3", "dsqgz", "plain", "loco"]
    assert report["gradient_check_passed"] and report["rounds"] == rounds
    for r in report["arms"]:
        assert r["step_s"] > 0 and r["tokens_per_s"] > 0 and r["peak_memory_bytes"] > 0
        assert len(r["step_times_s"]) == 2 * rounds and all(t > 0 for t in r["step_times_s"])
        assert len(r["round_step_s"]) == rounds
        assert r["vs_zero3"]["step_s"] > 0
        if r["arm"] != "zero3":
            assert r["gradient_check"]["passed"], r["gradient_check"]
    dsqgz = report["arms"][1]
    assert dsqgz["ds_path"] == {"expected": "reduce_scatter", "ran": "reduce_scatter"}
    assert dsqgz["gradient_check"]["max_abs_diff"] == 0  # DeepSpeed's fallback is zero3's reduce-scatter
    assert dsqgz["profile"]["collectives"]["all_to_all"]["calls"] == 0
    return {r["arm"]: r for r in report["arms"]}


def test_one_process_starts_a_world_of_one_and_every_arm_is_bit_identical(tmp_path):
    report, printed = _run(tmp_path, [sys.executable], {}, "--rounds", "2")
    arms = _check_every_arm(report, rounds=2)
    # zero3's second round is checked against its first: the same first step, bit for bit
    assert arms["zero3"]["gradient_check"]["max_abs_diff"] == 0
    # every arm of both rounds started with no earlier arm's engine alive (DeepSpeed keeps them unless released)
    assert all(r["engines_alive_at_start"] == 0 for r in report["arms"])
    assert "median step of each of 2 rounds (arm order rotated each round), ms:" in printed
    assert report["environment"]["world_size"] == 1 and report["environment"]["backend"] == "gloo"
    for arm in ("plain", "loco"):
        assert arms[arm]["gradient_check"]["max_abs_diff"] == 0
        assert arms[arm]["profile"]["loco"] == {}  # one rank: the reduce has no hop, so no kernel runs
        assert arms[arm]["profile"]["gpu_busy_s"] is None  # no device kernels on the CPU
        assert arms[arm]["profile"]["host_wait_s"] is None and arms[arm]["profile"]["kernel_launches"] is None
        assert arms[arm]["profile"]["profiled_step_s"] > 0
    import deepspeed
    import torch
    assert f"world 1 (gloo), torch {torch.__version__}, DeepSpeed {deepspeed.__version__}" in printed
    assert printed.count("pass (bit-identical)") == 3


def test_two_processes_as_two_nodes_run_the_quantized_hop_within_the_bound(tmp_path):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                str(get_free_port())]
    report, printed = _run(tmp_path, launcher, {"LOCAL_SIZE": "2"}, "--local-world-size", "1")
    arms = _check_every_arm(report)
    assert report["environment"]["world_size"] == 2
    assert arms["zero3"]["profile"]["collectives"]["reduce_scatter"]["calls"] > 0
    for arm in ("plain", "loco"):
        check = arms[arm]["gradient_check"]
        assert 0 < check["max_abs_diff"] and check["max_diff_over_bound"] <= 1 and check["bits"] == [4, 4]
        assert arms[arm]["loco_kernels"] == "loco_reference"
        ranges = arms[arm]["profile"]["loco"]
        assert set(ranges) == {"inter_node.quantize_bucket_", "inter_node.all_to_all", "final_mean_bucket"}
        assert all(seconds > 0 for seconds in ranges.values())
        assert arms[arm]["profile"]["collectives"]["all_to_all"]["calls"] > 0
        assert arms[arm]["profile"]["collectives"]["reduce_scatter"]["calls"] == 0
    # LoCo's error buffers are zero at the first step: its first gradients are plain qgZ's
    assert arms["loco"]["gradient_check"]["max_abs_diff"] == arms["plain"]["gradient_check"]["max_abs_diff"]
    assert "dsqgz: DeepSpeed's rule predicts reduce_scatter, the profile shows reduce_scatter" in printed


@pytest.mark.parametrize("flags,message", [
    (["--arms", "zero3,qgz"], "--arms 'zero3,qgz' is invalid: give a comma-separated subset of zero3, dsqgz"),
    (["--bits", "4/5"], "--bits '4/5' is invalid: it must be INTRA/INTER with each of 2, 3, 4, 8"),
    (["--dim", "64", "--heads", "3"], "--dim 64 / --heads 3 is invalid"),
    (["--steps", "0"], "--steps 0 is invalid: it must be an integer >= 1"),
    (["--rounds", "0"], "--rounds 0 is invalid: it must be an integer >= 1"),
])
def test_a_bad_flag_is_an_error_naming_it(benchmark_module, capsys, flags, message):
    gpu_e2e = benchmark_module("gpu_e2e")
    with pytest.raises(SystemExit):
        gpu_e2e.parse_args(flags)
    assert message in capsys.readouterr().err


def test_named_sizes_and_overrides(benchmark_module):
    gpu_e2e = benchmark_module("gpu_e2e")
    args = gpu_e2e.parse_args(["--size", "1b", "--layers", "2", "--seq-len", "128", "--arms", "loco,zero3"])
    assert (args.model.layers, args.model.dim, args.model.heads, args.model.seq_len) == (2, 2048, 16, 128)
    assert args.arms == ["zero3", "loco"]  # zero3 first: the gradient check's reference
    assert {"125m", "350m", "1b"} <= set(gpu_e2e.CONFIGS)


def test_rounds_rotate_the_arms_and_merge_into_one_result(benchmark_module):
    gpu_e2e = benchmark_module("gpu_e2e")
    arms = ["zero3", "dsqgz", "plain", "loco"]
    assert [gpu_e2e.rotated(arms, r) for r in (0, 1, 5)] == [arms, arms[1:] + arms[:1], arms[1:] + arms[:1]]
    passed, failed = {"passed": True, "max_abs_diff": 0.0}, {"passed": False, "max_abs_diff": 1.0}
    rounds = [dict(arm="loco", step_s=2.0, step_times_s=[1.0, 3.0], tokens_per_s=50.0, peak_memory_bytes=7,
                   profile={"first": 1}, gradient_check=passed, engines_alive_at_start=0),
              dict(arm="loco", step_s=6.0, step_times_s=[5.0, 7.0], tokens_per_s=1e9, peak_memory_bytes=9,
                   profile={"second": 2}, gradient_check=failed, engines_alive_at_start=1)]
    merged = gpu_e2e.merge_rounds(rounds)
    assert merged["step_times_s"] == [1.0, 3.0, 5.0, 7.0] and merged["step_s"] == 4.0  # the median of all four
    assert merged["round_step_s"] == [2.0, 6.0] and merged["peak_memory_bytes"] == 9
    assert merged["tokens_per_s"] == 25.0  # the same tokens per step as round 0's 50 per s at 2 s: 100 / 4 s
    assert merged["profile"] == {"first": 1} and merged["gradient_check"] is failed
    assert merged["engines_alive_at_start"] == 1  # the worst round: a leak in any round shows


def test_collectives_are_grouped_by_event_name(benchmark_module):
    kind = benchmark_module("gpu_e2e").collective_kind
    assert kind("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)") == "all_to_all"
    assert kind("c10d::alltoall_base_") == "all_to_all"
    assert kind("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == "reduce_scatter"
    assert kind("c10d::_reduce_scatter_base_") == "reduce_scatter"
    assert kind("c10d::allgather_into_tensor_coalesced_") == "all_gather"
    assert kind("ncclDevKernel_AllReduce_Sum_f32_RING_LL") == "all_reduce"
    assert kind("aten::mm") is None


def test_the_profile_splits_the_host_side_of_a_cuda_step(benchmark_module):
    """Per step: the kernels' device time, the host's time in synchronizing CUDA calls, the kernel launches; the
    collectives' kernels by kind, the host-side "nccl:" records around them left out."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType
    gpu_e2e = benchmark_module("gpu_e2e")

    def event(key, device_type=DeviceType.CPU, device_us=0.0, cpu_us=0.0, count=1):
        return SimpleNamespace(key=key, device_type=device_type, self_device_time_total=device_us,
                               device_time_total=device_us, cpu_time_total=cpu_us, count=count)

    events = [event("ampere_bf16_gemm", DeviceType.CUDA, device_us=300.0, count=4),
              event("ncclDevKernel_SendRecv(x)", DeviceType.CUDA, device_us=100.0, count=2),
              event("nccl:all_to_all", cpu_us=500.0), event("cudaStreamSynchronize", cpu_us=60.0, count=2),
              event("cudaMemcpy", cpu_us=40.0), event("cudaMemcpyAsync", cpu_us=1000.0),
              event("cudaLaunchKernel", cpu_us=90.0, count=40), event("aten::mm", cpu_us=700.0, count=4)]
    profile = gpu_e2e.profile_seconds(SimpleNamespace(key_averages=lambda: events), 2, on_cuda=True)
    assert profile["gpu_busy_s"] == pytest.approx(200e-6)  # (300 + 100) us over 2 steps
    assert profile["host_wait_s"] == pytest.approx(50e-6)  # (60 + 40) us: the asynchronous copy does not wait
    assert profile["kernel_launches"] == 20
    assert profile["collectives"]["all_to_all"] == {"s": pytest.approx(50e-6), "calls": 2}


def test_the_report_holds_the_rounds_every_arm_finished(benchmark_module, monkeypatch):
    """What is saved after each round (so that a timeout keeps it): only rounds that every arm finished."""
    gpu_e2e = benchmark_module("gpu_e2e")
    monkeypatch.setattr(gpu_e2e, "environment", lambda device: {"world_size": 1})
    args = gpu_e2e.parse_args(["--size", "tiny", "--rounds", "3", "--arms", "zero3,loco"])

    def result(arm, step_s):
        return dict(arm=arm, step_s=step_s, step_times_s=[step_s], tokens_per_s=10 / step_s, peak_memory_bytes=1,
                    profile={}, parameters=123, gradient_check={"passed": True}, engines_alive_at_start=0)

    per_arm = {"zero3": [result("zero3", 1.0), result("zero3", 3.0)], "loco": [result("loco", 2.0)]}
    report = gpu_e2e.build_report(args, None, per_arm)
    assert (report["rounds"], report["rounds_asked"]) == (1, 3)
    assert [r["round_step_s"] for r in report["arms"]] == [[1.0], [2.0]]  # zero3's unmatched second round left out
    assert report["arms"][1]["vs_zero3"]["step_s"] == 2.0 and report["model"]["parameters"] == 123
