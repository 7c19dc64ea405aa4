"""The analysis of the whole-runs study (``benchmarks/results/whole_runs/README.md``), as its plan fixed it before
the runs, stage by stage; differences of held-out loss are paired within seed (seeds are blocks).

Stage A (the default) and stage C, whole runs: at the end (stage A: family P, LoCo - plain, alone; family E, plain -
full and LoCo - full, Holm over 2; stage C: the three together, Holm over 3), along the run (family T: LoCo - plain
and plain - full at every evaluation, Benjamini-Hochberg), the slope over the last half (family S, Holm),
equivalence within the fixed margin (two one-sided t-tests) and the gap between training and held-out loss at the
end; where a family's members are not all run yet, Holm's adjusted p is bounded from above (the missing p-values
taken as the largest), and stage C's equivalence is judged at its family's rate. Stage B, branches: LoCo cold -
plain, LoCo warm - plain, plain - full and LoCo cold - full at the branches' end (Holm over the 4), warm minus cold
(the plan's refutation test), and the four along the branches (BH).

    python3 benchmarks/whole_runs.py --runs benchmarks/results/whole_runs/runs/*.jsonl \\
        --out benchmarks/results/whole_runs/analysis [--stage A|B|C] [--bits 4]

Writes ``analysis.md`` (tables), ``analysis.json`` (every number) and, for stages A and C, ``trajectory.png`` (the
two differences against step, each with its 95% interval; needs matplotlib).
"""
import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from map_statistics import benjamini_hochberg, equivalence_label, paired_t_test, tost  # noqa: E402

from deepspeed_loco.utils.stats import t_interval  # noqa: E402

MARGIN = 0.003  # nats: the equivalence margin the plan fixed
LAST_HALF_FROM = 550  # the slope's evaluations: steps 550..end
RATE = 0.05


def load(paths, tag):
    """``{arm key: {seed: run}}`` of the runs of ``tag`` in the JSONL files ``paths``; a repeated (arm, seed) is an
    error naming both files."""
    arms, seen = {}, {}
    for path in paths:
        for line in open(path):
            if not line.strip():
                continue
            run = json.loads(line)
            if run["tag"] != tag:
                continue
            key = (run["key"], run["seed"])
            if key in seen:
                raise SystemExit(f"{run['key']} seed {run['seed']} of {tag} is in {seen[key]} and in {path}: "
                                 "keep one")
            seen[key] = path
            arms.setdefault(run["key"], {})[run["seed"]] = run
    return arms


def loss_at(run, step=None):
    """A run's held-out loss at evaluation ``step`` (None: the final one); None where it did not evaluate there."""
    return run["final_val_loss"] if step is None else dict(map(tuple, run["validation"])).get(step)


def paired(arms, first, second, step=None):
    """``{seed: loss(first) - loss(second)}`` at evaluation ``step`` (None: the final one) over the seeds both ran."""
    seeds = sorted(set(arms.get(first, {})) & set(arms.get(second, {})))
    values = {s: (loss_at(arms[first][s], step), loss_at(arms[second][s], step)) for s in seeds}
    return {s: a - b for s, (a, b) in values.items() if a is not None and b is not None}


def interval(values):
    """mean, 95% t interval, p (against 0), n of a list of paired differences (interval None below 2)."""
    values = list(values)
    if len(values) < 2:
        return {"n": len(values), "mean": values[0] if values else None, "low": None, "high": None, "p": None}
    mean, low, high = t_interval(values)
    return {"n": len(values), "mean": mean, "low": low, "high": high, "p": paired_t_test(values)[2]}


def with_seeds(per_seed):
    """:func:`interval` of the paired differences ``{seed: difference}``, with them kept under ``per_seed``."""
    return dict(interval(per_seed.values()), per_seed=per_seed)


def trajectory(arms, differences, steps):
    """One :func:`interval` cell per difference ``{name: (first arm, second arm)}`` and evaluation step, each
    naming its ``difference`` and ``step``."""
    return [dict(interval(paired(arms, a, b, step).values()), difference=name, step=step)
            for name, (a, b) in differences.items() for step in steps]


