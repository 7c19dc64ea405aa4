"""The regime map (issue 21): where plain qgZ departs from full precision, and whether LoCo restores it.

Reads the ``runs.jsonl`` of ``benchmarks/convergence_sim.py`` runs, one tag per regime (model size, ``W = M x L``,
micro-batch, grid), and writes ``map.md`` (the table), ``map.json`` and ``map.png`` (the figure):

    python3 benchmarks/regime_map.py --runs benchmarks/results/regime_map/runs.jsonl \\
        --out benchmarks/results/regime_map

For each regime and bit setting (4/4, 2/2, 8/2 + Hadamard) it gives the paired differences of the final validation
loss over the seeds both arms ran (plain - full, LoCo - plain; mean and 95% t-interval) and what may explain them:
the gradient noise scale ``B_noise`` of the full-precision arm (sequences; in a branched regime, whose full arm is
the trunk, that of the branches, over the compared steps only), plain qgZ's per-step error of the mean
gradient ``e`` (relative to the exact mean), and ``rho``, the power of that error over the power of the gradient's
own sampling noise at the step's batch ``B``: ``rho = e^2 (1 + B_noise / B) / (B_noise / B)`` (the exact mean has
``||g||^2 = ||G||^2 (1 + B_noise / B)``, its sampling noise ``||G||^2 B_noise / B``). Tags ending in ``rep``
repeat a run of another tag (a determinism check) and are listed, not averaged. A regime without a full-precision
arm (one that changes only the grid) takes it from the regime with the same training setup (``SAME_TRAINING``).
Files that reuse a tag for different runs (two sessions' trunks of one branched design) are named apart with
``--runs NAME=PATH`` (tags read as ``NAME/tag``); a run read twice is refused.
Tags ``<base>_<change>`` hold LoCo runs with one change to LoCo's rule (item 3's fixes of the early burst):
``ef<N>``, error feedback from step ``N`` (plain qgZ before it); ``bounded``, the compensation rule of
``benchmarks/compensation_variants.py``. They are compared, seed by seed, with the base tag's plain qgZ, LoCo as the
library runs it and full precision.

The pooled table: per grid and bit setting, each difference pooled over the regimes that measured it with an
interval (``benchmarks/pooling.py``: random effects over the regimes' t-intervals, with
Cochran's heterogeneity test), so that several regimes of three seeds each answer together whether LoCo pays. The
section "Statistics with seeds as blocks" (``benchmarks/map_statistics.py``) redoes it with each model's shared seeds
as blocks, corrects the regime table's intervals for multiplicity, tests equivalence against a stated margin and
judges the update-burst rule on the runs recorded after it was fixed.
"""
import argparse
import json
import os
import re
import statistics
import sys
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # run from a checkout without installing

import map_statistics  # noqa: E402
from pooling import pool_intervals  # noqa: E402

from deepspeed_loco.findings import UPDATE_BURST_WARNING  # noqa: E402
from deepspeed_loco.simulation.burst import BURST_WINDOWS, update_burst  # noqa: E402
from deepspeed_loco.utils.stats import noise_ratio, t_interval  # noqa: E402

BITS = (("4/4", "plain4", "loco4"), ("2/2", "plain2", "loco2"), ("8/2+H", "plain8-2h", "loco8-2h"))
REPEAT_SUFFIX = "rep"
CHANGED = re.compile(r"^(?P<base>.+)_(?P<change>ef\d+|bounded)$")  # a tag of runs with a change to LoCo's rule
DIFFERENCES = (("plain_minus_full", "plain - full"), ("loco_minus_plain", "LoCo - plain"),
               ("loco_minus_full", "LoCo - full"))
SAME_TRAINING = ("params", "nodes", "local", "micro_batch", "steps", "lr", "warmup", "text", "dtype")


