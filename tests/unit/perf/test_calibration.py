"""The single-GPU calibration: an exact line is recovered, leave-one-out predicts a held-out micro-batch, bad
inputs are clear errors, and predict uses the calibrated terms."""
import json

import pytest

from deepspeed_loco.perf.calibration import Point, fit, leave_one_out, load_e2e_points
from deepspeed_loco.perf.cli import main
from deepspeed_loco.perf.model import Workload

MODEL = {"parameters": 116_430_720, "layers": 12, "dim": 896, "heads": 14, "seq_len": 256}
ENGINE_S, TFLOPS = 0.12, 150.0


def _e2e(tmp_path, micro_batch, world=1):
    """A gpu_e2e.py --out JSON whose arms lie exactly on ENGINE_S + flops / TFLOPS."""
    flops = Workload(MODEL["parameters"], 12, 896, 256, micro_batch * 256).flops_per_gpu()
    step = ENGINE_S + flops / (TFLOPS * 1e12)
    data = {"environment": {"world_size": world}, "model": MODEL, "micro_batch": micro_batch,
            "arms": [{"arm": arm, "step_s": step} for arm in ("zero3", "loco")]}
    path = tmp_path / f"results_{micro_batch}_{world}.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_an_exact_line_is_recovered_and_predicts_a_held_out_micro_batch(tmp_path):
    points = load_e2e_points([_e2e(tmp_path, mb) for mb in (4, 8, 16)])
    calibration = fit(points)
    assert calibration.engine_s == pytest.approx(ENGINE_S) and calibration.tflops == pytest.approx(TFLOPS)
    assert calibration.points == 6
    rows = leave_one_out(points)
    assert len(rows) == 6 and all(abs(row["error"]) < 1e-9 for row in rows)


def test_one_size_or_a_line_that_falls_is_not_a_calibration():
    with pytest.raises(ValueError, match="at least two sizes"):
        fit([Point("zero3", 8, 1e12, 0.2, "a"), Point("loco", 8, 1e12, 0.21, "a")])
    with pytest.raises(ValueError, match="not physical"):
        fit([Point("zero3", 8, 1e12, 0.2, "a"), Point("zero3", 16, 2e12, 0.1, "b")])


def test_a_multi_rank_run_or_another_json_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="world size 1"):
        load_e2e_points([_e2e(tmp_path, 8, world=8)])
    other = tmp_path / "other.json"
    other.write_text("{}")
    with pytest.raises(ValueError, match="not the JSON of benchmarks/gpu_e2e.py"):
        load_e2e_points([str(other)])


def test_calibrate_writes_what_predict_uses(tmp_path, capsys):
    out = tmp_path / "calibration.json"
    main(["calibrate", *(_e2e(tmp_path, mb) for mb in (4, 8, 16)), "--out", str(out)])
    assert "leave one out" in capsys.readouterr().out
    main(["predict", "--params", str(MODEL["parameters"]), "--layers", "12", "--hidden", "896", "--seq", "256",
          "--tokens-per-gpu", str(8 * 256), "--gpus", "1", "--gpus-per-node", "1", "--gpu", "h200", "--intra-gbps",
          "3600", "--inter-gbps", "400", "--method", "loco4", "--calibration", str(out)])
    predicted = json.loads(capsys.readouterr().out)
    flops = Workload(MODEL["parameters"], 12, 896, 256, 8 * 256).flops_per_gpu()
    assert predicted["step_s"] == pytest.approx(ENGINE_S + flops / (TFLOPS * 1e12))  # one GPU: no kernels run
    assert predicted["kernel_s"] == 0 and predicted["engine_s"] == pytest.approx(ENGINE_S)
