"""``deepspeed_loco.install()`` under the Hugging Face Trainer and Accelerate: 2 gloo CPU processes, a tiny model.

Each test is skipped, saying why, when its framework is not installed (``pip install ".[hf]"`` installs both).
"""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from torch.distributed.elastic.utils.distributed import get_free_port

from tests.unit.process_pool import ProcessPool

WORLD, STEPS = 2, 3
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ACCELERATE_EXAMPLE = os.path.join(REPO, "examples", "accelerate")


def _ds_config():
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3, "zero_quantized_gradients": True,
                              "zeropp_loco_param": {"group_size": 32, "reset_T": 2}},
    }


def _samples(n=WORLD * 4 * STEPS):
    gen = torch.Generator().manual_seed(0)
    return [{"x": torch.randn(13, generator=gen), "y": torch.randn(5, generator=gen)} for _ in range(n)]


def _loco_summary(engine):
    import deepspeed_loco
    hook = deepspeed_loco.loco_hook(engine)
    return None if hook is None else {"step": hook.state.step, "reduces": hook.reducer.stats.reduces,
                                      "sent_bytes": hook.reducer.stats.total_bytes}


def train_accelerate_example(steps):
    """``examples/accelerate/train_accelerate.py``'s ``train`` with its DeepSpeed config, in a pool process."""
    spec = importlib.util.spec_from_file_location("train_accelerate",
                                                  os.path.join(ACCELERATE_EXAMPLE, "train_accelerate.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)  # runs its deepspeed_loco.install()
    from accelerate.state import AcceleratorState
    AcceleratorState._reset_state()  # this pool process built an Accelerator before (one plugin set per process)
    return example.train(steps=steps, ds_config=example.DS_CONFIG)


class _Regressor(torch.nn.Module):
    """The Trainer's contract: keyword inputs, a dict with ``loss``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(13, 33), torch.nn.Tanh(), torch.nn.Linear(33, 5))

    def forward(self, x, y):
        return {"loss": torch.nn.functional.mse_loss(self.net(x), y)}


def train_with_trainer(out_dir):
    import deepspeed_loco
    deepspeed_loco.install()  # the one line: before the Trainer builds the engine
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(out_dir), deepspeed=_ds_config(), per_device_train_batch_size=4,
                             max_steps=STEPS, learning_rate=1e-3, report_to=[], save_strategy="no",
                             logging_strategy="no", use_cpu=True, dataloader_num_workers=0)
    trainer = Trainer(model=_Regressor(), args=args, train_dataset=_samples())
    result = trainer.train()
    return {"global_step": result.global_step, "loco": _loco_summary(trainer.model_wrapped)}


@pytest.fixture(scope="module")
def pool():
    """Processes of their own: ``install()`` patches DeepSpeed for the rest of a process's life."""
    pool = ProcessPool(WORLD, local=WORLD)
    yield pool
    pool.close()


def _check(loco, steps):
    assert loco is not None, "LoCo was not attached"
    assert loco["step"] == steps and loco["reduces"] >= steps and loco["sent_bytes"] > 0


@pytest.mark.slow
def test_hugging_face_trainer_runs_loco_after_install(request, tmp_path):
    pytest.importorskip("transformers", reason="transformers is not installed (pip install \".[hf]\")")
    pytest.importorskip("accelerate", reason="the Trainer's DeepSpeed path needs Accelerate (pip install \".[hf]\")")
    for result in request.getfixturevalue("pool").run(train_with_trainer, tmp_path):
        assert result["global_step"] == STEPS
        _check(result["loco"], STEPS)


def test_accelerate_example_config_is_zero3_qgz_loco_and_accepted_by_the_accelerate_cli():
    """The example's DeepSpeed JSON through this package's validation; its Accelerate config names that JSON and none
    of the keys Accelerate refuses next to a ``deepspeed_config_file``."""
    from deepspeed_loco.runtime.zero.ds_config import split_loco_config
    with open(os.path.join(ACCELERATE_EXAMPLE, "ds_config_zero3_qgz_loco.json")) as f:
        config = json.load(f)
    assert config["zero_optimization"]["stage"] == 3 and config["zero_optimization"]["zero_quantized_gradients"]
    _, loco = split_loco_config(config)
    assert loco is not None and loco.group_size == 32
    with open(os.path.join(ACCELERATE_EXAMPLE, "accelerate_config.yaml")) as f:
        entries = dict(line.strip().split(": ", 1) for line in f if ": " in line and not line.lstrip().startswith("#"))
    assert entries["distributed_type"] == "DEEPSPEED" and entries["num_processes"] == "2"
    assert os.path.isfile(os.path.join(REPO, entries["deepspeed_config_file"]))
    refused = {"gradient_accumulation_steps", "gradient_clipping", "zero_stage", "offload_optimizer_device",
               "offload_param_device", "zero3_save_16bit_model", "mixed_precision"}
    assert not refused & set(entries)


# rank 0's loss over the example's 20 default steps, as its docstring and docs/frameworks.md state it: at the first
# step, averaged over the first five and over the last five; each held to a unit of its last digit (rounding plus
# room for another CPU's float sums moving a 4-bit rounding)
ACCELERATE_FIGURES = (("0.86", lambda losses: losses[0]), ("1.00", lambda losses: sum(losses[:5]) / 5),
                      ("0.067", lambda losses: sum(losses[-5:]) / 5))


@pytest.mark.slow
def test_accelerate_example_trains_with_loco_and_its_loss_falls(request):
    """The example's 20 default steps: on every rank the mean loss of the last five steps is under a quarter of the
    first five's (unit-variance targets, noise 0.01 of the variance). (The figures the docs state are those of the
    documented command, checked where it runs, below: in a pool process that built an Accelerator before, Accelerate's
    process count, hence the data each rank sees, can differ.)"""
    pytest.importorskip("accelerate", reason="Accelerate is not installed (pip install \".[hf]\")")
    steps = 20
    for result in request.getfixturevalue("pool").run(train_accelerate_example, steps):
        losses = result["losses"]
        assert result["world"] == WORLD and len(losses) == steps
        _check(result["loco"], steps)
        assert sum(losses[-5:]) < 0.25 * sum(losses[:5]), losses


def test_the_accelerate_figures_are_stated_in_the_docs_and_the_example():
    with open(os.path.join(REPO, "docs", "frameworks.md")) as f:
        docs = " ".join(f.read().split())
    with open(os.path.join(ACCELERATE_EXAMPLE, "train_accelerate.py")) as f:
        example = " ".join(f.read().split())
    first, first_five, last_five = (said for said, _ in ACCELERATE_FIGURES)
    for text in (docs, example):
        assert f"{first} at the first step, {first_five} averaged over the first five" in text
        assert f"{last_five} averaged over the last five" in text


@pytest.mark.slow
def test_accelerate_launch_runs_the_example_with_loco_and_the_documented_figures(tmp_path):
    """``accelerate launch --config_file examples/accelerate/accelerate_config.yaml
    examples/accelerate/train_accelerate.py`` as the example says, on CPU (2 processes, its 20 default steps): LoCo
    attached, and rank 0's loss figures those the docs state (:data:`ACCELERATE_FIGURES`)."""
    pytest.importorskip("accelerate", reason="Accelerate is not installed (pip install \".[hf]\")")
    (tmp_path / "sitecustomize.py").write_text(  # DeepSpeed's unused CPU shared-memory op: a JIT build of minutes
        "import deepspeed.ops\ndeepspeed.ops.__compatible_ops__['deepspeed_shm_comm'] = False\n")
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(tmp_path), REPO]))
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           os.path.join(ACCELERATE_EXAMPLE, "accelerate_config.yaml"), "--main_process_port", str(get_free_port()),
           os.path.join(ACCELERATE_EXAMPLE, "train_accelerate.py"), "--out", str(out)]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    log = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, log
    startup = [line for line in (proc.stdout + proc.stderr).splitlines() if "deepspeed-loco active" in line]
    assert len(startup) == 1 and "W=2 (M=1 node x L=2 ranks)" in startup[0], log
    result = json.loads(out.read_text())
    losses, steps = result["losses"], 20
    assert result["world"] == WORLD and result["rank"] == 0 and len(losses) == steps
    _check(result["loco"], steps)
    for said, measure in ACCELERATE_FIGURES:
        last_digit = 10 ** -len(said.split(".")[1])
        assert abs(measure(losses) - float(said)) <= last_digit, (said, losses)
