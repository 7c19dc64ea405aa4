"""Table, gap arithmetic, arm parsing and CLI flags (no processes)."""
import pytest

from loco_lab import cli
from loco_lab.arms import RunSpec, ds_config, parse_arm, parse_arms
from loco_lab.model import SIZES
from loco_lab.report import (COLUMNS, UNIFORM_COLORS, arm_color, column_notes, format_table, gap_closed,
                             human_bytes, loss_panels, summary_lines, table_rows, train_curve)


def _result(token, val, sum_err=None, seed=0):
    arm = parse_arm(token)
    return {"arm": dict(arm.to_dict(), seed=seed), "key": arm.key, "label": arm.label, "train_loss": val + 0.1,
            "val_loss": val, "step_time_s": 0.5, "bytes_per_step": 1000.0 if arm.kind == "full" else 150.0,
            "full_precision_bytes_per_step": 1000.0, "error_buffer_bytes": 2048 if arm.kind == "loco" else 0,
            "fidelity": {"grad_rel_error_mean": 0.1, "sum_rel_error_final": sum_err}}


def test_gap_closed():
    assert gap_closed(2.0, 2.2, 2.1) == pytest.approx(0.5)
    assert gap_closed(2.0, 2.2, 2.3) == pytest.approx(-0.5)
    assert gap_closed(2.0, 2.0, 2.1) is None


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
    notes = column_notes()
    assert "val loss: next-byte cross-entropy on the held-out plays" in notes[1]
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


def test_parse_arms_and_configs():
    arms = parse_arms("full, plain, loco2", 4)
    assert [a.key for a in arms] == ["full", "plain4", "loco2"]
    with pytest.raises(ValueError):
        parse_arms("full4", 4)
    with pytest.raises(ValueError):
        parse_arms("fast", 4)
    spec = RunSpec(model=SIZES["tiny"], arms=arms)
    full = ds_config(spec, arms[0])["zero_optimization"]
    assert full["stage"] == 3 and "zeropp_loco_param" not in full and "zero_quantized_gradients" not in full
    plain = ds_config(spec, arms[1])["zero_optimization"]
    assert plain["zero_quantized_gradients"] is True
    assert plain["zeropp_loco_param"]["error_feedback"] is False and plain["zeropp_loco_param"]["intra_node_bits"] == 4
    loco = ds_config(spec, arms[2])["zero_optimization"]["zeropp_loco_param"]
    assert loco["error_feedback"] is True and loco["inter_node_bits"] == 2 and loco["local_world_size"] == 2


def test_cli_flags_to_spec():
    parser = cli.argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    cli._demo_parser(sub)
    args = parser.parse_args(["demo", "--steps", "7", "--model-size", "tiny", "--dim", "48", "--bits", "2",
                              "--nodes", "3", "--device", "cpu", "--seeds", "4", "5", "--engine", "deepspeed"])
    spec = cli.spec_from_args(args)
    assert spec.steps == 7 and spec.model.dim == 48 and spec.model.layers == SIZES["tiny"].layers
    assert spec.world_size == 6 and spec.device == "cpu" and spec.backend == "gloo" and spec.dtype == "fp32"
    assert [a.key for a in spec.arms] == ["full", "plain2", "loco2"]
    assert args.seeds == [4, 5] and args.engine == "deepspeed"
    defaults = parser.parse_args(["demo"])
    assert defaults.seeds == [0, 1, 2] and defaults.engine == "simulated"
    with pytest.raises(ValueError, match="--dim 30 must be a multiple of --heads 4"):
        cli.spec_from_args(parser.parse_args(["demo", "--dim", "30", "--heads", "4"]))
