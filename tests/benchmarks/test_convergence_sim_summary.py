"""benchmarks/convergence_sim.py summarize: a tag without full / plain2 runs borrows them from a reference tag
(``--reference TAG=REFTAG``), marked in the table, and paired differences use the seeds both tags ran."""
import argparse
import json

import pytest

from tests.extras import needs_extra

SETUP = {"steps": 4, "size": "tiny", "params": 1000, "text": None, "model": {"layers": 2, "dim": 32, "seq_len": 16},
         "nodes": 2, "local": 2, "micro_batch": 2, "lr": 0.003, "warmup": 1, "dtype": "fp32", "group_size": 256,
         "err_beta": 0.8, "reset_T": 1024, "ef_hops": "all", "quant_grid": "symmetric", "eval_windows": 8,
         "device": "cpu", "kernels": "loco_reference"}


@pytest.fixture(autouse=True)
def matplotlib():
    """Every summary here draws its PNG."""
    return needs_extra("matplotlib", "demo")


@pytest.fixture(scope="module")
def convergence_sim(benchmark_module):
    return benchmark_module("convergence_sim")


def _record(tag, key, seed, val, **setup):
    return {"tag": tag, "key": key, "seed": seed, "setup": {**SETUP, **setup}, "final_val_loss": val,
            "validation": [[0, 3.0], [4, val]], "train_losses": [3.0, 2.9, 2.8, 2.7], "grad_rel_error_mean": 0.5,
            "sum_rel_error_final": 0.3, "nonzero_fraction_mean": 0.9, "released_fraction_mean": None,
            "series": {"update_rms": [0.2]}}


def _summarize(module, tmp_path, records, references=()):
    with open(tmp_path / "runs.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return module.summarize(argparse.Namespace(runs=[str(tmp_path / "runs.jsonl")], out=str(tmp_path / "out"),
                                               reference=list(references)))


def _tables(text, tag):
    """The two markdown tables of ``tag``'s section as lists of {header: cell}."""
    section = text.split(f"### {tag}\n", 1)[1].split("\n### ", 1)[0]
    tables, rows = [], []
    for line in section.splitlines() + [""]:
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip("|").split("|")])
        elif rows:
            tables.append([dict(zip(rows[0], r)) for r in rows[2:]])
            rows = []
    return tables


def _runs():
    sym = [_record("sym", "full", s, v) for s, v in ((0, 1.50), (1, 1.52), (2, 1.51))]
    sym += [_record("sym", "plain2", s, v) for s, v in ((0, 1.60), (1, 1.62))]
    mr = [_record("mr", k, s, v, quant_grid="midrise", err_beta=0.9)
          for k, vals in (("plain8-2h", (1.54, 1.55, 1.53)), ("loco8-2h", (1.52, 1.53, 1.51)))
          for s, v in enumerate(vals)]
    return sym + mr


def test_reference_tag_fills_full_and_plain2(convergence_sim, tmp_path):
    text = _summarize(convergence_sim, tmp_path, _runs(), ["mr=sym"])
    arms, diffs = _tables(text, "mr")
    assert [r["arm"] for r in arms] == ["full @sym", "plain2 @sym", "plain8-2h", "loco8-2h"]
    assert "vs full (@sym)" in arms[0] and "gap closed (@sym)" in arms[0]
    plain = arms[2]
    assert plain["gap closed (@sym)"] == "70%"  # (1.61 - 1.54) / (1.61 - 1.51): 3-seed full, 2-seed plain2
    assert plain["vs full (@sym)"] == "+1.99%"  # (1.54 - 1.51) / 1.51
    by_pair = {r["first - second"]: r for r in diffs}
    assert list(by_pair) == ["loco8-2h - plain8-2h", "plain8-2h - full @sym", "loco8-2h - full @sym"]
    assert by_pair["plain8-2h - full @sym"]["n"] == "3"
    assert by_pair["plain8-2h - full @sym"]["mean difference"] == "+0.0300"
    assert "plain2 @sym - full @sym" not in by_pair  # the reference tag's own comparison is not repeated
    assert "Rows marked @sym are tag sym's runs" in text and "grid midrise" in text
    assert [r["arm"] for r in _tables(text, "sym")[0]] == ["full", "plain2"]  # the reference tag is unchanged
    assert json.load(open(tmp_path / "out" / "summary.json"))["mr"][0][1][0] == "full @sym"


def test_without_reference_the_columns_stay_empty(convergence_sim, tmp_path):
    arms, diffs = _tables(_summarize(convergence_sim, tmp_path, _runs()), "mr")
    assert [r["arm"] for r in arms] == ["plain8-2h", "loco8-2h"]
    assert {r["gap closed"] for r in arms} == {"-"} and {r["vs full"] for r in arms} == {"-"}
    assert [r["first - second"] for r in diffs] == ["loco8-2h - plain8-2h"]


def test_reference_needs_the_same_training_setup(convergence_sim, tmp_path):
    runs = [r for r in _runs() if r["tag"] == "sym"] + [_record("long", "loco8-2h", 0, 1.4, steps=8)]
    with pytest.raises(SystemExit, match="differ in steps"):
        _summarize(convergence_sim, tmp_path, runs, ["long=sym"])
    for bad in ("mr", "mr=mr", "mr=nope"):
        with pytest.raises(SystemExit, match="--reference"):
            _summarize(convergence_sim, tmp_path, _runs(), [bad])
