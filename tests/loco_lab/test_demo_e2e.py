"""The demo end to end: on the simulated cluster (the default, 2 seeds) and through real DeepSpeed ZeRO-3 worker
processes (4 spawned gloo ranks, 2 nodes x 2); all three arms, a few steps."""
import json
import os

from loco_lab import cli
from tests.extras import needs_extra

SMALL = ["--model-size", "tiny", "--steps", "3", "--micro-batch", "2", "--eval-windows", "8", "--device", "cpu",
         "--no-progress"]


def _check_arms(results, runs_per_arm):
    assert [r["key"] for r in results] == ["full", "plain4", "loco4"] * runs_per_arm
    for full, plain, loco in zip(results[0::3], results[1::3], results[2::3]):
        assert plain["bytes_per_step"] < 0.2 * full["bytes_per_step"]  # 4-bit + scales vs fp32
        assert plain["bytes_per_step"] == loco["bytes_per_step"]
        assert plain["error_buffer_bytes"] == 0 < loco["error_buffer_bytes"]
        assert full["fidelity"]["grad_rel_error_mean"] < 1e-5 < plain["fidelity"]["grad_rel_error_mean"]
        for r in (full, plain, loco):
            assert len(r["train_losses"]) == 3 and all(l == l for l in r["train_losses"])


def test_demo_on_the_simulated_cluster(tmp_path, capsys):
    needs_extra("matplotlib", "report")  # loss_curves.png
    out = tmp_path / "demo"
    code = cli.main(["demo", *SMALL, "--seeds", "0", "1", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    for label in ("full precision", "qgZ 4-bit", "qgZ 4-bit + LoCo", "bytes/step/rank", "error buffers/rank"):
        assert label in printed
    assert "columns:" in printed and "running-sum rel. err: the same for the sums" in printed
    assert "4-bit, LoCo vs plain qgZ, validation loss over 2 seed(s)" in printed and "95% CI" in printed
    png = (out / "loss_curves.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 5000
    results = json.loads((out / "results.json").read_text())["arms"]
    _check_arms(results, runs_per_arm=2)
    for seed_runs in (results[:3], results[3:]):
        # every arm of a seed starts from the same weights and data: the same loss before the first update
        assert len({r["train_losses"][0] for r in seed_runs}) == 1
    assert results[0]["train_losses"][0] != results[3]["train_losses"][0]  # and the seeds differ


def test_demo_through_deepspeed_worker_processes(tmp_path, capsys):
    out = tmp_path / "demo"
    code = cli.main(["demo", *SMALL, "--engine", "deepspeed", "--seeds", "0", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    startup = [line for line in printed.splitlines() if line.startswith("deepspeed-loco active")]
    assert len(startup) == 2, printed  # LoCo's own start-up line, once per qgZ arm (rank 0 only)
    results = json.loads((out / "results.json").read_text())["arms"]
    _check_arms(results, runs_per_arm=1)
    assert len({r["validation"][0][1] for r in results}) == 1  # identical validation loss before training
    assert os.path.exists(out / "logs" / "rank3.log")
