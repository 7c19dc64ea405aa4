"""The single-GPU calibration (``benchmarks/calibrate.py``): host-bound steps set the engine time, compute-bound ones
do not, leave-one-out predicts a held-out micro-batch, bad inputs are clear errors, and predict uses the calibrated
engine time."""
import json

import pytest

from deepspeed_loco.perf.cli import main
from deepspeed_loco.perf.model import GPUS, Workload

MODEL = {"parameters": 116_430_720, "layers": 12, "dim": 896, "heads": 14, "seq_len": 256}
RATE = GPUS["h200"].sustained_flops


@pytest.fixture(scope="module")
def cal(benchmark_module):
    return benchmark_module("calibrate")


def _e2e(tmp_path, micro_batch, steps=(0.15, 0.15), world=1, gpu_busy=None):
    """A gpu_e2e.py --out JSON with arms zero3 and loco at ``steps`` seconds (profiled: GPU busy ``gpu_busy`` s)."""
    profile = {"profile": {"gpu_busy_s": gpu_busy}} if gpu_busy is not None else {}
    data = {"environment": {"world_size": world}, "model": MODEL, "micro_batch": micro_batch,
            "arms": [{"arm": arm, "step_s": step, **profile} for arm, step in zip(("zero3", "loco"), steps)]}
    path = tmp_path / f"results_{micro_batch}_{world}.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_the_engine_time_is_the_mean_of_host_bound_steps_and_predicts_a_held_out_one(cal, tmp_path):
    points = cal.load_e2e_points([_e2e(tmp_path, mb, (0.14, 0.16)) for mb in (4, 8, 16)])
    calibration = cal.fit(points, RATE)
    assert calibration.engine_s == pytest.approx(0.15) and calibration.points == 6
    assert calibration.spread == pytest.approx(0.01 / 0.15 * (6 / 5)**0.5)
    rows = cal.leave_one_out(points, RATE)
    assert [round(r["error"], 6) for r in rows] == [round(0.15 / s - 1, 6) for s in (0.14, 0.16) * 3]


def test_a_run_of_several_rounds_reports_how_far_its_rounds_moved(cal, tmp_path):
    path = tmp_path / "rounds.json"
    path.write_text(json.dumps({"environment": {"world_size": 1}, "model": MODEL, "micro_batch": 16, "arms": [
        {"arm": "zero3", "step_s": 0.15, "round_step_s": [0.12, 0.15, 0.18]}, {"arm": "loco", "step_s": 0.15}]}))
    zero3, loco = cal.load_e2e_points([str(path)])
    assert zero3.round_spread == pytest.approx(0.06 / 0.15) and loco.round_spread is None
    assert [row["round_spread"] for row in cal.leave_one_out([zero3, loco], RATE)] == [zero3.round_spread, None]


def test_compute_bound_steps_leave_no_engine_time(cal):
    flops = 10 * RATE  # ten seconds of compute, measured as ten: the GPU set the pace
    assert cal.fit([cal.Point("zero3", 8, flops, 10.0, "a")], RATE).engine_s == 0.0
    with pytest.raises(ValueError, match="at least one measured step"):
        cal.fit([], RATE)


def _flops(micro_batch):
    return Workload(MODEL["parameters"], 12, 896, 256, micro_batch * 256).flops_per_gpu()


def test_profiled_compute_bound_steps_set_the_gpu_rate_and_predict_a_held_out_micro_batch(cal, tmp_path):
    """The GPU at 100 TFLOPS while busy (busy 95% of each step): no host-bound point, and each micro-batch is
    predicted from the others' rate as its GPU time, 5% short of the measured step."""
    rate = 100e12
    paths = [_e2e(tmp_path, mb, (_flops(mb) / rate / 0.95,) * 2, gpu_busy=_flops(mb) / rate) for mb in (64, 128, 256)]
    points = cal.load_e2e_points(paths)
    calibration = cal.fit(points, RATE)
    assert calibration.engine_s == 0 and calibration.gpu_points == 6
    assert calibration.gpu_flops == pytest.approx(rate)
    assert [row["error"] for row in cal.leave_one_out(points, RATE)] == pytest.approx([-0.05] * 6)


def test_a_step_whose_gpu_idles_is_host_bound_whatever_the_table_rate(cal, tmp_path):
    """Profiled at 20 ms of GPU work in a 150 ms step: host-bound, though the table's rate would call it 1.9 ms."""
    (point, _) = cal.load_e2e_points([_e2e(tmp_path, 4, gpu_busy=0.02)])
    assert point.gpu_s(RATE) == 0.02 and point.gpu_busy_s == 0.02
    calibration = cal.fit([point], RATE)
    assert calibration.engine_s == pytest.approx(0.15) and calibration.gpu_flops == pytest.approx(_flops(4) / 0.02)


