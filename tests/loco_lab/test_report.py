"""Table, gap arithmetic, arm parsing and CLI flags (no processes)."""
import pytest

from loco_lab import cli
from loco_lab.arms import RunSpec, ds_config, parse_arm, parse_arms
from loco_lab.model import SIZES
from loco_lab.report import (UNIFORM_COLORS, arm_color, format_table, gap_closed, human_bytes,
                                        summary_lines, table_rows)


def _result(token, val, sum_err=None):
    arm = parse_arm(token)
    return {"arm": arm.to_dict(), "key": arm.key, "label": arm.label, "train_loss": val + 0.1, "val_loss": val,
            "step_time_s": 0.5, "bytes_per_step": 1000.0 if arm.kind == "full" else 150.0,
            "full_precision_bytes_per_step": 1000.0, "error_buffer_bytes": 2048 if arm.kind == "loco" else 0,
            "fidelity": {"grad_rel_error_mean": 0.1, "sum_rel_error_final": sum_err}}


def test_gap_closed():
    assert gap_closed(2.0, 2.2, 2.1) == pytest.approx(0.5)
    assert gap_closed(2.0, 2.2, 2.3) == pytest.approx(-0.5)
    assert gap_closed(2.0, 2.0, 2.1) is None


def test_table_and_summary():
    results = [_result("full", 2.0, 1e-8), _result("plain4", 2.2, 0.2), _result("loco4", 2.1, 0.02)]
    rows = table_rows(results)
    assert rows[0][:3] == ["arm", "train loss", "val loss"]
    assert [r[0] for r in rows[1:]] == ["full precision", "qgZ 4-bit", "qgZ 4-bit + LoCo"]
    text = format_table(rows)
    assert "0.150x" in text and "2.00 KiB" in text
    assert format_table(rows, markdown=True).startswith("| arm")
    summary = "\n".join(summary_lines(results))
    assert "+50%" in summary and "seed noise" in summary
    assert human_bytes(3 * 2**20) == "3.00 MiB"


def test_summary_pairs_each_loco_arm_with_its_plain_twin():
    results = [_result("full", 2.0), _result("plain8-2h", 2.4), _result("loco8-2h", 2.1), _result("loco2", 2.3)]
    lines = summary_lines(results)
    assert lines[0].startswith("8/2-bit + Hadamard: validation loss plain 2.4000, LoCo 2.1000 (LoCo lower by 0.3000)")
    assert lines[0].endswith("share of that gap LoCo closes: +75%")
    assert not any(line.startswith("2-bit") for line in lines)  # loco2 has no plain2 here


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
                              "--nodes", "3", "--device", "cpu", "--seed", "4"])
    spec = cli.spec_from_args(args)
    assert spec.steps == 7 and spec.model.dim == 48 and spec.model.layers == SIZES["tiny"].layers
    assert spec.world_size == 6 and spec.device == "cpu" and spec.backend == "gloo" and spec.dtype == "fp32"
    assert [a.key for a in spec.arms] == ["full", "plain2", "loco2"] and all(a.seed == 4 for a in spec.arms)
    with pytest.raises(SystemExit):
        cli.spec_from_args(parser.parse_args(["demo", "--dim", "30", "--heads", "4"]))