def load(paths):
    """``{tag: {arm key: {seed: record}}}`` of every run, and the repeat runs as a list of records. A path given as
    ``NAME=PATH`` reads that file's tags as ``NAME/tag`` (two studies that reused a tag, e.g. two trunks of one
    branched design run in different sessions, stay apart); a run read twice (same tag, arm and seed) is refused."""
    regimes, repeats, source = defaultdict(lambda: defaultdict(dict)), [], {}
    for spec in paths:
        name, _, path = spec.rpartition("=")
        with open(path) as f:
            for line in f:
                record = json.loads(line)
                if name:
                    record["tag"] = f"{name}/{record['tag']}"
                if record["tag"].endswith(REPEAT_SUFFIX):
                    repeats.append(record)
                    continue
                run = (record["tag"], record["key"], record["seed"])
                if run in source:
                    raise ValueError(f"regime_map: {path} holds run {run[0]} {run[1]} seed {run[2]}, already read "
                                     f"from {source[run]}: name each file's regimes apart (--runs NAME=PATH) or "
                                     f"leave one file out")
                source[run] = path
                regimes[record["tag"]][record["key"]][record["seed"]] = record
    return regimes, repeats


def borrow_full(regimes) -> None:
    """Gives each regime without a ``full`` arm the one of a regime with the same training (full precision does
    not depend on the grid or the bits), in place."""
    for arms in regimes.values():
        if "full" in arms:
            continue
        mine = _training(arms)
        donor = next((other for other in regimes.values() if "full" in other and _training(other) == mine), None)
        if donor is not None:
            arms["full"] = donor["full"]


def _training(arms):
    setup = next(iter(next(iter(arms.values())).values()))["setup"]
    return tuple(setup[key] for key in SAME_TRAINING)


def paired(arms, first, second):
    """Final validation loss of ``first`` minus ``second`` over the seeds both ran: ``(n, mean, low, high)``; the
    interval is None for one seed, and the whole is None where either arm is missing."""
    if first not in arms or second not in arms:
        return None
    seeds = sorted(set(arms[first]) & set(arms[second]))
    diffs = [arms[first][s]["final_val_loss"] - arms[second][s]["final_val_loss"] for s in seeds]
    if not diffs:
        return None
    interval = t_interval(diffs) if len(diffs) > 1 else None
    return (len(diffs), statistics.fmean(diffs), *(interval[1:] if interval else (None, None)))


def window_noise_scale(arms):
    """The gradient noise scale over the steps the regime compares (sequences; None without one): the full
    arm's, or, where that arm is a branched design's trunk (run from step 1) and the other arms branches (resumed
    after step K), the mean over the branches, which cover only the compared steps (every arm's comes from its exact
    fp32 gradients; the noise scale grows during training, so a trunk's whole-run value understates it there)."""
    full = arms.get("full", {})
    branches = [r["noise_scale"] for runs in arms.values() for r in runs.values()
                if r["setup"].get("resumed_from") and r["noise_scale"]]
    trunk = bool(full) and not any(r["setup"].get("resumed_from") for r in full.values())
    if trunk and branches:
        return statistics.fmean(branches)
    return statistics.fmean(r["noise_scale"] for r in full.values()) if full else None


