"""benchmarks/monitor_overhead.py: its buckets, and a CPU run (tiny model, reference kernels) in a process of its own
(it starts a DeepSpeed world): every arm timed against the base of the same run, the monitor arms writing DeepSpeed's
and LoCo's events, the live rho's all-reduce of 2H + 1 sums and 3 values per sampled coordinate."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_buckets_are_consecutive_parameters_within_the_size(benchmark_module):
    buckets = benchmark_module("monitor_overhead")._buckets
    assert buckets([5, 5, 5], 10) == [(0, 2), (2, 3)]
    assert buckets([12, 3, 4], 10) == [(0, 1), (1, 3)]  # a parameter above the size is a bucket of its own
    assert buckets([1, 2, 3], 10**9) == [(0, 3)]


def test_the_table_pairs_rounds_and_gives_the_kernels_time_against_base(benchmark_module):
    table = benchmark_module("monitor_overhead").table
    arms = ["base", "ds_monitor", "monitor", "rho", "both"]
    r = {"device": "gpu", "kernels": "loco_cuda", "size": "125m", "params": 1e6, "tensors": 3, "buckets": 1,
         "micro_batch": 1, "layout": "2 x 8", "bits": "4/4", "rho_every": 10, "telemetry_every": 10, "steps": 30,
         "rounds": 2, "all_reduce_floats": 7, "ops": None, "written": [],
         "ms": {arm: [10.0, 20.0] for arm in arms}, "hook_ms": {arm: [0.0, 0.0] for arm in arms},
         "kernel_ms": {arm: 4.0 for arm in arms}}
    r["ms"]["rho"] = [10.2, 20.4]  # +2% in each round, against the base of that round
    r["kernel_ms"]["monitor"] = 4.04
    text = table(r)
    assert "| rho | 15.30 | 10.20 .. 20.40 | 1.0200 | +2.00% | +2.00% | 0.000 |" in text
    assert "| monitor | 4.040 | +1.00% |" in text and "| base | 4.000 | +0.00% |" in text


@pytest.mark.slow
def test_a_cpu_run_times_every_arm_and_the_monitor_writes_both_kinds_of_events(tmp_path):
    table = tmp_path / "table.txt"
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "benchmarks/monitor_overhead.py", "--size", "tiny", "--micro-batch", "2",
                          "--device", "cpu", "--steps", "4", "--rho-every", "2", "--telemetry-every", "2", "--rounds",
                          "2", "--nodes", "2", "--local", "2", "--table", str(table), "--count-ops", "--profile",
                          str(tmp_path / "profile.txt")], cwd=ROOT, env=env, text=True, capture_output=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    text = table.read_text()
    found = re.findall(r"^\| (\w+) \| [\d.]+ \| [\d.]+ \.\. [\d.]+ \| ([\d.]+) \| [+-][\d.]+% \| ([+-][\d.]+)% \| "
                       r"[\d.]+ \|$", text, re.M)
    rows = {arm: ratio for arm, ratio, _ in found}
    assert list(rows) == ["base", "ds_monitor", "monitor", "rho", "both"] and rows["base"] == "1.0000"
    assert found[0][2] == "+0.00"  # the base arm paired with itself, round by round
    assert "device ms per step" not in text  # no device: the profiled kernels' table is left out
    ops = dict(re.findall(r"^\| (\w+) \| (-?\d+) \| -?\d+ \|$", text, re.M))
    assert list(ops) == list(rows) and ops["base"] == "0"
    assert ops["ds_monitor"] == "2"  # DeepSpeed's engine reads the loss to the host once a step: 2 steps
    profiles = (tmp_path / "profile.txt").read_text()
    assert re.findall(r"^## (\w+): 2 steps, one measured$", profiles, re.M) == list(rows)
    from loco_lab.model import SIZES, ByteLlama
    numels = [p.numel() for p in ByteLlama(SIZES["tiny"]).parameters()]
    assert f"all-reduce (not timed): {2 * 2 + 1 + 3 * sum(min(n, 256) for n in numels)} floats" in text
    written = text.rsplit("monitor files written: ", 1)[1].strip().split(", ")
    for name in ("LoCo_error_rel_norm.csv", "LoCo_rho.csv", "LoCo_intra_node_bytes.csv",
                 "Train_Samples_train_loss.csv"):
        assert name in written, written
