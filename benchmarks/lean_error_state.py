"""The analysis of the lean-error-state study (``benchmarks/results/lean_error_state/README.md``), as its plan fixed
it before the runs: held-out loss at step 1000, differences paired within seed (seeds are blocks).

Family G: each option minus plain 2/2 (Holm over 5). The share of LoCo 2/2's gain an option keeps, ``mean(option -
plain2) / mean(loco2 - plain2)``, with Fieller's 95% interval for a ratio of paired means. Family K: int4 and
inter-node-only LoCo 2/2 minus today's LoCo 2/2 (Holm over 2), with equivalence within +-0.003 nats at the family's
rate. LoCo 8/2 + Hadamard with inter-node error minus plain 8/2 + Hadamard. Item 5: the run whose buffers were zeroed
after step 500 minus the uninterrupted LoCo 2/2, at the end (equivalence within +-0.003) and over steps 600-1000.
Item 7 (``--item 7``, the 116M model): LoCo 2/2 and the lean option each minus plain 2/2 (Holm over 2), the lean
option minus LoCo 2/2 (equivalence within +-0.003), both differences every 50 steps; ``--family loco``: LoCo 2/2
minus plain 2/2 alone (the plan's rule where no option kept 80% at 10.8M); ``--family lean`` (item 7b): the lean
option minus plain 2/2 alone, with the share of LoCo 2/2's gain it keeps.

    python3 benchmarks/lean_error_state.py --runs benchmarks/results/lean_error_state/runs/*.jsonl \\
        --out benchmarks/results/lean_error_state/analysis [--item 7 [--family planned|loco|lean]]
    # the CPU preview (600 steps, buffers zeroed after step 300):
    python3 benchmarks/lean_error_state.py --runs benchmarks/results/lean_error_state/cpu_w4/runs.jsonl \\
        --zeroed le_zero300:loco2 --zero-step 300 --out benchmarks/results/lean_error_state/cpu_w4

Writes ``analysis.md`` and ``analysis.json``.
"""
import argparse
import json
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from map_statistics import tost  # noqa: E402
from whole_runs import correct_holm, holm_text, load, paired, trajectory, with_seeds  # noqa: E402

from deepspeed_loco.utils.stats import t_quantile_two_sided  # noqa: E402

MARGIN = 0.003  # nats: the plan's equivalence margin
MIN_SEEDS = 5  # fewer seeds in a cell decide nothing (the plan)
PLAIN, LOCO = "le_base:plain2", "le_base:loco2"
OPTIONS = {  # family G: name -> arm (tag:key), in the plan's order
    "LoCo 2/2 (int8, both hops)": LOCO,
    "LoCo 2/2, error_bits 4": "le_e4:loco2",
    "LoCo 2/2, error_feedback inter_node": "le_inter:loco2",
    "plain 8/2 + Hadamard": "le_base:plain8-2h",
    "8/2 + Hadamard, error_feedback inter_node": "le_inter:loco8-2h",
}
SHARED = ("LoCo 2/2, error_bits 4", "LoCo 2/2, error_feedback inter_node")  # the share of LoCo 2/2's gain, family K
ZEROED = "le_zero500:loco2"
TAGS = ("le_base", "le_e4", "le_inter", "le_zero500")
TAGS_116 = ("le116", "le116_lean")  # item 7
PLAIN_116, LOCO_116, LEAN_116 = "le116:plain2", "le116:loco2", "le116_lean:loco2"  # item 7
MIN_SEEDS_116 = 3


def load_arms(paths, tags=TAGS):
    """``{"tag:key": {seed: run}}`` of every tag of ``tags``."""
    return {f"{tag}:{key}": runs for tag in tags for key, runs in load(paths, tag).items()}


