import pytest

from deepspeed_loco.config import LocoConfig, LocoConfigError


def test_defaults_match_upstream_for_the_upstream_keys():
    cfg = LocoConfig.from_dict({})
    assert (cfg.err_beta, cfg.reset_T) == (0.8, 1024)
    assert (cfg.intra_node_bits, cfg.inter_node_bits, cfg.error_bits, cfg.error_feedback) == (4, 4, 8, True)


def test_upstream_config_is_accepted_unchanged():
    cfg = LocoConfig.from_dict({"err_beta": 0.9, "reset_T": 2048})
    assert (cfg.err_beta, cfg.reset_T) == (0.9, 2048)


@pytest.mark.parametrize("key,value,hint", [
    ("err_beta", 1.0, "0 <= err_beta < 1"),
    ("err_beta", -0.1, "0 <= err_beta < 1"),
    ("err_beta", "0.8", "0 <= err_beta < 1"),
    ("reset_T", 0, "integer >= 1"),
    ("reset_T", 10.5, "integer >= 1"),
    ("reset_T", True, "integer >= 1"),
    ("intra_node_bits", 5, "(2, 3, 4, 8)"),
    ("inter_node_bits", 1, "(2, 3, 4, 8)"),
    ("group_size", 100, "power of two from 32 to 4096"),
    ("group_size", 8192, "power of two from 32 to 4096"),
    ("error_bits", 16, "(4, 8, 32)"),
    ("error_feedback", "yes", "true, false or \"inter_node\""),
    ("error_feedback", 1, "true, false or \"inter_node\""),
    ("checkpoint_error_state", "no", "true or false"),
    ("hadamard", 1, "true or false"),
    ("exact_own_block", "true", "true or false"),
    ("exact_own_block", 0, "true or false"),
    ("local_world_size", 0, "integer >= 1"),
    ("on_corrupt_checkpoint", "ignore", '"error" or "reset"'),
    ("on_corrupt_checkpoint", None, '"error" or "reset"'),
    ("rho_every", -1, "integer >= 0 (optimizer steps between measurements; 0: off)"),
    ("rho_every", 2.0, "integer >= 0"),
    ("rho_log_every", -5, "integer >= 0 (optimizer steps between log lines; 0: never)"),
    ("rho_log_every", False, "integer >= 0"),
    ("telemetry_every", 0, "integer >= 1 (optimizer steps between writes of the byte counts)"),
    ("telemetry_every", 1.5, "integer >= 1"),
])
def test_bad_value_names_the_key_and_what_is_valid(key, value, hint):
    with pytest.raises(LocoConfigError) as err:
        LocoConfig.from_dict({key: value})
    assert f"zeropp_loco_param.{key} = {value!r}" in str(err.value) and hint in str(err.value)


def test_unknown_key_is_an_error_listing_the_valid_keys():
    with pytest.raises(LocoConfigError, match=r"unknown key\(s\) \['err_betta'\].*'err_beta'"):
        LocoConfig.from_dict({"err_betta": 0.8})


def test_non_mapping_is_an_error():
    with pytest.raises(LocoConfigError, match="must be a JSON object"):
        LocoConfig.from_dict([0.8])


def test_exact_own_block_is_off_by_default_and_takes_a_boolean():
    assert LocoConfig().exact_own_block is False
    assert LocoConfig.from_dict({"exact_own_block": True}).exact_own_block is True


def test_on_corrupt_checkpoint_defaults_to_error_and_accepts_reset():
    assert LocoConfig.from_dict({}).on_corrupt_checkpoint == "error"
    assert LocoConfig.from_dict({"on_corrupt_checkpoint": "reset"}).on_corrupt_checkpoint == "reset"


@pytest.mark.parametrize("value", ["auto", "symmetric", "midrise"])
def test_quant_grid_accepts_auto_and_both_grids_and_defaults_to_auto(value):
    assert LocoConfig.from_dict({}).quant_grid == "auto"
    assert LocoConfig.from_dict({"quant_grid": value}).quant_grid == value