def holm(pvalues, rate: float = RATE, of: int | None = None):
    """Holm's step-down adjusted p-values and rejections at ``rate``. ``of``: the family's planned size where some of
    its members have no p-value yet; they are taken as the largest, which bounds each adjusted p from above."""
    size = len(pvalues) if of is None else of
    if size < len(pvalues):
        raise ValueError(f"holm: of = {of} is smaller than the {len(pvalues)} p-values given")
    order = sorted(range(len(pvalues)), key=lambda i: pvalues[i])
    adjusted, running = [0.0] * len(pvalues), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (size - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted, [a <= rate for a in adjusted]


def correct_holm(family: dict) -> None:
    """Adds ``p_holm`` and ``survives`` to each cell of ``family`` (``{name: cell}``) that has a p-value: Holm's
    correction over the whole family; where some cells have none yet, an upper bound (:func:`holm`'s ``of``), and
    ``holm_untested`` says how many."""
    tested = [name for name, cell in family.items() if cell["p"] is not None]
    untested = len(family) - len(tested)
    for name, q, keep in zip(tested, *holm([family[n]["p"] for n in tested], of=len(family))):
        family[name].update(p_holm=q, survives=keep, **({"holm_untested": untested} if untested else {}))


def holm_text(cell, over: int) -> str:
    """A cell's Holm correction over a family of ``over``, for the tables; :func:`no_interval` without a test."""
    if "p_holm" not in cell:
        return no_interval(cell)
    if cell.get("holm_untested"):
        return f"Holm over {over} ({cell['holm_untested']} not run yet): adjusted p at most {cell['p_holm']:.2g}"
    return f"Holm over {over}: adjusted p {cell['p_holm']:.2g}"


def correct_bh(cells: list) -> None:
    """Adds ``p_bh`` and ``survives`` to each of ``cells`` that has a p-value: Benjamini-Hochberg over those."""
    tested = [cell for cell in cells if cell["p"] is not None]
    if tested:
        for cell, q, keep in zip(tested, *benjamini_hochberg([c["p"] for c in tested])):
            cell.update(p_bh=q, survives=keep)


def slope(points):
    """Least-squares slope of ``[(step, value), ...]`` (value per step)."""
    xs, ys = zip(*points)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x in xs)


def last_half_slopes(arms, first, second, steps):
    """Each seed's slope of ``first - second`` over the evaluations at ``steps`` (seeds with all of them)."""
    by_step = {step: paired(arms, first, second, step) for step in steps}
    seeds = set.intersection(*(set(d) for d in by_step.values())) if steps else set()
    return {seed: slope([(step, by_step[step][seed]) for step in steps]) for seed in sorted(seeds)
            if len(steps) >= 2}


def gain_excluded(cell):
    """The bound a LoCo - plain interval puts on a gain: the largest gain (nats, >= 0) its 95% interval leaves open
    above which a gain is excluded (minus its lower end, 0 where it lies above 0); None where a gain is resolved
    (the interval below 0) or there is no interval."""
    if cell.get("low") is None or cell["high"] < 0:
        return None
    return max(0.0, -cell["low"])


def device(run):
    """The card a run ran on (its ``setup.device``), or None where the record does not say."""
    return run.get("setup", {}).get("device")


def cross_card_seeds(arms, first, second):
    """``{seed: [device of first, device of second]}`` for the seeds whose two arms ran on different cards."""
    seeds = sorted(set(arms.get(first, {})) & set(arms.get(second, {})))
    pairs = {s: [device(arms[first][s]), device(arms[second][s])] for s in seeds}
    return {s: pair for s, pair in pairs.items() if pair[0] != pair[1]}


def cards_text(crossed) -> str:
    """What a difference's table cell adds where some seeds' arms ran on different cards ('' where none did)."""
    if not crossed:
        return ""
    seeds = ", ".join(str(s) for s in crossed)
    pairs = sorted({" vs ".join(str(d) for d in pair) for pair in crossed.values()})
    return f" (arms on different cards for seed{'s' if len(crossed) > 1 else ''} {seeds}: {'; '.join(pairs)})"


NOT_RUN = "not run yet"  # where no seed has both arms of a difference


def no_interval(cell) -> str:
    """What stands in for a test where ``cell`` has no interval: no seed yet, or one (an interval needs two)."""
    return NOT_RUN if not cell.get("n") else "1 seed: no interval yet"


def reading(cell, half_mean):
    """The slope's reading: shrinking, growing, or flat within resolution (see the plan); :func:`no_interval`
    without an interval."""
    if cell["low"] is None:
        return no_interval(cell)
    if half_mean is None or (cell["low"] <= 0 <= cell["high"]):
        return "flat within resolution"
    return "growing" if (cell["mean"] > 0) == (half_mean > 0) else "shrinking"


END_FAMILIES = ("split", "joint")  # stage A: P alone and E (Holm over 2); stage C: the three together (Holm over 3)
STAGES = {"A": ("wr16_b1024", "split"), "C": ("m125_s1000", "joint")}  # whole runs: tag, end family
BRANCH_TAGS = {"cold": "lbF_b4096", "warm": "lbL_b4096"}  # stage B: branches of the full trunk and of the LoCo one


