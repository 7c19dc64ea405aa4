"""The demo's arms and command line: arm tokens to DeepSpeed configs, flags to the run spec."""
import pytest

from loco_lab import cli
from loco_lab.arms import RunSpec, ds_config, parse_arms
from loco_lab.model import SIZES


def test_parse_arms_and_configs():
    arms = parse_arms("full, plain, loco2", 4)
    assert [a.key for a in arms] == ["full", "plain4", "loco2"]
    with pytest.raises(ValueError):
        parse_arms("full4", 4)
    with pytest.raises(ValueError):
        parse_arms("fast", 4)
    spec = RunSpec(model=SIZES["tiny"], arms=arms)
    full = ds_config(spec, arms[0])["zero_optimization"]
    assert full["stage"] == 3 and "zeropp_loco_param" not in full and "zero_quantized_gradients" not in full
    plain = ds_config(spec, arms[1])["zero_optimization"]
    assert plain["zero_quantized_gradients"] is True
    assert plain["zeropp_loco_param"]["error_feedback"] is False and plain["zeropp_loco_param"]["intra_node_bits"] == 4
    loco = ds_config(spec, arms[2])["zero_optimization"]["zeropp_loco_param"]
    assert loco["error_feedback"] is True and loco["inter_node_bits"] == 2 and loco["local_world_size"] == 2


def test_cli_flags_to_spec():
    parser = cli.argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    cli._demo_parser(sub)
    args = parser.parse_args(["demo", "--steps", "7", "--model-size", "tiny", "--dim", "48", "--bits", "2",
                              "--nodes", "3", "--device", "cpu", "--seeds", "4", "5", "--engine", "deepspeed"])
    spec = cli.spec_from_args(args)
    assert spec.steps == 7 and spec.model.dim == 48 and spec.model.layers == SIZES["tiny"].layers
    assert spec.world_size == 6 and spec.device == "cpu" and spec.backend == "gloo" and spec.dtype == "fp32"
    assert [a.key for a in spec.arms] == ["full", "plain2", "loco2"]
    assert args.seeds == [4, 5] and args.engine == "deepspeed"
    defaults = parser.parse_args(["demo"])
    assert defaults.seeds == [0, 1, 2] and defaults.engine == "simulated"
    with pytest.raises(ValueError, match="--dim 30 must be a multiple of --heads 4"):
        cli.spec_from_args(parser.parse_args(["demo", "--dim", "30", "--heads", "4"]))