@pytest.mark.parametrize("value", ["asymmetric", None, 1])
def test_quant_grid_rejects_anything_else(value):
    with pytest.raises(LocoConfigError) as err:
        LocoConfig.from_dict({"quant_grid": value})
    assert f'zeropp_loco_param.quant_grid = {value!r} is invalid: it must be "auto", "symmetric" or "midrise"' in str(err.value)


def test_every_bad_key_is_named_in_one_error():
    with pytest.raises(LocoConfigError) as err:
        LocoConfig.from_dict({"err_beta": 2, "group_size": 100, "reset_t": 5})
    message = str(err.value)
    assert "unknown key(s) ['reset_t']" in message
    assert "zeropp_loco_param.err_beta = 2" in message and "zeropp_loco_param.group_size = 100" in message


def test_keyword_construction_validates_too_and_the_config_is_immutable():
    with pytest.raises(LocoConfigError, match=r"zeropp_loco_param\.error_bits = 16"):
        LocoConfig(error_bits=16)
    cfg = LocoConfig(group_size=64)
    with pytest.raises(Exception):
        cfg.group_size = 128
    assert cfg.group_size == 64 and hash(cfg) == hash(LocoConfig(group_size=64))


def test_to_dict_round_trips_every_key():
    cfg = LocoConfig.from_dict({"err_beta": 0.5, "local_world_size": 2, "quant_grid": "midrise", "hadamard": True})
    assert LocoConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.to_dict()["local_world_size"] == 2 and cfg.to_dict()["err_beta"] == 0.5


def test_live_rho_defaults_measure_every_10_steps_and_log_every_100_and_telemetry_writes_every_10():
    cfg = LocoConfig()
    assert (cfg.rho_every, cfg.rho_log_every, cfg.telemetry_every) == (10, 100, 10)
    assert (LocoConfig(rho_every=0, rho_log_every=0).rho_every, LocoConfig(rho_every=1).rho_every) == (0, 1)


@pytest.mark.parametrize("zero,expected", [
    ({"stage": 3}, "zero_optimization.zero_quantized_gradients is not set: set \"zero_quantized_gradients\": true"),
    ({"stage": 3, "zero_quantized_gradients": None}, "zero_quantized_gradients = None: set"),
    ({"stage": 3, "zero_quantized_gradients": False}, "zero_quantized_gradients = False: set"),
])
def test_loco_without_qgz_says_what_it_found(zero, expected):
    from deepspeed_loco.runtime.zero.ds_config import split_loco_config
    with pytest.raises(LocoConfigError) as err:
        split_loco_config({"zero_optimization": {**zero, "zeropp_loco_param": {}}})
    assert expected in str(err.value)


@pytest.mark.parametrize("hpz,world,local", [(0, 4, 2), (1, 6, 3), (2, 4, 2), (2, 16, 8), (8, 16, 8), (3, 6, 3)])
def test_hpz_partitions_inside_the_nodes_are_accepted(hpz, world, local):
    from deepspeed_loco.runtime.comm.topology import check_hpz_partition
    check_hpz_partition(hpz, world, local)


@pytest.mark.parametrize("hpz,world,local,expected", [
    (3, 2, 2, "zero_optimization.zero_hpz_partition_size = 3 does not divide the world size 2: set it to 1 (off) "
              "or a divisor of 2, the ranks per node"),
    (3, 8, 4, "zero_hpz_partition_size = 3 does not divide the world size 8"),
    (4, 8, 2, "zero_hpz_partition_size = 4 does not fit the node layout (M=4 nodes x L=2 ranks): a partition of 4 "
              "ranks would span nodes"),
    (4, 12, 6, "zero_hpz_partition_size = 4 does not fit the node layout (M=2 nodes x L=6 ranks)"),
])
def test_hpz_partition_that_does_not_fit_is_a_clear_error(hpz, world, local, expected):
    from deepspeed_loco.runtime.comm.topology import check_hpz_partition
    with pytest.raises(LocoConfigError) as err:
        check_hpz_partition(hpz, world, local)
    assert expected in str(err.value)