def analyse(arms, bits="4", tokens_per_step=None, end_family="split"):
    """Every number of the study's fixed analysis, as a dict; ``end_family`` is how the plan grouped the differences
    at the end (``END_FAMILIES``)."""
    if end_family not in END_FAMILIES:
        raise ValueError(f"end_family = {end_family!r}: it must be one of {END_FAMILIES}")
    plain, loco = f"plain{bits}", f"loco{bits}"
    result = {"margin": MARGIN, "seeds": {k: sorted(v) for k, v in arms.items()}}
    p = with_seeds(paired(arms, loco, plain))
    if p["n"] >= 2:
        p["tost_p"], p["low90"], p["high90"] = tost(list(p["per_seed"].values()), MARGIN)
        p["reading"] = equivalence_label(p["p"], p["tost_p"], MARGIN)
        p["gain_excluded"] = gain_excluded(p)
    result["P"] = {"LoCo - plain": p}
    ends = {name: interval(paired(arms, a, b).values()) for name, (a, b) in
            (("plain - full", (plain, "full")), ("LoCo - full", (loco, "full")))}
    joint = end_family == "joint"
    family = dict(ends, **({"LoCo - plain": p} if joint else {}))
    correct_holm(family)
    if joint and "tost_p" in p:  # LoCo - plain in the family: equivalence too is judged at its rate (Bonferroni)
        p["tost_p_family"] = min(1.0, len(family) * p["tost_p"])
        p["reading"] = equivalence_label(p["p_holm"], p["tost_p_family"], MARGIN)
    result["end_family"] = end_family
    result["E"] = ends
    compared = (("LoCo - plain", (loco, plain)), ("plain - full", (plain, "full")), ("LoCo - full", (loco, "full")))
    result["cards"] = {name: cross_card_seeds(arms, a, b) for name, (a, b) in compared}
    steps = sorted({s for runs in arms.values() for r in runs.values() for s, _ in r["validation"]})
    differences = {"LoCo - plain": (loco, plain), "plain - full": (plain, "full")}
    cells = trajectory(arms, differences, steps)
    for cell in cells:
        cell["tokens"] = cell["step"] * tokens_per_step if tokens_per_step else None
    correct_bh(cells)
    result["T"] = cells
    half = [s for s in steps if s >= LAST_HALF_FROM]
    slopes = {}
    for name, (a, b) in differences.items():
        per_seed = last_half_slopes(arms, a, b, half)
        cell = interval(per_seed.values())
        half_means = [c["mean"] for c in cells if c["difference"] == name and c["step"] in half
                      and c["mean"] is not None]
        cell.update(per_seed=per_seed, reading=reading(cell, statistics.fmean(half_means) if half_means else None))
        slopes[name] = cell
    correct_holm(slopes)
    result["S"] = slopes
    result["generalization"] = {
        key: statistics.fmean(r["final_val_loss"] - statistics.fmean(r["train_losses"][-10:]) for r in runs.values())
        for key, runs in arms.items()}
    full = arms.get("full", {})
    gains = [loss_at(r, half[0]) - r["final_val_loss"] for r in full.values()
             if half and loss_at(r, half[0]) is not None]
    result["second_half_gain_full"] = statistics.fmean(gains) if gains else None
    return result


def branch_arms(paths, bits="4"):
    """Stage B's runs as one ``{arm: {seed: run}}``: ``full``, ``plain``, ``loco cold`` from the full trunk's tag
    (the trunk's own continuation and its branches) and ``plain warm``, ``loco warm`` from the LoCo trunk's."""
    cold, warm = (load(paths, BRANCH_TAGS[k]) for k in ("cold", "warm"))
    named = {"full": cold.get("full"), "plain": cold.get(f"plain{bits}"), "loco cold": cold.get(f"loco{bits}"),
             "plain warm": warm.get(f"plain{bits}"), "loco warm": warm.get(f"loco{bits}")}
    return {name: runs for name, runs in named.items() if runs}


BRANCH_FAMILY = {  # stage B's differences at the branches' end, one family (Holm over the 4)
    "LoCo cold - plain": ("loco cold", "plain"), "LoCo warm - plain": ("loco warm", "plain warm"),
    "plain - full": ("plain", "full"), "LoCo cold - full": ("loco cold", "full")}


