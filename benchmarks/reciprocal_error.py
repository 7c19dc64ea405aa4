"""How the quantization error differs between the IEEE quotient and DeepSpeed's product (CPU, no kernel involved).

Until the fifteenth session the contract quantized the IEEE quotient ``c / scale`` (four instructions in the
kernels); since then it multiplies by the group's reciprocal, ``c * fl(1 / scale)`` (one instruction), as DeepSpeed
does. This script measured the difference that decided it: on the same groups, how often the two give a different
code and whether the error ``|c - value|`` (relative to the scale) or its RMS grows: random groups (normal,
lognormal magnitudes, values rounded to bf16, which put many ratios exactly on a rounding boundary) and the
adversarial groups of ``tests/unit/ops/adversarial.py``. It changes nothing;
``deepspeed_loco/csrc/quantization/README.md`` ("The reciprocal question") quotes it.

    PYTHONPATH=$PWD python3 benchmarks/reciprocal_error.py
"""
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "unit" / "ops"))

from deepspeed_loco.ops.quantizer import grid_levels  # noqa: E402
from adversarial import adversarial_groups  # noqa: E402

GROUP = 256


def codes(c, bits, grid, reciprocal):
    """Codes and scales of fp32 groups ``c`` (rows of GROUP) as the reference makes them, the quotient taken as
    ``c / scale`` or ``c * fl(1 / scale)``; only finite groups with a positive scale."""
    divisor, low, high = grid_levels(bits, grid)
    absmax = c.abs().amax(dim=-1, keepdim=True)
    scale = absmax / torch.full_like(absmax, divisor)
    keep = (torch.isfinite(c).all(dim=-1) & (scale[:, 0] > 0) & torch.isfinite(1.0 / scale[:, 0]))
    c, scale = c[keep], scale[keep]
    ratio = c * (1.0 / scale) if reciprocal else c / scale
    q = (torch.round(ratio) if grid == "symmetric" else torch.floor(ratio)).clamp(low, high)
    value = (q + (0.5 if grid == "midrise" else 0.0)) * scale
    return q, (c - value).abs() / scale


def inputs(gen):
    """name -> fp32 groups (rows of GROUP)."""
    n = 4096
    normal = torch.randn(n, GROUP, generator=gen)
    lognormal = normal * torch.exp(2 * torch.randn(n, GROUP, generator=gen)) * 1e-4
    return {"normal": normal, "lognormal": lognormal, "bf16-rounded normal": normal.bfloat16().float(),
            "bf16-rounded lognormal": lognormal.bfloat16().float()}


def main():
    gen = torch.Generator().manual_seed(0)
    sets = inputs(gen)
    print(f"{'input':26s} {'grid':>9s} {'bits':>4s} {'values':>9s} {'codes differ':>12s} "
          f"{'max err/scale div':>17s} {'recip':>11s} {'rms err/scale div':>17s} {'recip':>11s}")
    worst = 0.0
    for bits, grid in ((4, "symmetric"), (4, "midrise"), (2, "midrise"), (2, "symmetric"), (8, "symmetric")):
        groups = dict(sets)
        groups["adversarial"] = adversarial_groups(GROUP, bits, gen, grid).reshape(-1, GROUP)
        for name, c in groups.items():
            q_div, e_div = codes(c, bits, grid, False)
            q_rec, e_rec = codes(c, bits, grid, True)
            differ = int((q_div != q_rec).sum())
            rms_div, rms_rec = e_div.pow(2).mean().sqrt().item(), e_rec.pow(2).mean().sqrt().item()
            worst = max(worst, rms_rec / rms_div - 1)
            print(f"{name:26s} {grid:>9s} {bits:4d} {q_div.numel():9d} {differ:12d} {e_div.max().item():17.9f} "
                  f"{e_rec.max().item():11.9f} {rms_div:17.9f} {rms_rec:11.9f}")
    print(f"largest relative growth of the RMS error: {worst:.2e}")


if __name__ == "__main__":
    main()
