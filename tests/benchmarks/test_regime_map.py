"""benchmarks/regime_map.py on made-up runs: the paired differences per regime, their pool over regimes (the map's
headline), a regime run on CPU named so, and the files it writes."""
import json

import pytest

from benchmarks.pooling import pool_intervals
from deepspeed_loco.utils.stats import t_interval
from tests.extras import needs_extra


@pytest.fixture(autouse=True)
def extras():
    """benchmarks/regime_map.py's statistics (map_statistics.py and pooling.py: scipy) and its map.png
    (matplotlib)."""
    return needs_extra("scipy", "demo"), needs_extra("matplotlib", "demo")


LOSSES = {  # regime tag: arm: final validation loss per seed 0, 1, 2
    "a_w4": {"full": [2.00, 2.10, 2.20], "plain2": [2.05, 2.16, 2.24], "loco2": [2.02, 2.12, 2.22]},
    "b_w16": {"full": [1.50, 1.55, 1.60], "plain2": [1.56, 1.60, 1.67], "loco2": [1.54, 1.59, 1.63]},
}


def _run(tag, key, seed, loss, nodes, device):
    setup = {"steps": 100, "size": "small", "params": 870_000, "text": "t", "nodes": nodes, "local": 2,
             "micro_batch": 64 // (2 * nodes), "lr": 1e-3, "warmup": 10, "dtype": "bf16", "quant_grid": "auto",
             "device": device}
    return {"tag": tag, "key": key, "seed": seed, "setup": setup, "final_val_loss": loss, "noise_scale": 40.0,
            "grad_rel_error_mean": 0.9 if key != "full" else 0.0, "sum_rel_error_final": 0.5,
            "series": {"grad_rel_errors": [0.9] * 10, "update_rms": [0.5] + [0.2] * 9}}


@pytest.fixture
def runs_file(tmp_path):
    path = tmp_path / "runs.jsonl"
    with open(path, "w") as f:
        for tag, arms in LOSSES.items():
            nodes, device = (2, "NVIDIA H200") if tag == "a_w4" else (8, "cpu")
            for key, losses in arms.items():
                for seed, loss in enumerate(losses):
                    f.write(json.dumps(_run(tag, key, seed, loss, nodes, device)) + "\n")
    return path


def _paired(tag, first, second):
    return t_interval([a - b for a, b in zip(LOSSES[tag][first], LOSSES[tag][second])])


def test_the_pool_is_the_random_effects_pool_of_each_regimes_interval(benchmark_module, runs_file, tmp_path):
    regime_map = benchmark_module("regime_map")
    regime_map.main(["--runs", str(runs_file), "--out", str(tmp_path / "out")])
    written = json.loads((tmp_path / "out" / "map.json").read_text())
    (pooled, ) = written["pooled"]
    assert (pooled["grid"], pooled["bits"], pooled["regimes"]) == ("auto", "2/2", ["a_w4", "b_w16"])
    for key, (first, second) in {"loco_minus_plain": ("loco2", "plain2"),
                                 "plain_minus_full": ("plain2", "full")}.items():
        expected = pool_intervals([_paired(tag, first, second) for tag in LOSSES])
        assert (pooled[key]["mean"], pooled[key]["low"], pooled[key]["high"]) == pytest.approx(
            (expected.mean, expected.low, expected.high), rel=1e-12)
        assert pooled[key]["k"] == 2 and pooled[key]["seeds"] == 6
    # a_w4's LoCo - full is +0.02 on every seed: an interval of zero width, left out of that pool
    assert pooled["loco_minus_full"]["k"] == 1 and pooled["loco_minus_full"]["seeds"] == 3
    assert pooled["loco_minus_full"]["mean"] == pytest.approx(_paired("b_w16", "loco2", "full")[0], rel=1e-12)
    rows = {row["tag"]: row for row in written["regimes"]}
    assert rows["a_w4"]["loco_minus_plain"][1] == pytest.approx(-0.03, abs=1e-12)  # (-0.03, -0.04, -0.02) / 3
    table = (tmp_path / "out" / "map.md").read_text()
    assert "W=16 (8x2), mb 4, 100 steps (warm-up 10), auto, CPU | 2/2" in table
    assert "W=4 (2x2), mb 16, 100 steps (warm-up 10), auto |" in table
    assert "| auto | 2/2 | " in table and (tmp_path / "out" / "map.png").stat().st_size > 0


