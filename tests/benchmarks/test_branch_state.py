"""A branched study (benchmarks/branch_state.py through ``convergence_sim.py run --save-at / --resume-from``): a
branch resumed from the trunk's saved state trains exactly the trunk's remaining steps (same bits on the CPU), and a
branch whose settings differ from the trunk's is refused, naming the setting."""
import json
import os
import sys

import pytest
import torch

FLAGS = ["--device", "cpu", "--size", "tiny", "--nodes", "2", "--local", "2", "--micro-batch", "2", "--steps", "6",
         "--warmup", "2", "--eval-every", "1", "--eval-windows", "4", "--seed", "3", "--group-size", "32"]


BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")


@pytest.fixture(scope="module")
def sim(benchmark_module):
    """convergence_sim, with its folder on the path while a test runs (``run_one`` imports its siblings as the script
    does)."""
    sys.path.insert(0, BENCHMARKS)
    yield benchmark_module("convergence_sim")
    sys.path.remove(BENCHMARKS)


@pytest.fixture(scope="module")
def runs(sim, tmp_path_factory):
    """The trunk (full, 6 steps, saved after step 3), a full branch and a plain 4/4 branch resumed from it, and a
    full branch resumed from it that stops after step 5 of the 6-step schedule."""
    folder = tmp_path_factory.mktemp("branch")
    threads = torch.get_num_threads()
    out, states = str(folder / "runs.jsonl"), str(folder / "states")
    try:
        for arm, extra in (("full", ["--save-at", "3"]), ("full", ["--resume-from", "3"]),
                           ("plain4", ["--resume-from", "3"]), ("full", ["--resume-from", "3", "--stop-at", "5"])):
            sim.run_one(sim.parse_args(["run", "--arm", arm, "--tag", "t", "--out", out, "--state-dir", states,
                                        *FLAGS, *extra]))
    finally:
        torch.set_num_threads(threads)
    trunk, full, plain, stopped = [json.loads(line) for line in open(out)]
    return trunk, full, plain, states, stopped


def test_a_branch_trains_exactly_the_steps_after_the_saved_one(runs):
    trunk, full, *_ = runs
    assert trunk["setup"]["resumed_from"] == 0 and full["setup"]["resumed_from"] == 3
    assert len(trunk["train_losses"]) == 6 and full["train_losses"] == trunk["train_losses"][3:]
    assert [s for s, _ in full["validation"]] == [4, 5, 6]  # steps of the whole schedule
    assert full["validation"] == [list(v) for v in trunk["validation"][3:]]
    assert full["final_val_loss"] == trunk["final_val_loss"]


def test_a_branch_stopped_before_the_schedule_ends_trains_its_steps_of_the_same_schedule(runs):
    trunk, _, _, _, stopped = runs
    assert stopped["setup"]["stop_at"] == 5 and stopped["setup"]["steps"] == 6
    assert stopped["train_losses"] == trunk["train_losses"][3:5]  # the same learning rates: the trunk's schedule
    assert [s for s, _ in stopped["validation"]] == [4, 5] and stopped["final_val_loss"] == trunk["validation"][4][1]


def test_a_quantized_branch_starts_from_the_same_state_and_departs(runs):
    trunk, _, plain, *_ = runs
    assert plain["key"] == "plain4" and plain["setup"]["resumed_from"] == 3
    # the first step's loss is taken before the first update, on the saved weights: the same bits as the trunk's
    assert plain["train_losses"][0] == trunk["train_losses"][3]
    assert plain["grad_rel_error_mean"] > 0 and plain["final_val_loss"] != trunk["final_val_loss"]