def analyse_branches(arms):
    """Stage B's fixed analysis, as a dict: the family at the last evaluation (Holm), warm minus cold per seed
    (the plan's refutation test: resolved below -``MARGIN``), and each difference along the branches (BH)."""
    ends = {name: with_seeds(paired(arms, a, b)) for name, (a, b) in BRANCH_FAMILY.items()}
    correct_holm(ends)
    warm, cold = ends["LoCo warm - plain"]["per_seed"], ends["LoCo cold - plain"]["per_seed"]
    gap = {seed: warm[seed] - cold[seed] for seed in sorted(set(warm) & set(cold))}
    warm_minus_cold = with_seeds(gap)
    warm_minus_cold["refutes"] = warm_minus_cold["high"] is not None and warm_minus_cold["high"] < -MARGIN
    steps = sorted({s for name in ("plain", "plain warm") for r in arms.get(name, {}).values()
                    for s, _ in r["validation"] if s > r["setup"]["resumed_from"]})
    cells = trajectory(arms, BRANCH_FAMILY, steps)
    correct_bh(cells)
    return {"margin": MARGIN, "seeds": {k: sorted(v) for k, v in arms.items()}, "end": ends,
            "warm_minus_cold": warm_minus_cold, "T": cells}


def markdown_branches(result) -> str:
    """Stage B's analysis as text (bold: surviving the correction of its family)."""
    lines = ["# Stage B, branches: analysis", "", f"Seeds finished per arm: {result['seeds']}.", "",
             "## At the branches' end (one family: Holm over the 4)", "",
             "| difference | mean [95% interval] | correction | per seed |", "|---|---|---|---|"]
    for name, cell in result["end"].items():
        seeds = ", ".join(f"{v:+.4f}" for _, v in sorted(cell["per_seed"].items())) or "-"
        lines.append(f"| {name} | {_fmt(cell)} | {holm_text(cell, len(BRANCH_FAMILY))} | {seeds} |")
    gap = result["warm_minus_cold"]
    lines += ["", f"LoCo warm - plain minus LoCo cold - plain (buffers warm at the branch against starting at zero): "
              f"{_fmt(gap)}; the plan's refutation (interval below -{result['margin']}): "
              + ("refuted" if gap["refutes"] else "not refuted" if gap["low"] is not None else no_interval(gap)) + ".",
              "", "## Along the branches (Benjamini-Hochberg over every interval below)", "",
              "| step | " + " | ".join(BRANCH_FAMILY) + " |", "|---|" + "---|" * len(BRANCH_FAMILY)]
    by_step = {}
    for cell in result["T"]:
        by_step.setdefault(cell["step"], {})[cell["difference"]] = cell
    for step, cells in sorted(by_step.items()):
        lines.append(f"| {step} | " + " | ".join(_fmt(cells.get(name, {})) for name in BRANCH_FAMILY) + " |")
    return "\n".join(lines + [""])


def _fmt(cell, extra=""):
    if cell.get("mean") is None:
        return "-"
    if cell["low"] is None:
        return f"{cell['mean']:+.4f} (1 seed)"
    bold = "**" if cell.get("survives") else ""
    return f"{bold}{cell['mean']:+.4f} [{cell['low']:+.4f}, {cell['high']:+.4f}]{bold} n={cell['n']}{extra}"


