"""Per-kernel instruction counts from ``cuobjdump -sass`` output (the full listing of ``loco_ops`` is too large to keep).

For each kernel function: static SASS instructions, and how many of them are integer/float conversions (``I2F``,
``F2I``, ``F2F``: a quarter-rate pipe), shuffles, barriers and local-memory accesses (``LDL``/``STL``: spills).

    cuobjdump -sass loco_ops.so > loco_ops.sass; python3 benchmarks/sass_summary.py loco_ops.sass
"""
import re
import sys
from collections import Counter

FUNCTION = re.compile(r"^\s*Function : (\S+)")
INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(?:\.[\w.]+)?\b")
CLASSES = {"conversions": ("I2F", "F2I", "F2F", "I2I"), "shuffles": ("SHFL",), "barriers": ("BAR",),
           "spills": ("LDL", "STL")}


def summarize(lines):
    """``{kernel name: Counter of opcode}`` from the lines of a SASS listing."""
    kernels, current = {}, None
    for line in lines:
        match = FUNCTION.match(line)
        if match:
            current = kernels.setdefault(match.group(1), Counter())
            continue
        match = INSTRUCTION.match(line)
        if match and current is not None:
            current[match.group(1)] += 1
    return kernels


def main(path):
    with open(path, errors="replace") as f:
        kernels = summarize(f)
    print(f"{'instructions':>12s} " + " ".join(f"{name:>11s}" for name in CLASSES) + "  kernel")
    for name, ops in sorted(kernels.items()):
        counts = [sum(ops[op] for op in opcodes) for opcodes in CLASSES.values()]
        print(f"{sum(ops.values()):12d} " + " ".join(f"{c:11d}" for c in counts) + f"  {name}")


if __name__ == "__main__":
    main(sys.argv[1])