def fieller(numerators, denominators, confidence: float = 0.95):
    """``(ratio, low, high)``: ``mean(a) / mean(b)`` of paired ``a``, ``b`` (two or more pairs) and Fieller's interval;
    ``low`` and ``high`` None where the denominator's mean is not resolved from 0 (the interval is unbounded)."""
    a, b = list(numerators), list(denominators)
    n = len(a)
    if n < 2 or n != len(b):
        raise ValueError(f"fieller: needs two or more pairs, got {n} and {len(b)}")
    ma, mb = statistics.fmean(a), statistics.fmean(b)
    vaa, vbb = statistics.variance(a) / n, statistics.variance(b) / n
    vab = sum((x - ma) * (y - mb) for x, y in zip(a, b)) / (n - 1) / n
    t2 = t_quantile_two_sided(confidence, n - 1) ** 2
    qa, qb, qc = mb * mb - t2 * vbb, ma * mb - t2 * vab, ma * ma - t2 * vaa  # qa R^2 - 2 qb R + qc <= 0
    ratio = ma / mb if mb else math.nan
    if qa <= 0:
        return ratio, None, None
    root = math.sqrt(max(0.0, qb * qb - qa * qc))
    return ratio, (qb - root) / qa, (qb + root) / qa


def analyse(arms, zeroed: str = ZEROED, zero_step: int = 500):
    """Every family of the plan as plain data (cells of :func:`whole_runs.with_seeds`); ``zeroed``: the arm whose
    buffers were zeroed after step ``zero_step`` (its trajectory: every evaluation after it)."""
    gain = {name: with_seeds(paired(arms, arm, PLAIN)) for name, arm in OPTIONS.items()}
    correct_holm(gain)
    shares = {}
    for name in SHARED:
        both = sorted(set(gain[name]["per_seed"]) & set(gain[next(iter(OPTIONS))]["per_seed"]))
        if len(both) >= 2:
            ratio, low, high = fieller([gain[name]["per_seed"][s] for s in both],
                                       [gain[next(iter(OPTIONS))]["per_seed"][s] for s in both])
            shares[name] = {"n": len(both), "share": ratio, "low": low, "high": high,
                            "keeps_80": low is not None and low >= 0.8}
    kept = {name: with_seeds(paired(arms, OPTIONS[name], LOCO)) for name in SHARED}
    correct_holm(kept)
    for cell in kept.values():
        _equivalence(cell, rate_factor=len(kept))
    hadamard = with_seeds(paired(arms, OPTIONS["8/2 + Hadamard, error_feedback inter_node"], OPTIONS[
        "plain 8/2 + Hadamard"]))
    zeroed_cell = _equivalence(with_seeds(paired(arms, zeroed, LOCO)), rate_factor=1)
    steps = sorted({step for run in arms.get(zeroed, {}).values() for step, _ in run["validation"] if step > zero_step})
    along = trajectory(arms, {f"zeroed after {zero_step} - LoCo 2/2": (zeroed, LOCO)}, steps)
    seeds = {arm: sorted(runs) for arm, runs in arms.items()}
    return {"gain": gain, "shares": shares, "kept": kept, "hadamard_inter_minus_plain": hadamard,
            "zeroed": zeroed_cell, "zero_step": zero_step, "zeroed_trajectory": along, "seeds": seeds}


DIFFERENCES_116 = {"LoCo 2/2 - plain 2/2": (LOCO_116, PLAIN_116), "lean - plain 2/2": (LEAN_116, PLAIN_116)}
FAMILIES_116 = {  # item 7's planned family, item 7 with the lean arm left out by its rule, item 7b's
    "planned": tuple(DIFFERENCES_116), "loco": ("LoCo 2/2 - plain 2/2", ), "lean": ("lean - plain 2/2", )}


