"""benchmarks/compensation_variants.py: the 'bounded' rule against the library's rule and its own contract."""
import json
import os
import subprocess
import sys

import pytest
import torch

from deepspeed_loco.ops import loco_reference
from deepspeed_loco.ops.error_buffer import ErrorBuffer
from deepspeed_loco.ops.quantizer import dequantize_groups

GROUP = 64
GRIDS = ("symmetric", "midrise")


@pytest.fixture(scope="module")
def variants(benchmark_module):
    return benchmark_module("compensation_variants")


def _gradient(seed: int) -> torch.Tensor:
    return torch.randn(3, 4 * GROUP, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("error_bits", (8, 32))
def test_with_no_remembered_error_it_is_the_library_rule_bit_for_bit(variants, grid, error_bits):
    x = _gradient(0)
    ours, library = (ErrorBuffer.zeros(3, 4 * GROUP, GROUP, error_bits, "cpu") for _ in range(2))
    codes, scale = variants.bounded(x.clone(), ours, 0.8, 2, GROUP, grid)
    library_codes, library_scale = loco_reference.compensate_and_quantize(x.clone(), library, 0.8, 2, GROUP, grid)
    assert torch.equal(codes, library_codes) and torch.equal(scale, library_scale)
    assert torch.equal(ours.values, library.values)


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("bits", (2, 4))
def test_no_value_sent_exceeds_the_gradients_own_group_range(variants, grid, bits):
    x = _gradient(1)
    error = ErrorBuffer.zeros(3, 4 * GROUP, GROUP, 32, "cpu")
    error.store_(20 * _gradient(2))  # a remembered error far larger than the gradient: the burst's situation
    codes, scale = variants.bounded(x, error, 0.8, bits, GROUP, grid)
    sent = dequantize_groups(codes, scale, GROUP, grid)
    assert (sent.abs() <= variants.group_range(x, GROUP) * (1 + 2**-20)).all()
    library_error = ErrorBuffer.zeros(3, 4 * GROUP, GROUP, 32, "cpu")
    library_error.store_(20 * _gradient(2))
    library_sent = dequantize_groups(*loco_reference.compensate_and_quantize(x, library_error, 0.8, bits, GROUP, grid),
                                     GROUP, grid)
    assert library_sent.abs().max() > 5 * x.abs().max()  # the library's rule does send the burst


@pytest.mark.parametrize("grid", GRIDS)
def test_the_clipped_part_stays_in_the_buffer(variants, grid):
    """beta = 0, fp32 buffer: what is sent plus what is remembered is the compensated value, nothing dropped."""
    x, old = _gradient(3), 10 * _gradient(4)
    error = ErrorBuffer.zeros(3, 4 * GROUP, GROUP, 32, "cpu")
    error.store_(old)
    codes, scale = variants.bounded(x, error, 0.0, 2, GROUP, grid)
    sent = dequantize_groups(codes, scale, GROUP, grid)
    torch.testing.assert_close(sent + error.values, x + old, rtol=0, atol=1e-5)
    assert error.values.abs().max() > x.abs().max()  # more than one group range is still owed


def test_install_replaces_the_rule_and_forces_the_reference_kernels(variants, monkeypatch):
    monkeypatch.setattr(loco_reference, "compensate_and_quantize", loco_reference.compensate_and_quantize)
    monkeypatch.setenv("DS_LOCO_KERNELS", "auto")
    variants.install("none")
    assert loco_reference.compensate_and_quantize is variants.LIBRARY_RULE
    variants.install("bounded")
    assert loco_reference.compensate_and_quantize is variants.bounded
    assert os.environ["DS_LOCO_KERNELS"] == "reference"
    with pytest.raises(ValueError, match="--variant 'clipped'.*bounded"):
        variants.install("clipped")


def test_convergence_sim_runs_a_variant_on_the_reference_kernels_and_records_it(tmp_path):
    """``convergence_sim.py run --variant bounded`` end to end (tiny model, 2 steps, 2 x 2 virtual ranks on CPU)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / "runs.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("DS_LOCO_KERNELS", None)
    subprocess.run([sys.executable, os.path.join(root, "benchmarks", "convergence_sim.py"), "run", "--device", "cpu",
                    "--arm", "loco2", "--variant", "bounded", "--size", "tiny", "--steps", "2", "--micro-batch", "2",
                    "--warmup", "1", "--eval-every", "2", "--eval-windows", "4", "--tag", "t_bounded", "--out",
                    str(out)], check=True, env=env, cwd=tmp_path, capture_output=True, timeout=300)
    (record, ) = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["setup"]["variant"] == "bounded" and record["setup"]["kernels"] == "loco_reference"
    assert record["key"] == "loco2" and record["final_val_loss"] > 0