def test_the_pool_per_model_size_keeps_each_model_s_regimes_apart(benchmark_module, runs_file, tmp_path):
    records = [json.loads(line) for line in runs_file.read_text().splitlines()]
    for record in records:  # b_w16 becomes a regime of a 10.8M model
        if record["tag"] == "b_w16":
            record["setup"]["params"] = 10_820_000
    runs_file.write_text("".join(json.dumps(record) + "\n" for record in records))
    benchmark_module("regime_map").main(["--runs", str(runs_file), "--out", str(tmp_path / "out")])
    written = json.loads((tmp_path / "out" / "map.json").read_text())
    assert written["pooled"][0]["regimes"] == ["a_w4", "b_w16"]  # the pool over sizes still has both
    by_model = written["pooled_by_model"]
    assert [(p["bits"], p["params"], p["regimes"]) for p in by_model] == [
        ("2/2", 870_000, ["a_w4"]), ("2/2", 10_820_000, ["b_w16"])]  # the smaller model first
    for entry, tag in zip(by_model, ("a_w4", "b_w16")):  # a pool of one regime is that regime's interval
        cell = entry["loco_minus_plain"]
        assert (cell["mean"], cell["low"], cell["high"]) == pytest.approx(_paired(tag, "loco2", "plain2"), rel=1e-9)
        assert cell["k"] == 1 and cell["seeds"] == 3
    table = (tmp_path / "out" / "map.md").read_text()
    assert "| auto | 2/2 | 0.9M | " in table and "| auto | 2/2 | 10.8M | " in table and "(1 regime, 3 seeds" in table


def test_a_changed_rule_is_compared_seed_by_seed_with_its_base_regime_and_not_pooled(benchmark_module, runs_file,
                                                                                    tmp_path):
    """``a_w4_bounded`` (a compensation variant) and ``a_w4_ef51`` (error feedback from step 51) hold LoCo runs only:
    each is paired with ``a_w4``'s arms, shows its per-seed early burst over plain, and is no regime of its own."""
    changed = {"a_w4_bounded": ([2.00, 2.20, 2.25], [1.8, 2.7, 0.9]), "a_w4_ef51": ([2.03, 2.13, 2.23], [0.9] * 3)}
    with open(runs_file, "a") as f:
        for tag, (losses, peaks) in changed.items():
            for seed, (loss, peak) in enumerate(zip(losses, peaks)):
                run = _run(tag, "loco2", seed, loss, 2, "NVIDIA H200")
                run["series"]["grad_rel_errors"] = [0.9, peak] + [0.9] * 8
                f.write(json.dumps(run) + "\n")
    regime_map = benchmark_module("regime_map")
    regime_map.main(["--runs", str(runs_file), "--out", str(tmp_path / "out")])
    written = json.loads((tmp_path / "out" / "map.json").read_text())
    assert {row["tag"] for row in written["regimes"]} == set(LOSSES)
    rows = {row["tag"]: row for row in written["rule_changes"]}
    assert (rows["a_w4_bounded"]["change"], rows["a_w4_ef51"]["change"]) == ("bounded", "from step 51")
    bounded = rows["a_w4_bounded"]
    minus_plain = [a - b for a, b in zip(changed["a_w4_bounded"][0], LOSSES["a_w4"]["plain2"])]
    assert bounded["minus_plain"][1] == pytest.approx(sum(minus_plain) / 3, abs=1e-12)
    assert [seed for seed, _, _ in bounded["seeds"]] == [0, 1, 2]
    assert [burst for _, burst, _ in bounded["seeds"]] == pytest.approx([2.0, 3.0, 1.0])  # peak over plain's 0.9
    assert [minus for _, _, minus in bounded["seeds"]] == pytest.approx(minus_plain, abs=1e-12)
    table = (tmp_path / "out" / "map.md").read_text()
    assert "| a_w4 | loco2 | bounded | 2.00 |" in table and "0: 2.00, -0.050; 1: 3.00, +0.040" in table


def test_the_update_burst_is_the_largest_window_by_window_ratio_of_update_rms(benchmark_module):
    """Window by window, not the ratio of the two maxima: plain's largest update (the first window) does not hide
    LoCo's larger steps later; windows past the first 100 steps do not count."""
    regime_map = benchmark_module("regime_map")
    plain = {"series": {"update_rms": [0.5, 0.20, 0.16, 0.15] + [0.15] * 6 + [0.01]}}
    loco = {"series": {"update_rms": [0.5, 0.37, 0.24, 0.15] + [0.15] * 6 + [0.05]}}
    assert regime_map._update_burst(loco, plain) == pytest.approx(0.37 / 0.20)
    assert regime_map._update_burst(plain, plain) == pytest.approx(1.0)


