"""The CLI in-process: predict prints one JSON object with the required keys, without overlap unless asked."""
import json

import pytest

from deepspeed_loco.perf.cli import main

ARGS = ["predict", "--params", "18e9", "--layers", "40", "--hidden", "6144", "--seq", "2048", "--tokens-per-gpu",
        "2048", "--gpus", "384", "--gpus-per-node", "16", "--gpu", "v100", "--intra-gbps", "2400", "--inter-gbps",
        "100"]


@pytest.mark.parametrize("method", ["zero3", "zeropp", "plain4", "loco4", "loco8-2h"])
@pytest.mark.parametrize("overlap", ["--overlap", "--no-overlap", None])
def test_predict_prints_json_with_required_keys(capsys, method, overlap):
    main(ARGS + ["--method", method] + ([overlap] if overlap else []))
    out = json.loads(capsys.readouterr().out)
    for key in ("step_s", "tokens_per_s", "tflops_per_gpu", "forward_all_gather_s", "backward_all_gather_s"):
        assert out[key] > 0
    assert out["overlap"] is (overlap == "--overlap")
    assert ("reduce_scatter_s" in out) is (method == "zero3")
    assert ("inter_all_to_all_s" in out) is (method != "zero3")


def test_predict_rejects_bad_gpu_count(capsys):
    with pytest.raises(SystemExit):
        main(ARGS + ["--gpus", "20", "--method", "zero3"])  # the last --gpus wins
    assert "--gpus (20) must be a multiple of --gpus-per-node (16)" in capsys.readouterr().err


def test_predict_rejects_a_json_that_is_not_kernels_output(capsys, tmp_path):
    path = tmp_path / "other.json"
    path.write_text('{"rows": [{"kernel": "x"}]}')
    with pytest.raises(SystemExit):
        main(ARGS + ["--method", "loco4", "--kernels", str(path)])
    assert "--kernels: " in capsys.readouterr().err


def test_predict_adds_the_per_parameter_gpu_time_of_this_gpus_partition(tmp_path, capsys):
    out = tmp_path / "calibration.json"
    out.write_text(json.dumps({"engine_s": 0.0, "points": 0, "gpu_flops": 300e12, "gpu_points": 3,
                               "gpu_fixed_s_per_param": 60e-12}))
    flags = ["predict", "--params", "8e9", "--layers", "32", "--hidden", "4096", "--seq", "2048",
             "--tokens-per-gpu", "4096", "--gpus-per-node", "1", "--gpu", "h200", "--intra-gbps", "3600",
             "--inter-gbps", "400", "--method", "zero3", "--calibration", str(out)]
    for gpus in (1, 4):
        main(flags + ["--gpus", str(gpus)])
        predicted = json.loads(capsys.readouterr().out)
        assert predicted["gpu_fixed_s"] == pytest.approx(60e-12 * 8e9 / gpus)
        assert predicted["step_s"] >= predicted["compute_s"] + predicted["gpu_fixed_s"]
    assert predicted["step_s"] == pytest.approx(predicted["compute_s"] + predicted["gpu_fixed_s"]
                                                + predicted["exposed_s"])


@pytest.mark.parametrize("feedback,bits", [("true", 8), ("inter_node", 4)])
def test_predict_reports_loco_error_state_per_gpu_for_loco_methods_only(capsys, feedback, bits):
    from deepspeed_loco.config import LocoConfig
    from deepspeed_loco.runtime.comm.error_feedback import error_bytes_per_parameter
    main(ARGS + ["--method", "loco4", "--error-feedback", feedback, "--error-bits", str(bits)])
    out = json.loads(capsys.readouterr().out)
    config = LocoConfig(error_feedback=True if feedback == "true" else feedback, error_bits=bits)
    assert out["error_state_bytes_per_gpu"] == pytest.approx(18e9 * error_bytes_per_parameter(384, 16, config))
    main(ARGS + ["--method", "plain4"])
    assert "error_state_bytes_per_gpu" not in json.loads(capsys.readouterr().out)
