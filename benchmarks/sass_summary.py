"""Per-kernel instruction counts from ``cuobjdump -sass`` output (the full listing of ``loco_ops`` is too large to keep).

For each kernel function: static SASS instructions, and how many of them are integer/float conversions (``I2F``,
``F2I``, ``F2F``: a quarter-rate pipe), shuffles, barriers and local-memory accesses (``LDL``/``STL``: spills).

    cuobjdump -sass loco_ops.so > loco_ops.sass; python3 benchmarks/sass_summary.py loco_ops.sass

With ``--ncu-source`` it reads Nsight Compute's source page instead (``ncu -i REPORT --page source --csv
--print-source sass``): per profiled kernel, the warp instructions executed in all and by opcode, and the hottest
SASS lines, which is where a kernel's instruction budget goes.
"""
import csv
import re
import sys
from collections import Counter

FUNCTION = re.compile(r"^\s*Function : (\S+)")
OPCODE = r"(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)"  # an optional predicate, then the opcode (modifiers follow)
INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+" + OPCODE + r"(?:\.[\w.]+)?\b")
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


def _executed(cell):
    try:
        return int(float(cell.replace(",", "")))
    except ValueError:
        return None


def summarize_source(lines):
    """``[(section title, [(executed warp instructions, SASS text)])]`` from an ncu source-page CSV: a section starts
    at each header row (one with a ``Source`` column and an ``Instructions Executed`` column); a one-cell row before
    it names the kernel when ncu prints one."""
    sections, title, columns = [], "", None
    for row in csv.reader(lines):
        if not row:
            continue
        if "Source" in row and "Instructions Executed" in row:
            columns = (row.index("Source"), row.index("Instructions Executed"))
            sections.append((title or f"kernel {len(sections) + 1}", []))
            title = ""
            continue
        if columns is None or len(row) <= max(columns):
            title = " ".join(cell for cell in row if cell).strip() or title
            continue
        count = _executed(row[columns[1]])
        if count is not None:
            sections[-1][1].append((count, row[columns[0]].strip()))
    return sections


def main_source(path, top=40):
    with open(path, errors="replace") as f:
        sections = summarize_source(f)
    if not sections:
        print(f"no source table found in {path}")
    for title, rows in sections:
        total = sum(count for count, _ in rows)
        ops = Counter()
        for count, text in rows:
            match = re.match(OPCODE, text)
            ops[match.group(1) if match else "?"] += count
        print(f"== {title}: {total} warp instructions executed, {len(rows)} SASS lines")
        print("  by opcode: " + ", ".join(f"{op} {count}" for op, count in ops.most_common(25)))
        for count, text in sorted(rows, key=lambda r: -r[0])[:top]:
            print(f"  {count:12d}  {text}")


def main(path):
    with open(path, errors="replace") as f:
        kernels = summarize(f)
    print(f"{'instructions':>12s} " + " ".join(f"{name:>11s}" for name in CLASSES) + "  kernel")
    for name, ops in sorted(kernels.items()):
        counts = [sum(ops[op] for op in opcodes) for opcodes in CLASSES.values()]
        print(f"{sum(ops.values()):12d} " + " ".join(f"{c:11d}" for c in counts) + f"  {name}")


if __name__ == "__main__":
    if sys.argv[1] == "--ncu-source":
        main_source(sys.argv[2])
    else:
        main(sys.argv[1])
