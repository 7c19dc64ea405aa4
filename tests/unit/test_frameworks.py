"""``deepspeed_loco.install()`` under the Hugging Face Trainer and Accelerate: 2 gloo CPU processes, a tiny model.

Each test is skipped, saying why, when its framework is not installed (``pip install ".[hf]"`` installs both).
"""
import pytest
import torch

from tests.unit.process_pool import ProcessPool

WORLD, STEPS = 2, 3


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


def train_with_accelerate():
    import deepspeed_loco
    deepspeed_loco.install()  # the one line: before the Accelerator builds the engine
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=_ds_config()))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(13, 33), torch.nn.Tanh(), torch.nn.Linear(33, 5))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(_samples(), batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for batch in loader:
        loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "loco": _loco_summary(model)}


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


def test_accelerate_runs_loco_after_install(request):
    pytest.importorskip("accelerate", reason="Accelerate is not installed (pip install \".[hf]\")")
    for result in request.getfixturevalue("pool").run(train_with_accelerate):
        assert len(result["losses"]) >= STEPS  # one optimizer step per batch of this rank's loader
        _check(result["loco"], len(result["losses"]))


def test_hugging_face_trainer_runs_loco_after_install(request, tmp_path):
    pytest.importorskip("transformers", reason="transformers is not installed (pip install \".[hf]\")")
    pytest.importorskip("accelerate", reason="the Trainer's DeepSpeed path needs Accelerate (pip install \".[hf]\")")
    for result in request.getfixturevalue("pool").run(train_with_trainer, tmp_path):
        assert result["global_step"] == STEPS
        _check(result["loco"], STEPS)
