"""benchmarks/engine_error_memory.py: its option grammar, the exact formula against the rate, and the table's
arithmetic (what LoCo adds is the LoCo arm's growth less the plain arm's)."""
import argparse

import pytest

from deepspeed_loco.config import INTER_NODE_ONLY, LocoConfig


def test_options_parse_and_a_bad_one_names_what_is_valid(benchmark_module):
    parse = benchmark_module("engine_error_memory").parse_option
    assert parse("true:8") == (True, 8) and parse("inter_node:4") == (INTER_NODE_ONLY, 4)
    with pytest.raises(argparse.ArgumentTypeError, match="FEEDBACK:BITS .* BITS 4, 8 or 32"):
        parse("inter_node:2")


def test_the_exact_formula_pads_and_the_rate_does_not(benchmark_module):
    module = benchmark_module("engine_error_memory")
    numels = module.tensor_numels("tiny")
    exact, rate = module.formula_bytes(numels, 4, 2, LocoConfig(group_size=64))
    lean, lean_rate = module.formula_bytes(numels, 4, 2, LocoConfig(group_size=64, error_feedback=INTER_NODE_ONLY,
                                                                   error_bits=4))
    by_rate, lean_by_rate = rate * sum(numels), lean_rate * sum(numels)
    assert exact >= by_rate > 0 and lean >= lean_by_rate > 0 and lean < exact


def test_the_table_subtracts_the_plain_arms_growth(benchmark_module):
    module = benchmark_module("engine_error_memory")
    spec = module.RunSpec(model=module.SIZES["tiny"], arms=(), nodes=2, local=2, group_size=64, device="cuda")
    exact, _ = module.formula_bytes(module.tensor_numels("tiny"), 4, 2, LocoConfig(group_size=64))
    plain = {"parameters": 140_000, "cuda_memory_bytes": {"ready": 1000, "trained": 1500, "peak": 9000}}
    loco = {"error_buffer_bytes": exact,
            "cuda_memory_bytes": {"ready": 2000, "trained": 2500 + exact, "peak": 10_000 + 2 * exact}}
    row = module.table("tiny", module.tensor_numels("tiny"), spec, plain, [((True, 8), loco)]).splitlines()[-1].split(" | ")
    assert row[0] == "| true:8" and row[5] == "0"  # held - exact, in bytes
    assert float(row[6]) == pytest.approx(exact / 1e6, abs=0.006) and row[-1] == "1.0000 |"
    assert float(row[7]) == pytest.approx(2 * exact / 1e6, abs=0.006)
