"""The LoCo block anywhere but ``zero_optimization.zeropp_loco_param`` fails at ``deepspeed_loco.initialize``, at an
installed ``deepspeed.initialize`` and at an installed ``DeepSpeedConfig`` (``deepspeed.zero.Init``'s path), with one
line naming where it was found and where it belongs; in its place it is taken out and validated as before."""
import pytest
import torch

import deepspeed_loco
from deepspeed_loco.config import LocoConfig, LocoConfigError
from deepspeed_loco.runtime.zero.ds_config import misplaced_blocks, split_loco_config

BLOCK = {"intra_node_bits": 2, "inter_node_bits": 2}
ZERO = {"stage": 3, "zero_quantized_gradients": True}
BASE = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}

# (config, where the message says the block is)
MISPLACED = [
    (dict(BASE, zero_optimization=ZERO, zeropp_loco_param=BLOCK), "the top level of the config"),
    (dict(BASE, zeropp_loco_param=BLOCK), "the top level of the config"),  # zero_optimization missing
    (dict(BASE, zero_optimisation=dict(ZERO, zeropp_loco_param=BLOCK)), "zero_optimisation.zeropp_loco_param"),
    (dict(BASE, zero_optimizations=dict(ZERO, zeropp_loco_param=BLOCK)), "zero_optimizations.zeropp_loco_param"),
    (dict(BASE, zero_optimization=dict(ZERO, offload_param={"device": "cpu", "zeropp_loco_param": BLOCK})),
     "zero_optimization.offload_param.zeropp_loco_param"),
    (dict(BASE, zero_optimization=dict(ZERO, zeropp_loco_param=BLOCK), zeropp_loco_param=BLOCK),
     "the top level of the config"),  # in its place and elsewhere too: which one was meant is not guessed
]
IDS = ["top-level", "no-zero-block", "zero_optimisation", "zero_optimizations", "nested", "twice"]


def _assert_names_the_place(err: LocoConfigError, found: str) -> None:
    message = str(err)
    assert "\n" not in message and f"zeropp_loco_param is at {found}," in message
    assert "it belongs at zero_optimization.zeropp_loco_param" in message


@pytest.fixture
def installed():
    deepspeed_loco.install()
    yield
    deepspeed_loco.uninstall()


@pytest.mark.parametrize("config, found", MISPLACED, ids=IDS)
def test_a_misplaced_block_fails_at_initialize_naming_where_it_belongs(config, found):
    model = torch.nn.Linear(4, 4)
    with pytest.raises(LocoConfigError) as err:
        deepspeed_loco.initialize(model=model, model_parameters=model.parameters(), config=config)
    _assert_names_the_place(err.value, found)


@pytest.mark.parametrize("config, found", MISPLACED, ids=IDS)
def test_a_misplaced_block_fails_at_an_installed_deepspeed_initialize_and_config(installed, config, found):
    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfig

    model = torch.nn.Linear(4, 4)
    with pytest.raises(LocoConfigError) as err:
        deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    _assert_names_the_place(err.value, found)
    with pytest.raises(LocoConfigError) as err:
        DeepSpeedConfig(config)
    _assert_names_the_place(err.value, found)


def test_a_misplaced_block_in_a_json_file_fails_too(tmp_path):
    import json
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(MISPLACED[0][0]))
    model = torch.nn.Linear(4, 4)
    with pytest.raises(LocoConfigError) as err:
        deepspeed_loco.initialize(model=model, model_parameters=model.parameters(), config=str(path))
    _assert_names_the_place(err.value, "the top level of the config")


def test_every_misplaced_block_is_listed_in_the_configs_order():
    config = {"a": [{"zeropp_loco_param": 1}, {"b": {"zeropp_loco_param": 2}}], "zeropp_loco_param": 3,
              "zero_optimization": {"zeropp_loco_param": 4}}
    assert list(misplaced_blocks(config)) == ["a[0].zeropp_loco_param", "a[1].b.zeropp_loco_param",
                                              "zeropp_loco_param"]


def test_the_block_in_its_place_is_taken_out_and_validated():
    stripped, loco = split_loco_config(dict(BASE, zero_optimization=dict(ZERO, zeropp_loco_param=BLOCK)))
    assert loco == LocoConfig(**BLOCK)
    assert stripped == dict(BASE, zero_optimization=ZERO)
    assert split_loco_config(dict(BASE, zero_optimization=ZERO)) == (dict(BASE, zero_optimization=ZERO), None)