def regime_rows(tag, arms):
    """One row per bit setting that the regime ran: the setup, the paired differences and the explanatory values."""
    setup = next(iter(next(iter(arms.values())).values()))["setup"]
    world = setup["nodes"] * setup["local"]
    batch = world * setup["micro_batch"]
    full = arms.get("full", {})
    noise = window_noise_scale(arms)
    rows = []
    for bits, plain, loco in BITS:
        if plain not in arms:
            continue
        error = statistics.fmean(r["grad_rel_error_mean"] for r in arms[plain].values())
        rows.append({
            "tag": tag, "params": setup["params"], "nodes": setup["nodes"], "local": setup["local"], "world": world,
            "micro_batch": setup["micro_batch"], "global_batch": batch, "steps": setup["steps"],
            "warmup": setup["warmup"],
            "grid": setup["quant_grid"], "bits": bits, "noise_scale": noise, "device": setup["device"],
            "plain_step_error": error, "rho": noise_ratio(error, noise, batch) if noise else None,
            "plain_sum_error": statistics.fmean(r["sum_rel_error_final"] for r in arms[plain].values()),
            "loco_sum_error": statistics.fmean(r["sum_rel_error_final"] for r in arms[loco].values())
            if loco in arms else None,
            "full_loss": statistics.fmean(r["final_val_loss"] for r in full.values()) if full else None,
            "plain_minus_full": paired(arms, plain, "full"), "loco_minus_plain": paired(arms, loco, plain),
            "loco_minus_full": paired(arms, loco, "full"),
        })
    return rows


def pooled_rows(rows, by_model: bool = False):
    """Per (grid, bits), and per model size (``params``) if ``by_model``, the default grid first, the bits in
    ``BITS`` order, then the smaller model: each of ``DIFFERENCES`` pooled over the rows whose interval it has
    (:class:`pooling.Pooled` as a dict, None without any), and the seeds behind it. A regime
    whose seeds all differ by the same amount has an interval of zero width, which cannot be weighted; it is left out
    of that pool. The pool treats the regimes as independent; regimes of one model that differ only in ``W`` share
    each seed's initial weights and batches."""
    groups = {}
    for r in rows:
        groups.setdefault((r["grid"], r["bits"], r["params"] if by_model else 0), []).append(r)
    pooled = []
    order = [bits for bits, _, _ in BITS]
    for (grid, bits, params), members in sorted(groups.items(),
                                                key=lambda g: (g[0][0] != "auto", order.index(g[0][1]), g[0][2])):
        entry = {"grid": grid, "bits": bits, "regimes": [m["tag"] for m in members]}
        if by_model:
            entry["params"] = params
        for key, _ in DIFFERENCES:
            cells = [m[key] for m in members if _has_width(m[key])]
            result = pool_intervals([cell[1:] for cell in cells])
            entry[key] = dict(vars(result), seeds=sum(cell[0] for cell in cells)) if result else None
        pooled.append(entry)
    return pooled


def _has_width(cell) -> bool:
    """A paired difference ``(n, mean, low, high)`` with an interval of positive width."""
    return cell is not None and cell[2] is not None and cell[3] > cell[2]


def burst_rows(tag, arms):
    """Per LoCo arm and seed: LoCo's early burst, the largest 10-step mean of its per-step error in the first
    ``BURST_WINDOWS`` windows over plain qgZ's at the same bits and seed, its update burst (:func:`_update_burst`),
    beside LoCo - plain of the final loss."""
    rows = []
    for _, plain, loco in BITS:
        for seed in sorted(set(arms.get(plain, {})) & set(arms.get(loco, {}))):
            p, q = arms[plain][seed], arms[loco][seed]
            rows.append({"tag": tag, "arm": loco, "seed": seed, "burst": _burst(q, p),
                         "update_burst": _update_burst(q, p),
                         "loco_minus_plain": q["final_val_loss"] - p["final_val_loss"]})
    return rows


def changed_rows(regimes):
    """Per ``<base>_<change>`` tag and LoCo arm: the changed arm minus the base tag's plain qgZ, LoCo as the library
    runs it and full precision (paired ``(n, mean, low, high)``), its mean early burst over plain, and per seed
    ``(seed, burst, changed - plain)``."""
    rows = []
    for tag, arms in regimes.items():
        match = CHANGED.match(tag)
        if not match or match["base"] not in regimes:
            continue
        base = regimes[match["base"]]
        for _, plain, loco in BITS:
            if loco not in arms:
                continue
            merged = {"changed": arms[loco], **{key: base[key] for key in ("full", plain, loco) if key in base}}
            seeds = [(r["seed"], r["burst"], r["loco_minus_plain"])
                     for r in burst_rows(tag, {plain: base.get(plain, {}), loco: arms[loco]})]
            rows.append({"tag": tag, "base": match["base"], "change": _change(match["change"]), "arm": loco,
                         "minus_plain": paired(merged, "changed", plain), "minus_loco": paired(merged, "changed", loco),
                         "minus_full": paired(merged, "changed", "full"),
                         "burst": statistics.fmean(b for _, b, _ in seeds) if seeds else None, "seeds": seeds})
    return sorted(rows, key=lambda r: r["tag"])