def test_the_seed_blocked_section_counts_each_interval_and_keeps_a_batch_change_a_regime_of_its_own(
        benchmark_module, runs_file, tmp_path):
    """``c_w16_b256`` differs from ``b_w16`` only in its global batch (micro-batch 16, not 4): a regime of its own in
    the tests and the per-model analysis, and no member of ``a_w4`` and ``b_w16``'s family of regimes alike but in W."""
    with open(runs_file, "a") as f:
        for key, losses in {"full": [1.40, 1.44, 1.49], "plain2": [1.45, 1.50, 1.52],
                            "loco2": [1.44, 1.47, 1.51]}.items():
            for seed, loss in enumerate(losses):
                run = _run("c_w16_b256", key, seed, loss, 8, "cpu")
                run["setup"]["micro_batch"] = 16
                f.write(json.dumps(run) + "\n")
    benchmark_module("regime_map").main(["--runs", str(runs_file), "--out", str(tmp_path / "out")])
    blocks = json.loads((tmp_path / "out" / "map.json").read_text())["seed_blocks"]
    family = blocks["families"]["loco_minus_plain"]
    assert family["count"] == 3 and [t["tag"] for t in family["tests"]] == ["a_w4", "b_w16", "c_w16_b256"]
    assert family["tests"][0]["mean"] == pytest.approx(-0.03, abs=1e-12)
    (model, ) = blocks["by_model"]
    assert model["regimes"] == ["a_w4", "b_w16", "c_w16_b256"] and model["loco_minus_plain"]["regimes"] == 3
    assert model["loco_minus_plain"]["df"] == 2  # three regimes over the same three seeds: 2 degrees of freedom
    (w_family, ) = blocks["w_families"]
    assert (w_family["regimes"], w_family["worlds"], w_family["global_batch"]) == (["a_w4", "b_w16"], [4, 16], 64)
    assert w_family["loco_minus_plain"]["df_regime"] == 1 and w_family["loco_minus_plain"]["df_residual"] == 2
    assert blocks["burst_rule"]["out_of_sample"]["quiet"] == 9  # made-up runs: none was in the rule's sample
    table = (tmp_path / "out" / "map.md").read_text()
    assert "#### Statistics with seeds as blocks" in table and "| LoCo - plain | 3 | " in table


def test_a_branched_regime_takes_its_noise_scale_from_the_branches_not_the_trunk(benchmark_module, tmp_path):
    """A branched design's full arm is the trunk (run from step 1, whole-run noise scale 40 here); its branches
    (resumed after step 100) measure 200 over the compared steps, and rho is computed from those."""
    regime_map = benchmark_module("regime_map")
    path = tmp_path / "runs.jsonl"
    with open(path, "w") as f:
        for key, losses in LOSSES["b_w16"].items():
            for seed, loss in enumerate(losses):
                run = _run("br", key, seed, loss, 8, "cpu")
                run["setup"]["resumed_from"] = 0 if key == "full" else 100
                run["noise_scale"] = 40.0 if key == "full" else 150.0 + 50.0 * (key == "loco2") + 25.0 * seed
                f.write(json.dumps(run) + "\n")
    regime_map.main(["--runs", str(path), "--out", str(tmp_path / "out")])
    (row, ) = json.loads((tmp_path / "out" / "map.json").read_text())["regimes"]
    assert row["noise_scale"] == pytest.approx(200.0, rel=1e-12)  # mean of 150, 175, 200 and 200, 225, 250
    batch = 8 * 2 * 4
    assert row["rho"] == pytest.approx(0.81 * (1 + 200.0 / batch) / (200.0 / batch), rel=1e-12)


def test_files_that_reuse_a_tag_are_refused_together_and_read_apart_under_names(benchmark_module, runs_file,
                                                                                tmp_path):
    regime_map = benchmark_module("regime_map")
    with pytest.raises(ValueError, match=r"holds run a_w4 full seed 0, already read from .*--runs NAME=PATH"):
        regime_map.load([str(runs_file), str(runs_file)])
    regimes, _ = regime_map.load([f"first={runs_file}", f"second={runs_file}"])
    assert sorted(regimes) == ["first/a_w4", "first/b_w16", "second/a_w4", "second/b_w16"]
    assert regimes["second/b_w16"]["loco2"][2]["final_val_loss"] == LOSSES["b_w16"]["loco2"][2]
