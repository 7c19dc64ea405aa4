"""examples/megatron (and benchmarks/device_megatron.sh) on CPU.

Always: the launch script's DeepSpeed config (ZeRO-3 + qgZ + ``zeropp_loco_param``, through this package's config
validation and DeepSpeed's own) and its command line (DRY_RUN=1), the ``deepspeed.compression.compress`` stand-in,
the PyTorch Apex stand-in, the torchvision stand-in and the example's requirements file. With a Megatron-DeepSpeed
checkout (``$MEGATRON_DEEPSPEED``, else ``.megatron`` in the repository root; see docs/frameworks.md: CI cannot fetch
one) and what it imports (examples/megatron/requirements.txt, a C++ compiler and make): its unmodified
``pretrain_gpt.py`` for 3 iterations on 2 gloo CPU processes through the module runner, the library's reduce active
(the defaults' plain qgZ, and LoCo at 2 bits); skipped, saying why, otherwise.
"""
import importlib
import inspect
import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from torch.distributed.elastic.utils.distributed import get_free_port

from deepspeed_loco.config import LocoConfigError
from deepspeed_loco.runtime.zero.ds_config import split_loco_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(REPO, "examples", "megatron")
SCRIPT = os.path.join(EXAMPLE, "ds_pretrain_gpt_tiny_loco.sh")
COMPAT = os.path.join(EXAMPLE, "compat")
STANDIN = os.path.join(COMPAT, "apex_standin")
TORCHVISION_STANDIN = os.path.join(COMPAT, "torchvision_standin")
MEGATRON = os.environ.get("MEGATRON_DEEPSPEED") or os.path.join(REPO, ".megatron")
# examples/megatron/requirements.txt's packages, by the module each installs
REQUIREMENTS = {"six": "six", "pybind11": "pybind11", "regex": "regex", "einops": "einops",
                "transformers": "transformers", "pillow": "PIL", "numpy": "numpy"}


