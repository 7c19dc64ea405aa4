"""``import deepspeed_loco`` without turning LoCo on: DeepSpeed's own rejection of ``zeropp_loco_param`` is followed
by one line saying how to turn it on; with ``install()`` the same script trains with LoCo, also through an
``initialize`` it imported before the call. Real processes, real DeepSpeed on the CPU (gloo, one rank); the chain
and the other errors in-process."""
import os
import subprocess
import sys

import pytest
from torch.distributed.elastic.utils.distributed import get_free_port

from deepspeed_loco.utils import turn_on_hint

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
CONFIG = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 3, "zero_quantized_gradients": True, "zeropp_loco_param": {}}}
SCRIPT = """
import sys
from deepspeed import initialize as imported_first  # bound before install(), as a script's top-level import is
import deepspeed_loco
import deepspeed
import torch
from deepspeed_loco.utils import turn_on_hint
print("initialize from", deepspeed.initialize.__module__, "hook", sys.excepthook is turn_on_hint.excepthook, flush=True)
if {install}:
    deepspeed_loco.install()
deepspeed.init_distributed(dist_backend="gloo")
model = torch.nn.Linear(4, 4)
engine, _, _, _ = (imported_first if {early} else deepspeed.initialize)(model=model, model_parameters=model.parameters(), config={config!r})
loss = engine(torch.ones(2, 4)).sum()
engine.backward(loss)
engine.step()
print("loco attached:", deepspeed_loco.loco_hook(engine) is not None, flush=True)
"""
DEEPSPEED_REJECTS = "DeepSpeedConfigError: LoCo-Zero++ has been removed"


def _run_one_rank(tmp_path, install: bool, early: bool = False) -> subprocess.CompletedProcess:
    """The script on one rank: ``install`` calls ``deepspeed_loco.install()``; ``early`` builds the engine with the
    ``initialize`` imported before it."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(install=install, early=early, config=CONFIG))
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
               LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(get_free_port()),
               PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow
def test_imported_but_not_installed_deepspeeds_rejection_is_followed_by_how_to_turn_loco_on(tmp_path):
    done = _run_one_rank(tmp_path, install=False)
    lines = [line.split("]: ", 1)[-1] for line in done.stderr.splitlines()]  # torch's "[rank0]: " prefix off
    assert done.returncode != 0
    assert "initialize from deepspeed hook True" in done.stdout  # the import patched nothing in DeepSpeed
    rejected = next(i for i, line in enumerate(lines) if DEEPSPEED_REJECTS in line)
    assert lines[rejected + 1] == turn_on_hint.HINT, done.stderr[-3000:]
    for way in ("deepspeed_loco.install()", "deepspeed_loco.initialize", "python -m deepspeed_loco.run"):
        assert way in turn_on_hint.HINT


@pytest.mark.slow
@pytest.mark.parametrize("early", [False, True], ids=["deepspeed.initialize", "imported-before-install"])
def test_installed_the_same_script_trains_with_loco_and_no_hint(tmp_path, early):
    done = _run_one_rank(tmp_path, install=True, early=early)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "loco attached: True" in done.stdout and turn_on_hint.HINT not in done.stderr


def _rejection(config):
    from deepspeed.runtime.config import DeepSpeedConfig
    try:
        DeepSpeedConfig(config)
    except Exception as err:  # noqa: BLE001 - the test looks at what DeepSpeed raised
        return err
    raise AssertionError("DeepSpeed accepted the config")


def _raised_from(cause):
    try:
        raise RuntimeError("could not build the engine") from cause
    except RuntimeError as err:
        return err


def _raised_while_handling(context):
    try:
        try:
            raise context
        except Exception:  # noqa: BLE001
            raise KeyError("cleanup failed")
    except KeyError as err:
        return err


def test_the_rejection_is_found_through_the_exception_chain_and_nothing_else_is():
    rejected = _rejection(CONFIG)
    assert turn_on_hint.rejects_loco_key(rejected)
    assert turn_on_hint.rejects_loco_key(_raised_from(rejected))
    assert turn_on_hint.rejects_loco_key(_raised_while_handling(rejected))
    other = _rejection({"train_micro_batch_size_per_gpu": 1, "sparse_attention": {}})  # another removed key
    assert not turn_on_hint.rejects_loco_key(other) and not turn_on_hint.rejects_loco_key(_raised_from(other))
    assert not turn_on_hint.rejects_loco_key(ValueError("zeropp_loco_param"))  # not DeepSpeed's error
    assert not turn_on_hint.rejects_loco_key(None)


@pytest.mark.slow
def test_the_hook_calls_the_one_it_found_and_adds_the_line_only_for_the_rejection(monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(turn_on_hint, "_previous", lambda *args: seen.append(args[1]))
    rejected, other = _rejection(CONFIG), ValueError("something else")
    turn_on_hint.excepthook(type(other), other, None)
    assert capsys.readouterr().err == ""
    turn_on_hint.excepthook(type(rejected), rejected, None)
    assert capsys.readouterr().err == turn_on_hint.HINT + "\n" and seen == [other, rejected]