def test_a_multi_rank_run_or_another_json_is_rejected(cal, tmp_path):
    with pytest.raises(ValueError, match="world size 1"):
        cal.load_e2e_points([_e2e(tmp_path, 8, world=8)])
    other = tmp_path / "other.json"
    other.write_text("{}")
    with pytest.raises(ValueError, match="not the JSON of benchmarks/gpu_e2e.py"):
        cal.load_e2e_points([str(other)])


def test_calibrate_writes_what_predict_uses(cal, tmp_path, capsys):
    out = tmp_path / "calibration.json"
    cal.main([*(_e2e(tmp_path, mb) for mb in (4, 8)), "--out", str(out)])
    assert "leave one out" in capsys.readouterr().out
    main(["predict", "--params", str(MODEL["parameters"]), "--layers", "12", "--hidden", "896", "--seq", "256",
          "--tokens-per-gpu", str(8 * 256), "--gpus", "1", "--gpus-per-node", "1", "--gpu", "h200", "--intra-gbps",
          "3600", "--inter-gbps", "400", "--method", "loco4", "--calibration", str(out)])
    predicted = json.loads(capsys.readouterr().out)
    flops = Workload(MODEL["parameters"], 12, 896, 256, 8 * 256).flops_per_gpu()
    assert flops / RATE < 0.15 and predicted["step_s"] == pytest.approx(0.15)  # host-bound; one GPU: no kernels
    assert predicted["kernel_s"] == 0 and predicted["engine_s"] == pytest.approx(0.15)


def test_predict_takes_the_calibrated_gpu_rate_unless_tflops_is_given(cal, tmp_path, capsys):
    out = tmp_path / "calibration.json"
    cal.main([_e2e(tmp_path, 512, (3.0, 3.0), gpu_busy=_flops(512) / 50e12), "--out", str(out)])
    capsys.readouterr()
    flags = ["predict", "--params", str(MODEL["parameters"]), "--layers", "12", "--hidden", "896", "--seq", "256",
             "--tokens-per-gpu", str(512 * 256), "--gpus", "1", "--gpus-per-node", "1", "--gpu", "h200",
             "--intra-gbps", "3600", "--inter-gbps", "400", "--method", "zero3", "--calibration", str(out)]
    main(flags)
    assert json.loads(capsys.readouterr().out)["compute_s"] == pytest.approx(_flops(512) / 50e12)
    main(flags + ["--tflops", "200"])
    assert json.loads(capsys.readouterr().out)["compute_s"] == pytest.approx(_flops(512) / 200e12)


def test_gpu_time_that_does_not_grow_with_the_tokens_is_fitted_per_parameter_and_predicts_held_out_steps(
        cal, tmp_path):
    """GPU busy = 60 ps per parameter + FLOPs at 300 TFLOPS (the shape measured on the H200 for the 1b model), each
    step 2% longer than its GPU time: the fit recovers both terms, and each held-out micro-batch's GPU time exactly."""
    rate, fixed = 300e12, 60e-12
    busy = {mb: fixed * MODEL["parameters"] + _flops(mb) / rate for mb in (64, 128, 256)}
    points = cal.load_e2e_points([_e2e(tmp_path, mb, (busy[mb] * 1.02,) * 2, gpu_busy=busy[mb]) for mb in busy])
    calibration = cal.fit(points, RATE)
    assert calibration.gpu_flops == pytest.approx(rate) and calibration.gpu_fixed_s_per_param == pytest.approx(fixed)
    assert calibration.engine_s == 0 and calibration.gpu_points == 6
    rows = cal.leave_one_out(points, RATE)
    assert [row["predicted_gpu_s"] for row in rows] == pytest.approx([busy[mb] for mb in (64, 64, 128, 128, 256, 256)])
    assert [row["error"] for row in rows] == pytest.approx([1 / 1.02 - 1] * 6)


def test_a_fit_without_a_positive_fixed_term_keeps_the_median_rate(cal, tmp_path):
    """GPU time growing faster than the FLOPs (a negative intercept) is not a per-parameter cost: no fixed term, and
    the rate is the median of FLOPs over busy seconds; one micro-batch alone cannot separate the terms either."""
    busy = {mb: _flops(mb) / 100e12 * (1 + mb / 1024) for mb in (64, 128, 256)}
    points = cal.load_e2e_points([_e2e(tmp_path, mb, (1.0, 1.0), gpu_busy=busy[mb]) for mb in busy])
    calibration = cal.fit(points, RATE)
    assert calibration.gpu_fixed_s_per_param == 0
    assert calibration.gpu_flops == pytest.approx(_flops(128) / busy[128])
    single = cal.fit(points[:2], RATE)
    assert single.gpu_fixed_s_per_param == 0 and single.gpu_flops == pytest.approx(_flops(64) / busy[64])