def analyse_116m(arms, family: str = "planned"):
    """The 116M differences at step 1000 as plain data, Holm over ``family`` (a key of :data:`FAMILIES_116`):
    "planned", item 7's LoCo 2/2 and the lean option each minus plain 2/2; "loco", LoCo 2/2 - plain 2/2 alone (the
    plan's case where no option kept 80% at 10.8M); "lean", item 7b's lean - plain 2/2 alone, with the share of LoCo
    2/2's gain it keeps (Fieller). With a lean difference: lean minus LoCo 2/2 (equivalence within +-MARGIN).
    Each difference every 50 steps."""
    differences = {name: DIFFERENCES_116[name] for name in FAMILIES_116[family]}
    cells = {name: with_seeds(paired(arms, a, b)) for name, (a, b) in differences.items()}
    correct_holm(cells)
    with_lean = LEAN_116 in (a for a, _ in differences.values())
    lean_vs_loco = _equivalence(with_seeds(paired(arms, LEAN_116, LOCO_116)), rate_factor=1) if with_lean else None
    share = None
    if family == "lean":
        loco = with_seeds(paired(arms, LOCO_116, PLAIN_116))["per_seed"]
        lean = cells["lean - plain 2/2"]["per_seed"]
        both = sorted(set(loco) & set(lean))
        if len(both) >= 2:
            ratio, low, high = fieller([lean[s] for s in both], [loco[s] for s in both])
            share = {"n": len(both), "share": ratio, "low": low, "high": high}
    return {"family": cells, "family_name": family, "lean_minus_loco": lean_vs_loco, "share": share,
            "trajectory": trajectory(arms, differences, range(50, 1001, 50)),
            "seeds": {arm: sorted(runs) for arm, runs in arms.items()}}


def _equivalence(cell, rate_factor: int):
    """Adds the two one-sided tests within +-MARGIN, judged at 0.05 / ``rate_factor`` (the family's rate)."""
    values = list(cell["per_seed"].values())
    if len(values) >= 2:
        p, low, high = tost(values, MARGIN)
        cell.update(tost_p=p, tost_low=low, tost_high=high, equivalent=p * rate_factor < 0.05)
    return cell


def _cell(cell, min_seeds: int = MIN_SEEDS) -> str:
    if cell["n"] < 2:
        return f"{cell['n']} seed(s): no interval"
    text = f"{cell['mean']:+.4f} [{cell['low']:+.4f}, {cell['high']:+.4f}] (n={cell['n']})"
    return text + ("" if cell["n"] >= min_seeds else f"; fewer than {min_seeds} seeds: decides nothing")


def _tost_text(cell) -> str:
    if "tost_p" not in cell:
        return ""
    return f"; TOST within +-{MARGIN}: p {cell['tost_p']:.2g}, " \
           f"{'**equivalent**' if cell.get('equivalent') else 'not shown'}"


def markdown_116m(result) -> str:
    family = result["family"]
    lines = ["# Does the 2-bit gain reach 116M? (item 7): analysis", "",
             "Held-out loss at step 1000, paired within seed, mean [95% t interval] (`README.md`, item 7).", "",
             f"| difference | at step 1000 | Holm over {len(family)} |", "|---|---|---|"]
    lines += [f"| {name} | {_cell(cell, MIN_SEEDS_116)} | {holm_text(cell, len(family))} |"
              for name, cell in family.items()]
    lean, share = result["lean_minus_loco"], result["share"]
    lines += ["", "The lean arm was left out (the plan's rule: no option kept 80% of the gain at 10.8M)." if lean is None
              else f"lean - LoCo 2/2: {_cell(lean, MIN_SEEDS_116)}{_tost_text(lean)}"]
    if share is not None:
        interval = "unbounded (LoCo 2/2's gain not resolved)" if share["low"] is None else \
            f"[{share['low']:.2f}, {share['high']:.2f}]"
        lines += ["", f"Share of LoCo 2/2's gain the lean option keeps: {share['share']:.2f} {interval} (Fieller 95%, "
                  f"n={share['n']})"]
    lines += ["", "| step | difference | mean [95%] |", "|---|---|---|"]
    lines += [f"| {c['step']} | {c['difference']} | {_cell(c, MIN_SEEDS_116)} |" for c in result["trajectory"]]
    lines += ["", "Seeds per arm: " + "; ".join(f"{arm} {seeds}" for arm, seeds in result["seeds"].items())]
    return "\n".join(lines) + "\n"


