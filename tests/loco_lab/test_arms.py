"""The arms: token grammar, keys and labels (old ones unchanged), DeepSpeed configs, device and backend choice.

``gpus(n)`` (conftest.py) simulates a host with ``n`` CUDA devices.
"""
import dataclasses

import pytest

from loco_lab import cli
from deepspeed_loco.config import LocoConfig
from loco_lab.arms import GRAMMAR, Arm, RunSpec, ds_config, parse_arm, parse_arms, record_arm
from loco_lab.launcher import gpu_sharing_line
from loco_lab.model import SIZES
from loco_lab.run import describe

ISSUE6 = "full,plain4,loco4,plain3,loco3,plain2,loco2"
ISSUE8 = "loco8-4,plain8-2,loco8-2,plain4h,loco4h,loco8-4h,plain8-2h,loco8-2h,plain2h,loco2h"


@pytest.mark.parametrize("token, kind, intra, inter, hadamard, key", [
    ("full", "full", None, None, False, "full"),
    ("plain", "plain", 3, 3, False, "plain3"),  # no width: both hops take the default (3 here)
    ("loco", "loco", 3, 3, False, "loco3"),
    ("plain4", "plain", 4, 4, False, "plain4"),
    ("loco2", "loco", 2, 2, False, "loco2"),
    ("loco8-2", "loco", 8, 2, False, "loco8-2"),
    ("plain2-8", "plain", 2, 8, False, "plain2-8"),
    ("loco4h", "loco", 4, 4, True, "loco4h"),
    ("loco8-2h", "loco", 8, 2, True, "loco8-2h"),
    ("plainh", "plain", 3, 3, True, "plain3h"),
    ("loco8-8", "loco", 8, 8, False, "loco8"),  # equal widths spelled per hop: the canonical key has one
])
def test_valid_tokens(token, kind, intra, inter, hadamard, key):
    arm = parse_arm(token, 3)
    assert (arm.kind, arm.intra_bits, arm.inter_bits, arm.hadamard, arm.seed) == (kind, intra, inter, hadamard, 0)
    assert arm.key == key
    assert parse_arm(arm.key) == arm  # the key names the arm again, without a default width


@pytest.mark.parametrize("token", ["full4", "fullh", "full8-2", "loco16", "loco5", "plain8-1", "loco8-", "loco-2",
                                   "Loco4", "loco4hh", "loco8-2-2", "fast", "h", "loco 4", "loco4H"])
def test_invalid_tokens_name_the_token_and_the_grammar(token):
    with pytest.raises(ValueError) as err:
        parse_arms(f"full,{token}", 4)
    assert repr(token) in str(err.value) and GRAMMAR in str(err.value)


def test_parse_arms_rejects_empty_lists_repeats_and_bad_default_bits():
    with pytest.raises(ValueError, match="no arm given"):
        parse_arms(" , ", 4)
    with pytest.raises(ValueError, match="loco4 given more than once"):
        parse_arms("loco,loco4", 4)
    with pytest.raises(ValueError, match="default bits 5"):
        parse_arms("full", 5)
    with pytest.raises(ValueError, match="'loco' has no width"):
        parse_arm("loco")


def test_arm_checks_its_fields():
    with pytest.raises(ValueError, match="no bit widths"):
        Arm("full", 4, 4)
    with pytest.raises(ValueError, match="no bit widths and no Hadamard"):
        Arm("full", hadamard=True)
    with pytest.raises(ValueError, match="intra_bits = None"):
        Arm("loco")
    with pytest.raises(ValueError, match="inter_bits = 5"):
        Arm("plain", 4, 5)
    with pytest.raises(ValueError, match="kind 'fast'"):
        Arm("fast")


