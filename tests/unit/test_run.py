"""The module runner ``deepspeed_loco.run`` under the real ``deepspeed`` launcher (CPU, 2 gloo processes)."""
import json
import os
import subprocess
import sys

import pytest
from torch.distributed.elastic.utils.distributed import get_free_port

from deepspeed_loco import run
from deepspeed_loco.run import split_argv

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "tests", "unit", "megatron_style_train.py")


@pytest.mark.parametrize("argv,expected", [
    (["--local_rank=1", "train.py", "--lr", "1"], (["--local_rank=1"], ["train.py", "--lr", "1"])),
    (["--local_rank", "1", "train.py"], (["--local_rank=1"], ["train.py"])),
    (["--local-rank=0", "-m", "pkg.train", "-x"], (["--local-rank=0"], ["-m", "pkg.train", "-x"])),
    (["train.py", "--local_rank=3"], ([], ["train.py", "--local_rank=3"])),
    (["-m", "pkg.train"], ([], ["-m", "pkg.train"])),
])
def test_local_rank_before_the_script_is_split_off(argv, expected):
    assert split_argv(argv) == expected


@pytest.mark.parametrize("argv", [["--local_rank=0"], ["--local_rank"], ["-m"], ["--steps", "3", "train.py"]])
def test_missing_script_or_stray_option_is_a_clear_error(argv):
    with pytest.raises(SystemExit, match="deepspeed_loco.run: "):
        split_argv(argv)


@pytest.mark.slow
@pytest.mark.parametrize("as_module,no_local_rank", [(False, False), (True, True)])
def test_deepspeed_launcher_runs_an_unmodified_megatron_style_script(tmp_path, as_module, no_local_rank):
    """``deepspeed --num_gpus 2 [--no_local_rank] --module deepspeed_loco.run (script | -m module) ...``"""
    cfg = {
        "train_micro_batch_size_per_gpu": 8,
        "zero_optimization": {"stage": 3, "zero_quantized_gradients": True,
                              "zeropp_loco_param": {"group_size": 32, "reset_T": 2}},
    }
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    out = tmp_path / "out"
    out.mkdir()
    # skip DeepSpeed's unused CPU shared-memory op (a JIT C++ build of minutes on a fresh machine): a
    # sitecustomize in the test's own directory, so the training script itself stays unmodified
    (tmp_path / "sitecustomize.py").write_text(
        "import deepspeed.ops\ndeepspeed.ops.__compatible_ops__['deepspeed_shm_comm'] = False\n")
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(tmp_path), REPO]))
    env.pop("LOCAL_WORLD_SIZE", None)
    env.pop("LOCAL_SIZE", None)
    target = ["-m", "tests.unit.megatron_style_train"] if as_module else [SCRIPT]
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_nodes", "1", "--num_gpus", "2",
           "--master_port", str(get_free_port()), *(["--no_local_rank"] if no_local_rank else []),
           "--module", "deepspeed_loco.run", *target,
           "--deepspeed_config", str(tmp_path / "ds.json"), "--steps", "3", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    log = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, log
    startup = [line for line in (proc.stdout + proc.stderr).splitlines() if "deepspeed-loco active" in line]
    assert len(startup) == 1 and "LoCo error feedback; W=2 (M=1 node x L=2 ranks)" in startup[0], log
    for rank in range(2):
        seen = json.loads((out / f"rank{rank}.json").read_text())
        assert seen["global_steps"] == 3 and len(seen["losses"]) == 3
        assert seen["env_local_rank"] == rank
        # where the launcher meant it to go: the script's own --local_rank, or nothing with --no_local_rank
        assert seen["local_rank_arg"] == (None if no_local_rank else rank)


@pytest.mark.parametrize("ending, code", [("", None), ("import sys; sys.exit(0)", 0), ("import sys; sys.exit(3)", 3)])
def test_the_process_groups_are_released_after_a_script_that_ends_well(tmp_path, monkeypatch, ending, code):
    """The process groups are released (``clean_exit.release``) after the script returns or calls ``sys.exit(0)``,
    not after a failure."""
    script = tmp_path / "script.py"
    script.write_text(f"x = 1\n{ending}\n")
    drained = []
    monkeypatch.setattr(run.clean_exit, "release", lambda: drained.append(True))
    monkeypatch.setattr(run.deepspeed_loco, "install", lambda: None)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    if code is None:
        run.main([str(script)])
    else:
        with pytest.raises(SystemExit) as stop:
            run.main([str(script)])
        assert stop.value.code == code
    assert drained == ([] if code == 3 else [True])