def markdown(result) -> str:
    lines = ["# Lean error states at 2/2: analysis", "",
             "Held-out loss at the last step, paired within seed, mean [95% t interval]; the plan's families "
             "(`README.md`).", "", "## Family G: each option minus plain 2/2 (Holm over 5)", "",
             "| option | minus plain 2/2 | Holm |", "|---|---|---|"]
    for name, cell in result["gain"].items():
        lines.append(f"| {name} | {_cell(cell)} | {holm_text(cell, len(result['gain']))} |")
    lines += ["", "## Share of LoCo 2/2's gain kept (Fieller 95%)", "", "| option | share | 95% interval | "
              "keeps at least 80% |", "|---|---|---|---|"]
    for name, s in result["shares"].items():
        interval = "unbounded (LoCo 2/2's gain not resolved)" if s["low"] is None else f"[{s['low']:.2f}, " \
                                                                                        f"{s['high']:.2f}]"
        lines.append(f"| {name} | {s['share']:.2f} (n={s['n']}) | {interval} | "
                     f"{'**yes**' if s['keeps_80'] else 'not shown'} |")
    lines += ["", "## Family K: option minus today's LoCo 2/2 (Holm over 2; equivalence within +-0.003 at the "
              "family's rate)", "", "| option | minus LoCo 2/2 | Holm | TOST p (x 2) | equivalent |",
              "|---|---|---|---|---|"]
    for name, cell in result["kept"].items():
        tost_text = f"{min(1.0, cell['tost_p'] * 2):.2g}" if "tost_p" in cell else "-"
        lines.append(f"| {name} | {_cell(cell)} | {holm_text(cell, len(result['kept']))} | {tost_text} | "
                     f"{'**yes**' if cell.get('equivalent') else 'not shown'} |")
    z = result["zeroed"]
    lines += ["", "## 8/2 + Hadamard", "", f"inter_node error - plain 8/2 + Hadamard: "
              f"{_cell(result['hadamard_inter_minus_plain'])} (one comparison, uncorrected)", "",
              "## Resuming without error state (item 5)", "",
              f"buffers zeroed after step {result['zero_step']} - uninterrupted LoCo 2/2, at the last step: "
              f"{_cell(z)}{_tost_text(z)}", "",
              "| step | zeroed - LoCo 2/2 |", "|---|---|"]
    lines += [f"| {c['step']} | {_cell(c)} |" for c in result["zeroed_trajectory"]]
    lines += ["", "Seeds per arm: " + "; ".join(f"{arm} {seeds}" for arm, seeds in result["seeds"].items())]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", nargs="+", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--item", type=int, choices=(6, 7), default=6,
                        help="6: the options at 10.8M (default); 7: the 116M model")
    parser.add_argument("--family", choices=tuple(FAMILIES_116), default="planned",
                        help="item 7's family: planned (LoCo and the lean option, each minus plain 2/2), loco (the "
                             "lean arm left out by the plan's rule), lean (item 7b: the lean option alone)")
    parser.add_argument("--zeroed", default=ZEROED, help="item 6: the zeroed arm, TAG:KEY (default %(default)s)")
    parser.add_argument("--zero-step", dest="zero_step", type=int, default=500,
                        help="item 6: the step after which its buffers were zeroed (default %(default)s)")
    args = parser.parse_args(argv)
    if args.item == 6:
        tags = tuple(dict.fromkeys(TAGS + (args.zeroed.split(":")[0], )))
        result = analyse(load_arms(args.runs, tags), args.zeroed, args.zero_step)
        markdown_item = markdown
    else:
        result = analyse_116m(load_arms(args.runs, TAGS_116), args.family)
        markdown_item = markdown_116m
    text = markdown_item(result)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "analysis.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "analysis.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(text)


if __name__ == "__main__":
    main()
