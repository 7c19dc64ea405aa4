"""The simulation report: table, notes, summary, curves, records of simulate() results, the files and the CLI."""
import json

import pytest

from deepspeed_loco.simulation import SimulationSpec, TrainingSetup, simulate
from deepspeed_loco.simulation.arms import parse_arm
from deepspeed_loco.simulation.loss_chart import UNIFORM_COLORS, arm_color, loss_panels, train_curve
from deepspeed_loco.simulation.records import record
from deepspeed_loco.simulation.report import main, report_text, write_report
from deepspeed_loco.simulation.results_table import COLUMNS, column_notes, format_table, human_bytes, table_rows
from deepspeed_loco.simulation.seed_claims import summary_lines
from tests.extras import needs_extra
from tests.unit.simulation.toy import toy_batches, toy_loss, toy_model


def _result(token, val, sum_err=None, seed=0):
    arm = parse_arm(token)
    return {"arm": dict(arm.to_dict(), seed=seed), "key": arm.key, "label": arm.label, "train_loss": val + 0.1,
            "val_loss": val, "step_time_s": 0.5, "bytes_per_step": 1000.0 if arm.kind == "full" else 150.0,
            "full_precision_bytes_per_step": 1000.0, "error_buffer_bytes": 2048 if arm.kind == "loco" else 0,
            "fidelity": {"grad_rel_error_mean": 0.1, "sum_rel_error_final": sum_err}}


def test_table_has_one_row_per_arm_with_mean_and_spread_over_seeds():
    results = [_result(t, v + 0.01 * seed, e, seed) for seed in (0, 1, 2)
               for t, v, e in (("full", 2.0, 1e-8), ("plain4", 2.2, 0.2), ("loco4", 2.1, 0.02))]
    rows = table_rows(results)
    assert rows[0] == list(COLUMNS) and rows[0][:3] == ["arm", "val loss", "train loss"]
    assert [r[0] for r in rows[1:]] == ["full precision", "qgZ 4-bit", "qgZ 4-bit + LoCo"]
    assert rows[2][1] == "2.2100 +- 0.0100"  # seeds 0, 1, 2: 2.20, 2.21, 2.22
    text = format_table(rows)
    assert "0.150x" in text and "2.00 KiB" in text
    assert format_table(rows, markdown=True).startswith("| arm")
    assert len(column_notes()) == len(COLUMNS)
    assert human_bytes(3 * 2**20) == "3.00 MiB"


def test_summary_claims_only_what_the_seeds_support():
    clear = [_result(t, v + 0.001 * seed, e, seed) for seed in (0, 1, 2)
             for t, v, e in (("full", 2.0, 1e-8), ("plain8-2h", 2.4, 0.3), ("loco8-2h", 2.1, 0.01))]
    lines = summary_lines(clear)
    assert lines[0].startswith("8/2-bit + Hadamard, LoCo vs plain qgZ, validation loss over 3 seed(s): -0.3000")
    assert lines[0].endswith(": LoCo is better")
    assert lines[1].startswith("  plain qgZ vs full precision: +0.4000") and lines[1].endswith("plain qgZ is worse")
    assert "LoCo's is 30.0x smaller" in lines[2]  # one number when every seed gives the same
    assert not any(line.startswith("one seed") for line in lines)
    noisy = [_result("plain4", 2.2 + d, 0.2, seed) for seed, d in enumerate((0.03, -0.02, 0.0))] + \
        [_result("loco4", 2.2 + d, 0.02, seed) for seed, d in enumerate((-0.01, 0.02, 0.01))]
    assert "no measurable difference" in summary_lines(noisy)[0]
    one = summary_lines([_result("plain4", 2.2, 0.2), _result("loco4", 2.1, 0.02), _result("loco2", 2.3)])
    assert "one seed: no claim" in one[0] and not any(line.startswith("2-bit") for line in one)
    assert one[-1].startswith("one seed: every figure above is a single run; comparing arms needs two or more seeds")
    assert summary_lines([_result("full", 2.0)]) == [one[-1]]  # also when no pair of arms was compared


def test_column_notes_say_what_was_validated_on_and_timed():
    notes = column_notes("the held-out plays", loss="next-byte cross-entropy")
    assert "val loss: next-byte cross-entropy on the held-out plays" in notes[1]
    assert column_notes()[1] == "  val loss: the validation loss (eval_fn) after the last step: mean +- sd over seeds"
    assert notes[-1].startswith("  median step time: wall time per optimizer step of all W virtual ranks together, "
                                "simulated in one process") and notes[-1].endswith("; the median over seeds")
    own = column_notes("the held-out mine.txt (last 10%)", "deepspeed")
    assert "on the held-out mine.txt (last 10%) after the last step" in own[1]
    assert "the slowest of the W DeepSpeed worker processes" in own[-1] and "simulated" not in " ".join(own)


def test_train_curve_is_bias_corrected_and_keeps_up_with_short_runs():
    assert train_curve([3.0] * 7) == pytest.approx([3.0] * 7, abs=1e-12)
    assert train_curve([3.0] * 500) == pytest.approx([3.0] * 500, abs=1e-12)
    falling = [5.0 - 2.0 * t / 14 for t in range(15)]  # 15 steps from 5 to 3: the EMA 0.9 used to end near 3.9
    assert abs(train_curve(falling)[-1] - falling[-1]) < 0.1
    noisy = [3.0 + (-1) ** t for t in range(1000)]  # a long run is smoothed over 100 steps
    assert max(abs(v - 3.0) for v in train_curve(noisy)[100:]) < 0.02


