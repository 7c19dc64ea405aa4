"""benchmarks/convergence.py: its flags, and its summary of synthetic runs.jsonl records (tables, issue 8's goal
lines, PNGs), old-format records included."""
import argparse
import dataclasses
import json

import pytest

from loco_lab.arms import parse_arm
from tests.extras import needs_extra

SETUP = {"steps": 4, "model": {"layers": 2, "dim": 32, "seq_len": 16}, "nodes": 2, "local": 2, "device": "cpu",
         "dtype": "fp32", "micro_batch": 2, "lr": 0.003, "group_size": 256, "err_beta": 0.8}


@pytest.fixture(scope="module")
def convergence(benchmark_module):
    return benchmark_module("convergence")


def test_gap_closed(convergence):
    assert convergence.gap_closed(2.0, 2.2, 2.1) == pytest.approx(0.5)
    assert convergence.gap_closed(2.0, 2.2, 2.3) == pytest.approx(-0.5)
    assert convergence.gap_closed(2.0, 2.0, 2.1) is None and convergence.gap_closed(None, 2.2, 2.1) is None


def _record(key, seed, val, old_format=False):
    """A runs.jsonl line as the benchmark writes it; ``old_format``: the arm dict of records before issue 8."""
    arm = dataclasses.replace(parse_arm(key), seed=seed)
    arm_dict = {"kind": arm.kind, "bits": arm.inter_bits or 4, "seed": seed} if old_format else arm.to_dict()
    losses = [3.0 - 0.1 * i + 0.01 * seed for i in range(4)]
    fidelity = {"grad_rel_error_mean": 0.1, "sum_rel_error_final": 0.05, "sum_rel_errors": [0.2, 0.1, 0.05, 0.05]}
    return {"arm": arm_dict, "key": key, "label": arm.label, "parameters": 1000, "train_losses": losses,
            "train_loss": losses[-1], "validation": [[0, 3.5], [2, val + 0.3], [4, val]], "val_loss": val,
            "step_time_s": 0.1, "bytes_per_step": 1000.0, "fidelity": fidelity, "setup": SETUP}


def _write(tmp_path, means, old_keys=(), extra=()):
    """Two seeds per arm at ``mean -+ 0.01`` (the summary's seeds, 0 and 1), plus ``extra`` records of other seeds;
    arms in ``old_keys`` are written in the old record format."""
    with open(tmp_path / "runs.jsonl", "w") as f:
        for key, mean in means.items():
            for seed, delta in ((0, -0.01), (1, 0.01)):
                f.write(json.dumps(_record(key, seed, mean + delta, old_format=key in old_keys)) + "\n")
        for key, seed, val in extra:
            f.write(json.dumps(_record(key, seed, val)) + "\n")
    return argparse.Namespace(out=str(tmp_path), seeds=[0, 1])


