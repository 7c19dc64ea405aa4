"""``python -m loco_lab.cli advise`` end to end on the tiny bundled model (steps capped below a comparison's 50, so the
probe only, and a budget that cannot pay for the probe)."""
import json

from loco_lab import cli
from tests.extras import needs_extra


def test_advise_writes_its_evidence_and_a_valid_block(tmp_path, capsys):
    needs_extra("matplotlib", "report")  # advise.png
    from deepspeed_loco.config import LocoConfig
    out = tmp_path / "advise"
    code = cli.main(["advise", "--nodes", "2", "--gpus-per-node", "2", "--budget-minutes", "1", "--probe-steps", "5",
                     "--max-steps", "40",
                     "--model-size", "tiny", "--micro-batch", "2", "--device", "cpu", "--no-progress", "--out",
                     str(out)])
    assert code == 0
    advice = json.loads((out / "advise.json").read_text())
    LocoConfig.from_dict(advice["config"])
    assert "local_world_size" not in advice["config"]  # the launcher's ranks per node, whatever the job
    assert [p["candidate"] for p in advice["probes"]] == ["plain2", "plain8-2h", "plain4"]
    assert advice["comparisons"] == [] and advice["unresolved"]  # 40 < 50 steps buy no comparison, and it says so
    assert advice["recommended"] in capsys.readouterr().out
    assert (out / "advise.png").stat().st_size > 0 and "| 2-bit |" in (out / "table.md").read_text()


def test_advise_runs_its_probes_side_by_side_in_spawned_processes(tmp_path, capsys):
    out = tmp_path / "advise"
    code = cli.main(["advise", "--nodes", "1", "--gpus-per-node", "2", "--budget-minutes", "1", "--probe-steps", "3",
                     "--max-steps", "40",
                     "--model-size", "tiny", "--micro-batch", "1", "--device", "cpu", "--no-progress", "--parallel",
                     "3", "--out", str(out)])
    assert code == 0
    advice = json.loads((out / "advise.json").read_text())
    assert advice["parallel"] == 3 and all(p["step_error"] > 0 for p in advice["probes"])
    assert "3 runs at a time" in capsys.readouterr().out


def test_a_budget_below_the_probe_is_refused_and_nothing_is_written(tmp_path, capsys):
    out = tmp_path / "advise"
    code = cli.main(["advise", "--nodes", "2", "--gpus-per-node", "2", "--budget-minutes", "0.001", "--model-size",
                     "tiny", "--device", "cpu", "--no-progress", "--out", str(out)])
    assert code == 2 and "budget_minutes = 0.001 is too small" in capsys.readouterr().err and not out.exists()


def test_parallel_must_be_auto_or_a_positive_integer(capsys):
    import pytest
    with pytest.raises(SystemExit) as exit_:
        cli.main(["advise", "--parallel", "0"])
    assert exit_.value.code == 2 and "'auto' or an integer >= 1" in capsys.readouterr().err


def test_a_bad_number_or_text_is_one_line_and_exit_code_2(tmp_path, capsys):
    for flags, said in ((["--budget-minutes", "-1"], "budget_minutes = -1.0 is invalid"),
                        (["--text", str(tmp_path / "missing.txt")], "missing.txt"),
                        (["--seeds", "1"], "seeds = 1 is invalid")):
        code = cli.main(["advise", "--nodes", "2", "--gpus-per-node", "2", "--model-size", "tiny", "--device", "cpu",
                         "--no-progress", "--out", str(tmp_path / "out"), *flags])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("python3 -m loco_lab.cli advise: error: ") and said in err, err
        assert err.count("\n") == 1 and not (tmp_path / "out").exists()