def _dry_run(tmp_path, **env):
    """Runs the launch script with DRY_RUN=1 against a stub checkout; returns (DeepSpeed config, command line)."""
    megatron = tmp_path / "megatron"
    megatron.mkdir(exist_ok=True)
    (megatron / "pretrain_gpt.py").write_text("")
    out = tmp_path / "out"
    proc = subprocess.run(["bash", SCRIPT], env=dict(os.environ, MEGATRON=str(megatron), OUTPUT_DIR=str(out),
                                                     DRY_RUN="1", **env),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    config_path = lines[0].split("=", 1)[1]
    with open(config_path) as f:
        return json.load(f), lines[-1], str(megatron)


@pytest.mark.parametrize("shell_script", [SCRIPT, os.path.join(REPO, "benchmarks", "device_megatron.sh")])
def test_shell_scripts_parse(shell_script):
    proc = subprocess.run(["bash", "-n", shell_script], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("env,world,bits,error_feedback", [
    ({}, 1, 4, False),  # the README's recommended 4/4 config
    ({"NUM_GPUS": "2", "LOCO_BITS": "2", "ERROR_FEEDBACK": "true"}, 2, 2, True)])
def test_launch_script_writes_a_zero3_qgz_loco_config_and_runs_pretrain_gpt_through_the_runner(tmp_path, env, world,
                                                                                              bits, error_feedback):
    config, command, megatron = _dry_run(tmp_path, **env)
    zero = config["zero_optimization"]
    assert zero["stage"] == 3 and zero["zero_quantized_gradients"] is True
    stripped, loco = split_loco_config(config)  # this package's validation of zeropp_loco_param
    assert loco is not None and loco.intra_node_bits == loco.inter_node_bits == bits and loco.group_size == 256
    assert loco.error_feedback is error_feedback
    assert "zeropp_loco_param" not in stripped["zero_optimization"]
    from deepspeed.runtime.config import DeepSpeedConfig
    ds = DeepSpeedConfig(stripped)  # what stock DeepSpeed makes of the rest (one process here)
    assert ds.zero_optimization_stage == 3 and ds.zero_config.zero_quantized_gradients
    assert config["train_batch_size"] == 4 * world and config["train_micro_batch_size_per_gpu"] == 4
    assert f"-m deepspeed.launcher.runner --num_nodes 1 --num_gpus {world} " in command
    assert f"--module deepspeed_loco.run {megatron}/pretrain_gpt.py " in command
    for flag in ("--deepspeed", "--no-pipeline-parallel", "--zero-stage=3", "--deepspeed_config=",
                 "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
                 "--no-gradient-accumulation-fusion", "--tokenizer-type NullTokenizer",
                 f"--global-batch-size {4 * world}"):
        assert flag in command, flag


def test_launch_script_config_with_a_bad_loco_value_is_rejected_by_validation(tmp_path):
    config, _, _ = _dry_run(tmp_path, GROUP_SIZE="48")
    with pytest.raises(LocoConfigError, match="group_size"):
        split_loco_config(config)


@pytest.mark.slow
def test_compression_stand_in_and_the_next_sitecustomize(tmp_path):
    """``compat/sitecustomize.py``: ``deepspeed.compression.compress`` imports (gone from DeepSpeed 0.19), calling it
    says why; the environment's own sitecustomize (next on the path) still runs."""
    (tmp_path / "sitecustomize.py").write_text("import os\nos.environ['NEXT_SITECUSTOMIZE_RAN'] = '1'\n")
    code = ("import os\n"
            "from deepspeed.compression.compress import init_compression, redundancy_clean\n"
            "assert os.environ.get('NEXT_SITECUSTOMIZE_RAN') == '1'\n"
            "try:\n    init_compression(None, {}, None)\nexcept NotImplementedError as e:\n    print('raised:', e)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([COMPAT, str(tmp_path), REPO]))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "raised: DeepSpeed >= 0.19 has no compression library" in proc.stdout


@pytest.fixture
def apex_standin(monkeypatch):
    """The stand-in's modules, imported from its folder, and gone from ``sys.modules`` afterwards."""
    names = ("apex", "amp_C", "fused_layer_norm_cuda")
    monkeypatch.syspath_prepend(STANDIN)
    for name in list(sys.modules):
        if name.split(".")[0] in names:
            monkeypatch.delitem(sys.modules, name)
    modules = {name: importlib.import_module(name) for name in
               ("apex.optimizers", "apex.normalization", "apex.normalization.fused_layer_norm",
                "apex.multi_tensor_apply", "amp_C", "fused_layer_norm_cuda")}
    assert modules["amp_C"].__file__.startswith(STANDIN)
    yield modules
    for name in list(sys.modules):
        if name.split(".")[0] in names:
            del sys.modules[name]


def test_apex_stand_in_layer_norm_is_torch_layer_norm_with_apex_signature(apex_standin):
    fn = apex_standin["apex.normalization.fused_layer_norm"].FusedLayerNormAffineFunction
    assert "memory_efficient" in inspect.getfullargspec(fn.forward).args  # what Megatron inspects
    torch.manual_seed(0)
    x = torch.randn(3, 5, 8, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    b = torch.randn(8, requires_grad=True)
    out = fn.apply(x, w, b, torch.Size([8]), 1e-5, True)
    ref = torch.nn.functional.layer_norm(x, (8,), w, b, 1e-5)
    torch.testing.assert_close(out, ref)
    out.sum().backward()
    assert x.grad is not None and w.grad is not None and b.grad is not None
    rms = apex_standin["apex.normalization"].MixedFusedRMSNorm(8, eps=1e-6)
    y = x.detach()
    torch.testing.assert_close(rms(y), y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6))


def test_apex_stand_in_fused_adam_is_exactly_a_zero_supported_torch_optimizer(apex_standin):
    fused_adam = apex_standin["apex.optimizers"].FusedAdam
    params = [torch.nn.Parameter(torch.ones(4))]
    opt = fused_adam(params, lr=0.1, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    assert type(opt) is torch.optim.AdamW  # DeepSpeed's ZeRO accepts client optimizers by exact type
    assert opt.defaults["betas"] == (0.9, 0.95) and opt.defaults["weight_decay"] == 0.1
    assert type(fused_adam(params, adam_w_mode=False)) is torch.optim.Adam
    assert type(apex_standin["apex.optimizers"].FusedSGD(params, lr=0.1, momentum=0.9)) is torch.optim.SGD


def test_apex_stand_in_multi_tensor_ops(apex_standin):
    applier = apex_standin["apex.multi_tensor_apply"].multi_tensor_applier
    amp_c = apex_standin["amp_C"]
    src = [torch.tensor([1.0, -2.0]), torch.tensor([3.0])]
    dst = [torch.zeros(2), torch.zeros(1)]
    flag = torch.zeros(1, dtype=torch.int)
    applier(amp_c.multi_tensor_scale, flag, [src, dst], 0.5)
    assert dst[0].tolist() == [0.5, -1.0] and dst[1].tolist() == [1.5] and flag.item() == 0
    applier(amp_c.multi_tensor_scale, flag, [[torch.tensor([math.inf])], [torch.zeros(1)]], 1.0)
    assert flag.item() == 1
    total, per_tensor = applier(amp_c.multi_tensor_l2norm, flag, [src], True)
    assert math.isclose(total.item(), math.sqrt(14.0), rel_tol=1e-6)
    torch.testing.assert_close(per_tensor, torch.tensor([math.sqrt(5.0), 3.0]))


def test_requirements_file_lists_what_the_skip_check_looks_for():
    with open(os.path.join(EXAMPLE, "requirements.txt")) as f:
        listed = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    assert listed == list(REQUIREMENTS)


def test_torchvision_stand_in_imports_as_megatron_does_and_refuses_use():
    """``import torchvision.transforms as T``, ``from torchvision import datasets`` and a subclass of
    ``VisionDataset`` at import time (Megatron's vision modules); constructing any other name says it is the
    stand-in."""
    code = ("import torchvision.transforms as T\n"
            "from torchvision import datasets\n"
            "from torchvision.datasets import VisionDataset\n"
            "class Folder(VisionDataset):\n    pass\n"
            "Folder()\n"
            "assert T.Compose.__name__ == 'Compose' and T.Compose.__module__ == 'torchvision.transforms'\n"
            "try:\n    T.Compose([])\nexcept NotImplementedError as e:\n    print('raised:', e)\n")
    env = dict(os.environ, PYTHONPATH=TORCHVISION_STANDIN)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "raised: torchvision.transforms.Compose: examples/megatron/compat/torchvision_standin is a stand-in" \
        in proc.stdout


def _megatron_missing():
    if not os.path.isfile(os.path.join(MEGATRON, "pretrain_gpt.py")):
        return f"no Megatron-DeepSpeed checkout at {MEGATRON} (set MEGATRON_DEEPSPEED; docs/frameworks.md)"
    for module in REQUIREMENTS.values():
        if importlib.util.find_spec(module) is None:
            return (f"Megatron-DeepSpeed needs {module}, which is not installed "
                    f"(pip install -r examples/megatron/requirements.txt)")
    if shutil.which("make") is None or shutil.which("g++") is None:
        return "Megatron-DeepSpeed builds its dataset helpers with make and g++"
    return None


@pytest.mark.parametrize("settings,mode", [
    ({}, "plain qgZ (error feedback off)"),  # the documented command: the README's 4/4 config
    ({"LOCO_BITS": "2", "ERROR_FEEDBACK": "true"}, "LoCo error feedback")])
@pytest.mark.slow
def test_unmodified_pretrain_gpt_trains_through_the_library_on_two_cpu_ranks(tmp_path, settings, mode):
    """The example script end to end: data written offline, 3 iterations, the runner's start-up line (W=2)."""
    missing = _megatron_missing()
    if missing:
        pytest.skip(missing)
    site = tmp_path / "site"
    site.mkdir()
    # DeepSpeed's CPU shared-memory op (a JIT C++ build of minutes) is unused here: skip it, outside the scripts
    (site / "sitecustomize.py").write_text(
        "import deepspeed.ops\ndeepspeed.ops.__compatible_ops__['deepspeed_shm_comm'] = False\n")
    # torchvision: the launch script's own stand-in (compat/torchvision_standin) when the real one does not import
    env = dict(os.environ, MEGATRON=MEGATRON, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", NUM_GPUS="2",
               TRAIN_ITERS="3", MASTER_PORT=str(get_free_port()), OUTPUT_DIR=str(tmp_path / "out"),
               PYTHONPATH=str(site), **settings)
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        env.pop(name, None)
    proc = subprocess.run(["bash", SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    startup = [line for line in output.splitlines() if "deepspeed-loco active" in line]
    assert len(startup) == 1 and f"active: {mode}; W=2 (M=1 node x L=2 ranks)" in startup[0], output[-6000:]
    losses = [float(m) for m in re.findall(r"iteration +\d+/ +3 \|.*?lm loss: ([0-9.E+-]+)", output)]
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses), output[-6000:]