def _table(text, first_header):
    """The markdown table whose first header cell is ``first_header``, as {first cell: {header: cell}}."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} "))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    header, body = rows[0], rows[2:]
    return {row[0]: dict(zip(header, row)) for row in body}


def test_bits_per_link_table_and_goals_met(convergence, tmp_path):
    needs_extra("matplotlib", "demo")  # the summary draws its PNGs
    means = {"full": 2.0, "plain4": 2.01, "loco4": 2.004, "plain2": 2.2, "loco2": 2.1, "loco8-4": 2.002,
             "plain8-2": 2.15, "loco8-2": 2.04, "loco8-2h": 2.06}
    text = convergence.summarize(_write(tmp_path, means, old_keys=("full", "plain4", "loco4", "plain2", "loco2")))
    table = _table(text, "arm")  # the first table: one row per arm
    assert list(table) == ["full precision", "qgZ 4-bit", "qgZ 4-bit + LoCo", "qgZ 2-bit", "qgZ 2-bit + LoCo",
                           "qgZ 8/4-bit + LoCo", "qgZ 8/2-bit", "qgZ 8/2-bit + LoCo", "qgZ 8/2-bit + LoCo + Hadamard"]
    gaps = _table(text, "bits")  # LoCo arms with a plain twin: 4, 2 and 8/2 (loco8-4 and loco8-2h have none)
    assert list(gaps) == ["4", "2", "8/2"]
    assert gaps["8/2"]["gap LoCo closes (of means)"] == "+73%"  # (2.15 - 2.04) / (2.15 - 2.0)
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if "| intra bits |" in line)
    link = _table("\n".join(lines[start:]), "arm")
    assert "full precision" not in link and len(link) == 8
    row = link["qgZ 8/2-bit + LoCo"]
    assert (row["intra bits"], row["inter bits"], row["Hadamard"]) == ("8", "2", "no")
    assert (row["inter-node bits/elem"], row["intra-node bits/elem"]) == ("2.125", "8.125")  # + 32 / 256
    assert row["val loss mean +- sd (n)"] == "2.0400 +- 0.0141 (2)"
    assert row["vs full"] == "+2.00%"  # (2.04 - 2.0) / 2.0
    assert row["plain2-to-full gap closed"] == "+80.0%"  # (2.2 - 2.04) / (2.2 - 2.0)
    assert link["qgZ 8/2-bit + LoCo + Hadamard"]["Hadamard"] == "yes"
    assert link["qgZ 2-bit"]["plain2-to-full gap closed"] == "+0.0%"
    assert link["qgZ 2-bit + LoCo"]["plain2-to-full gap closed"] == "+50.0%"
    assert link["qgZ 4-bit + LoCo"]["vs full"] == "+0.20%"
    goals = [line for line in lines if line.startswith("Goal:")]
    assert len(goals) == 2
    assert goals[0].endswith("best is qgZ 8/2-bit + LoCo (loco8-2), closing +80.0% of plain2 - full = +0.2000 "
                             "(2 seeds): met")
    # <= 4.25 inter-node bits: the 4-bit arms and loco8-4 (4.125); within 0.3%: loco4 (+0.20%), loco8-4 (+0.10%)
    assert "met by loco4 (+0.20%), loco8-4 (+0.10%) (full: 2.0000 +- 0.0141)" in goals[1]
    assert "plain4" not in goals[1]
    assert (tmp_path / "summary.md").read_text() == text
    for png in ("convergence.png", "convergence_bits.png"):
        assert (tmp_path / png).read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_goals_not_met_name_the_shortfall(convergence, tmp_path):
    needs_extra("matplotlib", "demo")  # the summary draws its PNGs
    means = {"full": 2.0, "plain4": 2.012, "loco4": 2.01, "plain2": 2.2, "loco2": 2.15, "loco8-2": 2.1}
    text = convergence.summarize(_write(tmp_path, means))
    goals = [line for line in text.splitlines() if line.startswith("Goal:")]
    assert goals[0].endswith("best is qgZ 8/2-bit + LoCo (loco8-2), closing +50.0% of plain2 - full = +0.2000 "
                             "(2 seeds): not met, 25.0 points short")
    assert "not met; closest is qgZ 4-bit + LoCo (loco4) at +0.50%, 0.20 points over" in goals[1]


def test_goals_without_references_say_what_is_missing(convergence, tmp_path):
    needs_extra("matplotlib", "demo")  # the summary draws its PNGs
    text = convergence.summarize(_write(tmp_path, {"plain4": 2.01, "loco4": 2.0}))
    goals = [line for line in text.splitlines() if line.startswith("Goal:")]
    assert goals[0].endswith("not measured (needs the arms full and plain2)")
    assert goals[1].endswith("not measured (needs the arm full)")
    assert not (tmp_path / "convergence_bits.png").exists()  # only equal-bits arms: one PNG


def test_default_arms_are_issue6_then_issue8(convergence):
    assert convergence.parse_args([]).arms.split(",") == [
        "full", "plain4", "loco4", "plain3", "loco3", "plain2", "loco2", "loco8-4", "plain8-2", "loco8-2", "plain4h",
        "loco4h", "loco8-4h", "plain8-2h", "loco8-2h", "plain2h", "loco2h"]


@pytest.mark.parametrize("count, flags, expected", [
    (0, [], ("cpu", "gloo", "fp32")),
    (1, [], ("cpu", "gloo", "fp32")),
    (1, ["--device", "cuda"], ("cuda", "gloo", "bf16")),
    (1, ["--device", "cuda", "--dtype", "fp32"], ("cuda", "gloo", "fp32")),
    (4, [], ("cuda", "nccl", "bf16")),
    (4, ["--backend", "gloo", "--dtype", "bf16"], ("cuda", "gloo", "bf16")),
    (0, ["--dtype", "bf16"], ("cpu", "gloo", "bf16")),
])
def test_base_spec_device_backend_dtype(convergence, gpus, count, flags, expected):
    gpus(count)
    spec = convergence.base_spec(convergence.parse_args(flags))
    assert (spec.device, spec.backend, spec.dtype) == expected


def test_only_the_chosen_seeds_are_compared(convergence, tmp_path):
    """A seed only some arms have (here seed 2 of full) stays out of every mean, so all arms share their seeds."""
    needs_extra("matplotlib", "demo")  # the summary draws its PNGs
    means = {"full": 2.0, "plain4": 2.01, "loco4": 2.004}
    text = convergence.summarize(_write(tmp_path, means, extra=[("full", 2, 9.0)]))
    table = _table(text, "arm")
    assert table["full precision"]["seeds"] == "2" and table["full precision"]["val loss mean"] == "2.0000"
