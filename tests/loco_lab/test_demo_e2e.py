"""The demo end to end through the real launcher: 4 spawned gloo ranks (2 nodes x 2), all three arms, 3 steps."""
import json
import os

from loco_lab import cli


def test_demo_end_to_end(tmp_path, capsys):
    out = tmp_path / "demo"
    code = cli.main(["demo", "--model-size", "tiny", "--steps", "3", "--micro-batch", "2", "--eval-windows", "8",
                     "--device", "cpu", "--no-progress", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    for label in ("full precision", "qgZ 4-bit", "qgZ 4-bit + LoCo"):
        assert label in printed
    assert "grad bytes/step/rank" in printed and "error buffers/rank" in printed
    startup = [line for line in printed.splitlines() if line.startswith("deepspeed-loco active")]
    assert len(startup) == 2, printed  # LoCo's own start-up line, once per qgZ arm (rank 0 only)
    png = (out / "loss_curves.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 5000
    results = json.loads((out / "results.json").read_text())["arms"]
    assert [r["key"] for r in results] == ["full", "plain4", "loco4"]
    full, plain, loco = results
    assert plain["bytes_per_step"] < 0.2 * full["bytes_per_step"]  # 4-bit + scales vs fp32
    assert plain["bytes_per_step"] == loco["bytes_per_step"]
    assert plain["error_buffer_bytes"] == 0 < loco["error_buffer_bytes"]
    assert full["fidelity"]["grad_rel_error_mean"] < 1e-5 < plain["fidelity"]["grad_rel_error_mean"]
    for r in results:
        assert len(r["train_losses"]) == 3 and all(l == l for l in r["train_losses"])
    # every arm starts from the same weights and data: identical validation loss before training
    assert len({r["validation"][0][1] for r in results}) == 1
    assert os.path.exists(out / "logs" / "rank3.log")