def _change(suffix: str) -> str:
    """A tag's suffix in words: ``ef51`` is "from step 51", a variant's name stays as it is."""
    return f"from step {suffix[2:]}" if suffix.startswith("ef") else suffix


def _burst(loco_run, plain_run) -> float:
    """LoCo's early burst: the largest 10-step mean of its per-step error in the first ``BURST_WINDOWS`` windows
    over plain qgZ's, the two runs' records at the same seed."""
    return (max(loco_run["series"]["grad_rel_errors"][:BURST_WINDOWS]) /
            max(plain_run["series"]["grad_rel_errors"][:BURST_WINDOWS]))


def _update_burst(loco_run, plain_run) -> float:
    """LoCo's update burst (``deepspeed_loco.simulation.burst``) from the two runs' stored 10-step update RMS."""
    return update_burst(loco_run["series"]["update_rms"], plain_run["series"]["update_rms"], BURST_WINDOWS)


def _diff(cell):
    if cell is None:
        return "-"
    n, mean, low, high = cell
    if low is None:
        return f"{mean:+.4f} (n = 1)"
    mark = " **yes**" if low > 0 or high < 0 else ""
    return f"{mean:+.4f} [{low:+.4f}, {high:+.4f}] n={n}{mark}"


def _pooled_cell(cell):
    if cell is None:
        return "-"
    mark = " **yes**" if cell["low"] > 0 or cell["high"] < 0 else ""
    return (f"{cell['mean']:+.4f} [{cell['low']:+.4f}, {cell['high']:+.4f}]{mark} ({cell['k']} "
            f"regime{'s' if cell['k'] > 1 else ''}, "
            f"{cell['seeds']} seeds; heterogeneity p = {cell['p_heterogeneity']:.2g})")