def test_a_branch_on_another_cluster_shape_at_the_same_global_batch_resumes_the_named_trunk(sim, runs, tmp_path):
    """4 x 1 ranks of 2 sequences (the trunk: 2 x 2 of 2): the same global batch, so the full-precision branch
    repeats the trunk's steps up to the order of the mean's fp32 sums; another global batch is refused."""
    trunk, _, _, states, _ = runs
    shape = [flag for flag in FLAGS]
    shape[shape.index("--nodes") + 1], shape[shape.index("--local") + 1] = "4", "1"
    out = str(tmp_path / "runs.jsonl")
    threads = torch.get_num_threads()
    try:
        sim.run_one(sim.parse_args(["run", "--arm", "full", "--tag", "w4", "--trunk-tag", "t", "--out", out,
                                    "--state-dir", states, *shape, "--resume-from", "3"]))
    finally:
        torch.set_num_threads(threads)
    (branch, ) = [json.loads(line) for line in open(out)]
    assert branch["setup"]["nodes"] == 4 and branch["setup"]["trunk"] == "t" and branch["setup"]["resumed_from"] == 3
    assert branch["train_losses"][0] == trunk["train_losses"][3]  # the saved weights, before any update
    assert branch["train_losses"] == pytest.approx(trunk["train_losses"][3:], abs=1e-4)
    assert branch["final_val_loss"] == pytest.approx(trunk["final_val_loss"], abs=1e-4)
    shape[shape.index("--micro-batch") + 1] = "1"
    with pytest.raises(ValueError, match=r"global_batch = 4 \(the state's: 8\)"):
        sim.run_one(sim.parse_args(["run", "--arm", "full", "--tag", "w4", "--trunk-tag", "t", "--out", "/dev/null",
                                    "--state-dir", states, *shape, "--resume-from", "3"]))
    with pytest.raises(FileNotFoundError, match="run the trunk"):
        sim.run_one(sim.parse_args(["run", "--arm", "full", "--tag", "w4", "--out", "/dev/null", "--state-dir",
                                    states, *FLAGS, "--resume-from", "3"]))


def test_a_branch_with_other_settings_or_no_trunk_is_refused(sim, runs):
    *_, states, _ = runs
    with pytest.raises(ValueError, match=r"differs from the run that saved it in lr = 0\.002 \(the state's: 0\.001\)"):
        sim.run_one(sim.parse_args(["run", "--arm", "plain4", "--tag", "t", "--out", "/dev/null", "--state-dir",
                                    states, *FLAGS, "--lr", "2e-3", "--resume-from", "3"]))
    with pytest.raises(FileNotFoundError, match="run the trunk"):
        sim.run_one(sim.parse_args(["run", "--arm", "plain4", "--tag", "t", "--out", "/dev/null", "--state-dir",
                                    states, *FLAGS, "--resume-from", "2"]))
    with pytest.raises(SystemExit, match=r"--save-at 6: it must be a step in \[1, 6\)"):
        sim.run_one(sim.parse_args(["run", "--arm", "full", "--tag", "t", "--out", "/dev/null", "--state-dir",
                                    states, *FLAGS, "--save-at", "6"]))


def test_a_launch_holds_each_branch_until_its_trunk_has_saved_and_fails_an_orphan_at_once(sim, tmp_path, capsys):
    """Trunk and branch in one launch, side by side: the branch starts only once the trunk's state exists (else it
    would fail with "run the trunk"); a branch whose state no run of the launch saves fails without starting."""
    settings = ",".join(f"{k}={v}" for k, v in (("size", "tiny"), ("nodes", 2), ("local", 2), ("micro_batch", 2),
                                                 ("warmup", 2), ("eval_every", 3), ("eval_windows", 4),
                                                 ("group_size", 32), ("state_dir", tmp_path / "states")))
    out = tmp_path / "runs.jsonl"
    sim.launch(sim.parse_args(["launch", "--parallel", "3", "--device", "cpu", "--out", str(out), "--budget", "600",
                               "--matrix", f"tr:6:3:full:{settings},save_at=3",
                               "--matrix", f"tr:6:3:plain4:{settings},resume_from=3",
                               "--matrix", f"tr:6:3:loco4:{settings},resume_from=2"]))
    printed = capsys.readouterr().out
    assert "FAILED tr_loco4_s3: the state it resumes" in printed and "tr_s3_step2.pt" in printed
    assert "launch: 2 runs finished, 1 failed" in printed
    trunk, branch = sorted((json.loads(line) for line in open(out)), key=lambda r: r["setup"]["resumed_from"])
    assert branch["key"] == "plain4" and branch["setup"]["resumed_from"] == 3
    assert branch["train_losses"][0] == trunk["train_losses"][3]  # the trunk's weights after step 3, before any update