def test_issue6_keys_and_labels_are_the_old_ones():
    """benchmarks/results/convergence/runs.jsonl holds runs under these keys and labels: they must not change."""
    arms = parse_arms(ISSUE6, 4)
    assert [a.key for a in arms] == ISSUE6.split(",")
    assert [a.label for a in arms] == ["full precision", "qgZ 4-bit", "qgZ 4-bit + LoCo", "qgZ 3-bit",
                                       "qgZ 3-bit + LoCo", "qgZ 2-bit", "qgZ 2-bit + LoCo"]
    assert [a.key for a in parse_arms("full,plain,loco", 8)] == ["full", "plain8", "loco8"]


def test_issue8_keys_and_labels():
    arms = parse_arms(ISSUE8, 4)
    assert [a.key for a in arms] == ISSUE8.split(",")
    labels = {a.key: a.label for a in arms}
    assert labels["loco8-4"] == "qgZ 8/4-bit + LoCo"
    assert labels["plain8-2"] == "qgZ 8/2-bit"
    assert labels["plain4h"] == "qgZ 4-bit + Hadamard"
    assert labels["loco8-2h"] == "qgZ 8/2-bit + LoCo + Hadamard"
    assert len(set(labels.values())) == len(arms)


def test_to_dict_carries_per_hop_bits_and_hadamard():
    arm = dataclasses.replace(parse_arm("loco8-2h"), seed=3)
    assert arm.to_dict() == {"kind": "loco", "intra_bits": 8, "inter_bits": 2, "hadamard": True, "seed": 3}


def test_record_arm_reads_old_and_new_records():
    old = {"arm": {"kind": "loco", "bits": 2, "seed": 1}, "key": "loco2", "label": "qgZ 2-bit + LoCo"}
    assert record_arm(old) == Arm("loco", 2, 2, False, seed=1)
    assert record_arm({"arm": {"kind": "full", "bits": 4, "seed": 0}, "key": "full"}) == Arm("full")
    arm = dataclasses.replace(parse_arm("plain8-2h"), seed=2)
    assert record_arm({"arm": arm.to_dict(), "key": arm.key}) == arm


@pytest.mark.parametrize("token", ["plain4", "loco2", "loco8-2", "plain8-4h", "loco2h", "loco3"])
def test_ds_config_per_hop_bits_and_hadamard_pass_the_real_config(token):
    arm = parse_arm(token)
    spec = RunSpec(model=SIZES["tiny"], arms=(arm, ), group_size=128, local=2)
    zero = ds_config(spec, arm)["zero_optimization"]
    assert zero["stage"] == 3 and zero["zero_quantized_gradients"] is True
    config = LocoConfig.from_dict(zero["zeropp_loco_param"])
    assert (config.intra_node_bits, config.inter_node_bits, config.hadamard) == (arm.intra_bits, arm.inter_bits,
                                                                                  arm.hadamard)
    assert config.error_feedback is (arm.kind == "loco")
    assert (config.group_size, config.local_world_size) == (128, 2)


def test_ds_config_takes_loco_settings_over_the_spec_and_keeps_plain_arms_plain():
    spec = RunSpec(model=SIZES["tiny"], arms=(), err_beta=0.8,
                   loco_settings=(("error_bits", 4), ("error_feedback", "inter_node"), ("err_beta", 0.5)))
    loco = LocoConfig.from_dict(ds_config(spec, parse_arm("loco2"))["zero_optimization"]["zeropp_loco_param"])
    assert (loco.error_bits, loco.error_feedback, loco.err_beta) == (4, "inter_node", 0.5)
    plain = LocoConfig.from_dict(ds_config(spec, parse_arm("plain2"))["zero_optimization"]["zeropp_loco_param"])
    assert plain.error_feedback is False and plain.err_beta == 0.5


def test_ds_config_of_full_has_no_loco_block():
    spec = RunSpec(model=SIZES["tiny"], arms=(Arm("full"), ))
    zero = ds_config(spec, Arm("full"))["zero_optimization"]
    assert "zeropp_loco_param" not in zero and "zero_quantized_gradients" not in zero