def _pooled_table(title: str, pooled) -> list:
    """Markdown lines of a :func:`pooled_rows` table under ``title``, with a model column where its entries have
    ``params`` (``by_model``)."""
    by_model = "params" in pooled[0]
    head = ["grid", "bits"] + (["model"] if by_model else []) + [label for _, label in DIFFERENCES]
    lines = ["", title, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in pooled:
        cells = [p["grid"], p["bits"]] + ([f"{p['params'] / 1e6:.1f}M"] if by_model else [])
        lines.append("| " + " | ".join(cells + [_pooled_cell(p[key]) for key, _ in DIFFERENCES]) + " |")
    return lines


def markdown(rows, bursts, repeats, regimes, changed=(), pooled=(), pooled_by_model=()) -> str:
    head = ["regime", "bits", "B_noise (seq) / B", "plain step err", "rho", "sum err plain / LoCo",
            "plain - full (95% CI)", "LoCo - plain (95% CI)", "LoCo - full (95% CI)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        regime = (f"{r['params'] / 1e6:.1f}M, W={r['world']} ({r['nodes']}x{r['local']}), mb {r['micro_batch']}, "
                  f"{r['steps']} steps (warm-up {r['warmup']}), {r['grid']}"
                  + (", CPU" if r["device"] == "cpu" else ""))
        noise = f"{r['noise_scale']:.0f} / {r['global_batch']}" if r["noise_scale"] else f"- / {r['global_batch']}"
        loco_sum = f"{r['loco_sum_error']:.3f}" if r["loco_sum_error"] is not None else "-"
        lines.append("| " + " | ".join([
            regime, r["bits"], noise, f"{r['plain_step_error']:.3f}", f"{r['rho']:.2f}" if r["rho"] else "-",
            f"{r['plain_sum_error']:.3f} / {loco_sum}", _diff(r["plain_minus_full"]), _diff(r["loco_minus_plain"]),
            _diff(r["loco_minus_full"])]) + " |")
    if pooled:
        lines += _pooled_table("Pooled over the regimes above (random effects over each regime's 95% interval; "
                               "'yes': the pooled interval excludes 0):", pooled)
    if pooled_by_model:
        lines += _pooled_table("Pooled per model size (its regimes differ in W, batch and steps):", pooled_by_model)
    lines += ["", "LoCo's early burst (largest 10-step mean of the per-step error in steps 1-100, LoCo over plain "
              "at the same bits and seed; update burst: the largest 10-step window's update RMS in steps 1-100, LoCo "
              "over plain) beside that seed's LoCo - plain:", "",
              "| regime | arm | seed | burst | update burst | LoCo - plain |", "|---|---|---|---|---|---|"]
    lines += [f"| {b['tag']} | {b['arm']} | {b['seed']} | {b['burst']:.2f} | {b['update_burst']:.2f} | "
              f"{b['loco_minus_plain']:+.4f} |"
              for b in sorted(bursts, key=lambda b: -b["burst"])]
    if changed:
        lines += ["", "Changes to LoCo's rule (error feedback from step N, plain qgZ before it; a compensation "
                  "variant), against the base regime's arms, paired by seed:",
                  "", "| base regime | LoCo arm | change | burst | - plain (95% CI) | - LoCo (95% CI) | "
                  "- full (95% CI) | per seed: burst, - plain |", "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {d['base']} | {d['arm']} | {d['change']} | "
                  f"{'-' if d['burst'] is None else format(d['burst'], '.2f')} | {_diff(d['minus_plain'])} | "
                  f"{_diff(d['minus_loco'])} | {_diff(d['minus_full'])} | "
                  + "; ".join(f"{seed}: {burst:.2f}, {minus:+.3f}" for seed, burst, minus in d["seeds"]) + " |"
                  for d in changed]
    for record in repeats:
        original = regimes.get(record["tag"][:-len(REPEAT_SUFFIX)], {}).get(record["key"], {}).get(record["seed"])
        same = original is not None and original["final_val_loss"] == record["final_val_loss"]
        lines.append(f"\nRepeat of {record['tag'][:-len(REPEAT_SUFFIX)]} {record['key']} seed {record['seed']}: "
                     f"{record['final_val_loss']:.6f} ({'bit-identical to' if same else 'differs from'} the first run)")
    return "\n".join(lines) + "\n"


def plot(rows, bursts, path) -> None:
    """Left: plain - full; second: LoCo - plain, per regime and bits, with 95% intervals; third: LoCo - plain
    against rho (plain's quantization error power over the sampling noise power); fourth and right: each seed's
    LoCo - plain against LoCo's early error burst and its update burst."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(28, 5.8))
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(1, 5, i) for i in range(1, 6)]
    regimes = list(dict.fromkeys(r["tag"] for r in rows))
    colors = {"4/4": "tab:blue", "2/2": "tab:red", "8/2+H": "tab:purple"}
    offsets = {"4/4": -0.2, "2/2": 0.0, "8/2+H": 0.2}
    for r in rows:
        x = regimes.index(r["tag"]) + offsets[r["bits"]]
        for ax, cell in ((axes[0], r["plain_minus_full"]), (axes[1], r["loco_minus_plain"])):
            if cell is None or cell[2] is None:
                continue
            _, mean, low, high = cell
            ax.errorbar([x], [mean], yerr=[[mean - low], [high - mean]], fmt="o", color=colors[r["bits"]], capsize=3)
        cell = r["loco_minus_plain"]
        if cell is not None and cell[2] is not None and r["rho"]:
            _, mean, low, high = cell
            axes[2].errorbar([r["rho"]], [mean], yerr=[[mean - low], [high - mean]], fmt="o",
                             color=colors[r["bits"]], capsize=3)
    labels = [_short(next(r for r in rows if r["tag"] == tag)) for tag in regimes]
    for ax, title in ((axes[0], "plain qgZ - full precision"), (axes[1], "qgZ + LoCo - plain qgZ (same bits, grid)")):
        ax.set_xticks(range(len(regimes)))
        ax.set_xticklabels(labels, fontsize=7, rotation=30, ha="right")
        ax.set_title(title + ": final val loss, paired, 95% CI", fontsize=10)
    axes[2].set_xscale("log")
    axes[2].set_xlabel("rho = plain's quantization error power / gradient sampling noise power")
    axes[2].set_title("LoCo - plain against rho", fontsize=10)
    for ax, key, label in ((axes[3], "burst", "early error burst: max 10-step error in steps 1-100, over plain's"),
                           (axes[4], "update_burst", "update burst: max over 10-step windows in steps 1-100 of the "
                                                     "update RMS over plain's")):
        for b in bursts:
            ax.plot([b[key]], [b["loco_minus_plain"]], "o", alpha=0.7,
                    color=colors[next(bits for bits, _, loco in BITS if loco == b["arm"])])
        ax.set_xscale("log")
        ax.set_xlabel("LoCo's " + label, fontsize=8)
        ax.set_title(f"LoCo - plain per seed against LoCo's {key.replace('_', ' ')}", fontsize=10)
    axes[4].axvline(UPDATE_BURST_WARNING, color="grey", linestyle="--", linewidth=0.8)
    for ax in axes:
        ax.axhline(0, color="black", linewidth=0.8)
        ax.grid(alpha=0.3)
    for bits, color in colors.items():
        axes[0].plot([], [], "o", color=color, label=bits)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def _short(row) -> str:
    """The figure's axis label of a regime: model size, ranks, micro-batch, steps, a grid other than auto, CPU."""
    grid = "" if row["grid"] == "auto" else f" {row['grid'][:3]}"
    cpu = " CPU" if row["device"] == "cpu" else ""
    return f"{row['params'] / 1e6:.1f}M W={row['world']} mb{row['micro_batch']} {row['steps']}st{grid}{cpu}"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", nargs="+", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    regimes, repeats = load(args.runs)
    borrow_full(regimes)
    order = sorted(regimes, key=lambda tag: _order(regimes[tag]))
    rows = [row for tag in order for row in regime_rows(tag, regimes[tag])]
    bursts = [row for tag in order for row in burst_rows(tag, regimes[tag])]
    changed = changed_rows(regimes)
    pooled, pooled_by_model = pooled_rows(rows), pooled_rows(rows, by_model=True)
    os.makedirs(args.out, exist_ok=True)
    seed_blocks = map_statistics.analyse(regimes, rows, bursts, BITS, DIFFERENCES)
    text = (markdown(rows, bursts, repeats, regimes, changed, pooled, pooled_by_model)
            + map_statistics.markdown(seed_blocks, DIFFERENCES))
    with open(os.path.join(args.out, "map.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "map.json"), "w") as f:
        json.dump({"regimes": rows, "pooled": pooled, "pooled_by_model": pooled_by_model, "bursts": bursts,
                   "rule_changes": changed, "seed_blocks": seed_blocks}, f, indent=1)
    plot(rows, bursts, os.path.join(args.out, "map.png"))
    print(text)


def _order(arms):
    setup = next(iter(next(iter(arms.values())).values()))["setup"]
    return setup["params"], setup["quant_grid"] != "auto", setup["nodes"] * setup["local"]


if __name__ == "__main__":
    main()
