"""Per-kernel instruction counts from ``cuobjdump -sass`` output (the full listing of ``loco_ops`` is too large to keep).

For each kernel function: static SASS instructions, and how many of them are integer/float conversions (``I2F``,
``F2I``, ``F2F``: a quarter-rate pipe), shuffles, barriers and local-memory accesses (``LDL``/``STL``: spills).

    cuobjdump -sass loco_ops.so > loco_ops.sass; python3 benchmarks/sass_summary.py loco_ops.sass

With ``--ncu-source`` it reads Nsight Compute's source page instead (``ncu -i REPORT --page source --csv
--print-source sass``): per profiled kernel, the warp instructions executed in all and by opcode, and the hottest
SASS lines, which is where a kernel's instruction budget goes.

With ``--path`` it estimates, without a GPU, what one thread executes along one path of a kernel: from the first
instruction of the first kernel whose name matches a regular expression, it follows unconditional branches and the
conditional branches whose addresses (hex) are given, falls through the others, and stops at an unconditional
``EXIT``; it prints the instructions by opcode and every conditional branch met with its decision, to refine the
list. (An object's listing here: ``cuobjdump -sass``, which the ``triton`` wheel carries.)

    python3 benchmarks/sass_summary.py --path loco.sass 'hop1_kernelILi2ELi4ELNS_12ErrorStorageE1E' 70 3370
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


ADDRESSED = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
BRANCH_TARGET = re.compile(r"\bBRA\s+(?:!?U?P\w+,\s*)?0x([0-9a-f]+)")


def kernel_instructions(lines, pattern):
    """``[(address, SASS text)]`` of the first kernel of a cuobjdump listing whose name matches ``pattern``."""
    found, instructions = False, []
    for line in lines:
        match = FUNCTION.match(line)
        if match:
            if found:
                break
            found = re.search(pattern, match.group(1)) is not None
            continue
        match = ADDRESSED.match(line)
        if found and match:
            instructions.append((int(match.group(1), 16), match.group(2)))
    return instructions


def walk(instructions, taken, limit=1_000_000):
    """``(Counter of opcode, [(address, text, taken)])`` along one path: unconditional branches followed, the
    conditional ones at the addresses in ``taken`` followed, the others not, until an unconditional ``EXIT`` (or
    ``limit`` instructions: a loop whose exit branch is not taken)."""
    where = {address: i for i, (address, _) in enumerate(instructions)}
    ops, branches, i, steps = Counter(), [], 0, 0
    while i < len(instructions) and steps < limit:
        address, text = instructions[i]
        steps += 1
        predicated = text.startswith("@")
        opcode = re.match(OPCODE, text).group(1)
        ops[opcode] += 1
        if opcode == "EXIT" and not predicated:
            break
        target = BRANCH_TARGET.search(text) if opcode == "BRA" else None
        if target:
            follow = not predicated or address in taken
            if predicated:
                branches.append((address, text, follow))
            if follow:
                i = where[int(target.group(1), 16)]
                continue
        i += 1
    return ops, branches


def main_path(path, pattern, taken):
    with open(path, errors="replace") as f:
        instructions = kernel_instructions(f, pattern)
    if not instructions:
        print(f"no kernel matching {pattern!r} in {path}")
        return
    ops, branches = walk(instructions, {int(a, 16) for a in taken})
    for address, text, follow in branches:
        print(f"  {address:05x} {'taken' if follow else 'not taken':9s}  {text}")
    print(f"{sum(ops.values())} instructions: " + ", ".join(f"{op} {n}" for op, n in ops.most_common()))


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
    elif sys.argv[1] == "--path":
        main_path(sys.argv[2], sys.argv[3], sys.argv[4:])
    else:
        main(sys.argv[1])