def test_run_spec_checks_device_and_backend():
    RunSpec(model=SIZES["tiny"], arms=(), device="cuda", backend="gloo")
    with pytest.raises(ValueError, match="'nccl' needs device 'cuda'"):
        RunSpec(model=SIZES["tiny"], arms=(), device="cpu", backend="nccl")
    with pytest.raises(ValueError, match="backend 'mpi'"):
        RunSpec(model=SIZES["tiny"], arms=(), backend="mpi")


@pytest.mark.parametrize("count, device, backend", [
    (0, "cpu", "gloo"),  # CPU-only machine: unchanged
    (1, "cpu", "gloo"),  # auto takes CUDA only with a GPU per rank
    (4, "cuda", "nccl"),
])
def test_auto_device_and_backend(gpus, count, device, backend):
    gpus(count)
    assert cli.resolve_device("auto", 4) == device
    assert cli.resolve_backend("auto", device, 4) == backend


def test_cuda_with_fewer_gpus_than_ranks_shares_them_over_gloo(gpus):
    gpus(1)
    assert cli.resolve_device("cuda", 4) == "cuda"
    assert cli.resolve_backend("auto", "cuda", 4) == "gloo"
    assert cli.resolve_backend("gloo", "cuda", 4) == "gloo"
    with pytest.raises(ValueError, match="NCCL refuses two ranks on one GPU"):
        cli.resolve_backend("nccl", "cuda", 4)
    gpus(4)
    assert cli.resolve_backend("gloo", "cuda", 4) == "gloo"  # asked for: gloo with a GPU per rank
    assert cli.resolve_backend("nccl", "cuda", 4) == "nccl"


def test_cuda_and_nccl_need_gpus(gpus):
    gpus(0)
    with pytest.raises(ValueError, match="no CUDA GPU"):
        cli.resolve_device("cuda", 4)
    with pytest.raises(ValueError, match="--backend nccl needs CUDA"):
        cli.resolve_backend("nccl", "cpu", 4)
    assert cli.resolve_backend("gloo", "cpu", 4) == "gloo"


def test_sharing_line_only_when_ranks_share(gpus):
    spec = RunSpec(model=SIZES["tiny"], arms=(), nodes=3, local=2, device="cuda", backend="gloo")
    line = gpu_sharing_line(spec, 4)
    assert line.startswith("GPU sharing: 6 ranks on 4 GPUs, rank r on GPU r % 4 (up to 2 per GPU)")
    assert "through gloo" in line
    assert gpu_sharing_line(spec, 6) is None
    assert gpu_sharing_line(dataclasses.replace(spec, device="cpu"), 0) is None
    gpus(1)
    text = describe(dataclasses.replace(spec, nodes=2))
    assert "gloo on CUDA" in text and text.splitlines()[-1].startswith("GPU sharing: 4 ranks on 1 GPU, rank r on GPU")


def _demo_args(*flags):
    parser = cli.argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    cli._demo_parser(sub)
    return parser.parse_args(["demo", "--model-size", "tiny", *flags])


def test_cli_arms_and_backend(gpus):
    gpus(0)
    spec = cli.spec_from_args(_demo_args("--arms", "full,loco,loco8-2h", "--bits", "3"))
    assert [a.key for a in spec.arms] == ["full", "loco3", "loco8-2h"]
    assert (spec.device, spec.backend, spec.dtype) == ("cpu", "gloo", "fp32")
    with pytest.raises(ValueError, match="--arms: arm .loco9. is invalid"):
        cli.spec_from_args(_demo_args("--arms", "full,loco9"))
    gpus(2)
    spec = cli.spec_from_args(_demo_args("--device", "cuda"))
    assert (spec.device, spec.backend, spec.dtype) == ("cuda", "gloo", "bf16")
    assert cli.spec_from_args(_demo_args()).device == "cuda"  # the simulated cluster needs one GPU
    assert cli.spec_from_args(_demo_args("--engine", "deepspeed")).device == "cpu"  # workers want one GPU each