def test_the_second_validation_panel_starts_at_its_first_point():
    runs = [dict(_result(token, 2.0), train_losses=[3.0] * 40, validation=[(0, 5.5), (10, 3.1), (20, 2.6), (30, 2.3),
                                                                             (40, 2.2)]) for token in ("full", "loco4")]
    train, whole, zoom = loss_panels(runs)  # no running-sum errors recorded: no fourth panel
    assert whole.xlim is None and zoom.xlim == (20, 40) and zoom.ylim == (2.2, 2.6)


def test_arm_colors():
    assert arm_color(parse_arm("loco4")) == UNIFORM_COLORS[("loco", 4)]
    assert arm_color(parse_arm("plain2h")) == tuple(round(c + 0.45 * (255 - c)) for c in UNIFORM_COLORS[("plain", 2)])
    colors = {arm_color(parse_arm(t)) for t in ("full", "plain8-2", "loco8-2", "loco8-4", "loco8-2h", "loco2")}
    assert len(colors) == 6


def _simulated(tmp_path):
    """Records of full / plain2 / loco2 on the toy problem, 2 seeds, and the model's parameter sizes."""
    sizes = [p.numel() for p in toy_model().parameters()]
    records = []
    for seed in (0, 1):
        setup = TrainingSetup(toy_model, lambda: toy_batches(16), loss_fn=toy_loss, loco={"group_size": 32},
                              eval_fn=lambda m: float(m[0].weight.abs().mean()))
        results = simulate(SimulationSpec(setup, ["full", "plain2", "loco2"], 12, seed))
        records += [record(r, sizes) for r in results]
    return records, sizes


@pytest.mark.slow
def test_records_of_simulate_results_carry_what_the_table_reads(tmp_path):
    records, sizes = _simulated(tmp_path)
    full, plain, loco = records[:3]
    assert [r["key"] for r in records] == ["full", "plain2", "loco2"] * 2 and records[3]["arm"]["seed"] == 1
    assert full["parameters"] == sum(sizes) and full["error_buffer_bytes"] == 0 == plain["error_buffer_bytes"]
    assert loco["error_buffer_bytes"] > 0 and plain["train_loss_last_k"] == 1
    assert plain["train_loss"] == plain["train_losses"][-1] and plain["val_loss"] == plain["validation"][-1][1]
    assert full["bytes_per_step"] == full["full_precision_bytes_per_step"] > plain["bytes_per_step"] > 0
    assert len(table_rows(records)) == 4
    # JSON keeps every value exactly: only the (step, loss) tuples come back as lists
    assert json.loads(json.dumps(records)) == [dict(r, validation=[list(v) for v in r["validation"]]) for r in records]


@pytest.mark.slow
def test_write_report_and_the_cli_give_the_table_the_json_and_the_png(tmp_path, capsys):
    needs_extra("matplotlib", "report")  # loss_curves.png
    records, _ = _simulated(tmp_path)
    paths = write_report(records, str(tmp_path / "a"), title="toy", header="toy run", extra={"note": 1})
    assert [p.rsplit("/", 1)[1] for p in paths] == ["table.md", "results.json", "loss_curves.png"]
    table = (tmp_path / "a" / "table.md").read_text()
    assert table.startswith("toy run\n\n| arm ") and "columns:" in table and "LoCo vs plain qgZ" in table
    saved = json.loads((tmp_path / "a" / "results.json").read_text())
    assert saved["note"] == 1 and saved["arms"] == json.loads(json.dumps(records))
    assert (tmp_path / "a" / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the console script renders the saved results again
    assert main([str(tmp_path / "a" / "results.json"), "--out", str(tmp_path / "b")]) == 0
    assert report_text(records) in capsys.readouterr().out
    assert (tmp_path / "b" / "table.md").read_text() == report_text(records, markdown=True) + "\n"


def test_the_cli_names_a_file_without_records(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"spec": {}}))
    assert main([str(bad), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("deepspeed-loco-report: error: ") and "no result records" in err and "\n" not in err


@pytest.mark.slow
def test_every_panel_has_a_y_label_and_names_the_held_out_data_only_when_told(tmp_path):
    records, _ = _simulated(tmp_path)
    named, unnamed = loss_panels(records, held_out="the last 10% of mine.txt"), loss_panels(records)
    assert all(panel.ylabel for panel in named + unnamed) and len(named) == len(unnamed) >= 3
    assert [p.title for p in named if p.title.startswith("validation loss")] and all(
        "on the last 10% of mine.txt" in p.title for p in named if p.title.startswith("validation loss"))
    assert not any("held-out" in p.title or " on " in p.title for p in unnamed)


@pytest.mark.parametrize("parser", ["report", "perf"])
def test_help_is_plain_text_and_whole(parser, capsys):
    from deepspeed_loco.perf.cli import DESCRIPTION as PERF, build_parser
    from deepspeed_loco.simulation.report import DESCRIPTION as REPORT
    with pytest.raises(SystemExit):
        main(["--help"]) if parser == "report" else build_parser().parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert ":func:" not in text and "``" not in text and "(default: None)" not in text
    assert " ".join((REPORT if parser == "report" else PERF).split()) in text  # not cut at a ';'