def markdown(result) -> str:
    """The analysis as text (bold: surviving the correction of its family)."""
    p = result["P"]["LoCo - plain"]
    lines = ["# Whole runs: analysis", "", f"Seeds finished per arm: {result['seeds']}.", "",
             "## At the end (step of the last evaluation)", "",
             "| family | difference | mean [95% interval] | correction |", "|---|---|---|---|"]
    joint = result["end_family"] == "joint"
    over = len(result["E"]) + joint  # the end family's size: E's differences, with LoCo - plain where joint
    family = f", x {over} for the family {p['tost_p_family']:.2g}" if "tost_p_family" in p else ""
    extra = (f"; two one-sided tests at +-{result['margin']}: p = {p['tost_p']:.2g}{family} (90% "
             f"[{p['low90']:+.4f}, {p['high90']:+.4f}]): {p['reading']}" if "tost_p" in p else "")
    cards = {name: cards_text(crossed) for name, crossed in result.get("cards", {}).items()}
    if joint:
        lines.append(f"| end | LoCo - plain{cards.get('LoCo - plain', '')} | {_fmt(p)} | "
                     f"{holm_text(p, over)}{extra} |")
    else:
        alone = dict(p, survives=p.get('p') is not None and p['p'] < RATE)  # one interval: its own test decides
        lines.append(f"| P | LoCo - plain{cards.get('LoCo - plain', '')} | {_fmt(alone)} | "
                     f"none (one interval){extra} |")
    per_seed = ", ".join(f"seed {seed} {value:+.4f}" for seed, value in sorted(p["per_seed"].items()))
    for name, cell in result["E"].items():
        lines.append(f"| {'end' if joint else 'E'} | {name}{cards.get(name, '')} | {_fmt(cell)} | "
                     f"{holm_text(cell, over)} |")
    lines += ["", f"LoCo - plain at the end, per seed: {per_seed or '-'}."]
    if p.get("gain_excluded") is not None:
        lines.append(f"As a bound: no resolved gain; a gain larger than {p['gain_excluded']:.4f} nats is excluded "
                     "(minus the 95% interval's lower end).")
    marked = " (cards differ: see above)" if cards.get("plain - full") else ""
    lines += ["", "## Along the run (family T: Benjamini-Hochberg over every interval below)", "",
              f"| step | tokens | LoCo - plain | plain - full{marked} |", "|---|---|---|---|"]
    by_step = {}
    for cell in result["T"]:
        by_step.setdefault((cell["step"], cell["tokens"]), {})[cell["difference"]] = cell
    for (step, tokens), cells in sorted(by_step.items()):
        lines.append(f"| {step} | {tokens / 1e6:.1f}M | {_fmt(cells.get('LoCo - plain', {}))} | "
                     f"{_fmt(cells.get('plain - full', {}))} |" if tokens else
                     f"| {step} | - | {_fmt(cells.get('LoCo - plain', {}))} | {_fmt(cells.get('plain - full', {}))} |")
    lines += ["", f"## Slope over the last half (evaluations from step {LAST_HALF_FROM}; family S: Holm over 2)", "",
              "| difference | slope per 100 steps, mean [95% interval] | reading |", "|---|---|---|"]
    for name, cell in result["S"].items():
        scaled = {k: (v * 100 if isinstance(v, float) and k in ("mean", "low", "high") else v) for k, v in cell.items()}
        lines.append(f"| {name} | {_fmt(scaled)} | {cell['reading']} |")
    gain = result["second_half_gain_full"]
    lines += ["", "Held-out minus training loss (mean of the last 10 steps) at the end, per arm: "
              + ", ".join(f"{k} {v:+.4f}" for k, v in sorted(result["generalization"].items()))
              + (f". Full precision's held-out loss fell {gain:.4f} nats over the last half (the margin is "
                 f"{result['margin'] / gain:.1%} of it)." if gain else "."), ""]
    return "\n".join(lines)


def plot(result, path) -> bool:
    """``trajectory.png``: LoCo - plain and plain - full against step with 95% intervals; False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("trajectory.png not written: matplotlib is missing (pip install \"deepspeed-loco[report]\")")
        return False
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    for name, color in (("LoCo - plain", "tab:green"), ("plain - full", "tab:orange")):
        cells = [c for c in result["T"] if c["difference"] == name and c["low"] is not None]
        if not cells:
            continue
        steps = [c["step"] for c in cells]
        ax.plot(steps, [c["mean"] for c in cells], color=color, label=name)
        ax.fill_between(steps, [c["low"] for c in cells], [c["high"] for c in cells], color=color, alpha=0.2)
    ax.axhline(0, color="grey", linewidth=0.8)
    for bound in (-result["margin"], result["margin"]):
        ax.axhline(bound, color="grey", linewidth=0.6, linestyle="--")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("held-out loss difference (nats)")
    ax.set_title("paired over seeds, 95% intervals; dashed: the equivalence margin")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", nargs="+", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--stage", choices=("A", "B", "C"), default="A",
                    help="the plan analysed: A (whole runs, 10.8M, tag wr16_b1024), B (branches, tags "
                         f"{BRANCH_TAGS['cold']} and {BRANCH_TAGS['warm']}) or C (whole runs, 116M, tag m125_s1000)")
    ap.add_argument("--bits", default="4", help="the arms compared: plain<bits>, loco<bits>, full")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.stage == "B":
        arms = branch_arms(args.runs, args.bits)
        if not arms:
            raise SystemExit(f"no runs of tags {', '.join(BRANCH_TAGS.values())} in {args.runs}")
        result = analyse_branches(arms)
        text = markdown_branches(result)
    else:
        tag, end_family = STAGES[args.stage]
        arms = load(args.runs, tag)
        if not arms:
            raise SystemExit(f"no runs of tag {tag} in {args.runs}")
        setup = next(iter(next(iter(arms.values())).values()))["setup"]
        tokens = setup["micro_batch"] * setup["nodes"] * setup["local"] * setup["model"]["seq_len"]
        result = analyse(arms, args.bits, tokens, end_family)
        text = markdown(result)
        plot(result, os.path.join(args.out, "trajectory.png"))
    with open(os.path.join(args.out, "analysis.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "analysis.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(text)


if __name__ == "__main__":
    main()
