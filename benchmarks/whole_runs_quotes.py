"""Recomputes every number the whole-runs study (stages A and C) quotes from its raw records and checks each quoted
passage: ``benchmarks/results/whole_runs/README.md``, ``benchmarks/RESULTS.md``, ``docs/when_loco_pays.md``, the
package's findings (``deepspeed_loco/findings.json``) and their evidence (``benchmarks/results/findings_evidence.json``).

    python3 benchmarks/whole_runs_quotes.py [--root .]

Each number is computed here from ``benchmarks/results/whole_runs/runs/*.jsonl`` (and, for seed 4's restarted plain
run, the first attempt's log in ``runs/stageA_20261206/logs.tar.gz``), formatted as the documents quote it, and
placed in its passage (:data:`QUOTES`); a passage is found where its text occurs in the file, whitespace (line wraps)
aside. Prints each passage with OK or MISSING and exits 1 if any is missing: a misquote, or a passage reworded
without its check.
"""
import argparse
import glob
import math
import os
import re
import statistics
import sys
import tarfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run from a checkout

import whole_runs  # noqa: E402

RUNS = "benchmarks/results/whole_runs/runs"
FIRST_ATTEMPT = ("stageA_20261206/logs.tar.gz", "logs/wr16_b1024_plain4_s4.log")  # seed 4's plain run, cut off
POWER_GOAL = 0.8  # the power "would need" quotes
GAP_STEP, GAP_BELOW = 200, 0.02  # the generalization gap quoted at step 200, and the line counted under
SWING_UNTIL = 400  # each seed's LoCo - plain swing: over evaluations up to this step, and from it to the end


def signed(value, digits=4) -> str:
    return f"{value:+.{digits}f}"


def interval_text(cell, digits=4) -> str:
    """``+m [+l, +h]`` as the documents quote an interval."""
    return f"{signed(cell['mean'], digits)} [{signed(cell['low'], digits)}, {signed(cell['high'], digits)}]"


def span(values, digits, sign=False) -> str:
    """``low-high`` (``low to high`` with signs) of ``values``, both ends rounded to ``digits``."""
    low, high = min(values), max(values)
    if f"{low:.{digits}f}" == f"{high:.{digits}f}":
        return signed(low, digits) if sign else f"{low:.{digits}f}"
    if sign:
        return f"{signed(low, digits)} to {signed(high, digits)}"
    return f"{low:.{digits}f}-{high:.{digits}f}"


def seeds_text(per_seed, digits=4) -> str:
    return ", ".join(signed(v, digits) for _, v in sorted(per_seed.items()))


def tost_power(n: int, sd: float, margin: float, rate: float = 0.05) -> float:
    """Power of the two one-sided t-tests (at ``rate``, within ``+-margin``) on ``n`` paired differences of standard
    deviation ``sd`` whose true mean is 0: the chance that the 90% interval lies inside the margin, integrated over
    the sample standard deviation's distribution (chi-square on ``n - 1`` degrees of freedom)."""
    from scipy import integrate, stats
    df, se = n - 1, sd / math.sqrt(n)
    t = stats.t.ppf(1 - rate, df)

    def shown(v):
        room = margin - t * sd * math.sqrt(v / df) / math.sqrt(n)
        return (2 * stats.norm.cdf(room / se) - 1) * stats.chi2.pdf(v, df) if room > 0 else 0.0

    return integrate.quad(shown, 0, math.inf, limit=200)[0]


def seeds_for_power(sd: float, margin: float, goal: float = POWER_GOAL) -> int:
    """The fewest seeds whose two one-sided tests reach power ``goal`` at a true difference of 0."""
    n = 2
    while tost_power(n, sd, margin) < goal:
        n += 1
    return n


def gap_at(run, step):
    """Held-out minus training loss at evaluation ``step``: the training loss the mean of the 10 steps up to it."""
    return whole_runs.loss_at(run, step) - statistics.fmean(run["train_losses"][step - 10:step])


def first_attempt(root):
    """``{step: held-out loss}`` the first attempt of stage A's seed-4 plain run logged (4 decimals) before its lease
    ended; the run was restarted whole in the next lease."""
    archive, member = FIRST_ATTEMPT
    with tarfile.open(os.path.join(root, RUNS, archive)) as tar:
        text = tar.extractfile(member).read().decode()
    return {int(step): float(val) for step, val in re.findall(r"step (\d+)/\d+ val ([0-9.]+)", text)}


def stage_numbers(arms, end_family, bits="4"):
    """The quoted numbers of one stage (A: ``split``, C: ``joint``), as the documents write them."""
    result = whole_runs.analyse(arms, bits, end_family=end_family)
    plain, loco = f"plain{bits}", f"loco{bits}"
    p = result["P"]["LoCo - plain"]
    cells = {(c["difference"], c["step"]): c for c in result["T"]}
    steps = sorted({s for _, s in cells})
    out = {"P": interval_text(p), "P_seeds": seeds_text(p["per_seed"]), "tost_p": f"{p['tost_p']:.2g}",
           "low90": f"[{signed(p['low90'])}, {signed(p['high90'])}]", "bound": f"{p['gain_excluded']:.4f}",
           "sd": f"{statistics.stdev(p['per_seed'].values()):.4f}",
           "half_width": f"{(p['high'] - p['low']) / 2:.4f}",
           "slope_lp": interval_text({k: v * 100 for k, v in result["S"]["LoCo - plain"].items()
                                      if k in ("mean", "low", "high")}),
           "gen_plain": signed(result["generalization"][plain]), "gen_loco": signed(result["generalization"][loco])}
    if "p_holm" in p:
        out["p_holm"] = f"{p['p_holm']:.2g}"
        out["tost_family"] = f"{p['tost_p_family']:.2f}"
    above = [s for s in steps if cells["LoCo - plain", s]["mean"] > 0]
    out["above"] = f"{len(above)} of {len(steps)}"
    trains = {k: {s: statistics.fmean(r["train_losses"][-100:]) for s, r in arms[k].items()} for k in (plain, loco)}
    out["train_last100"] = seeds_text({s: trains[loco][s] - trains[plain][s] for s in trains[loco]})
    out["sum_plain"] = span([r["sum_rel_error_final"] for r in arms[plain].values()], 3)
    out["sum_loco"] = span([r["sum_rel_error_final"] for r in arms[loco].values()], 4)
    ratio = statistics.fmean(r["sum_rel_error_final"] for r in arms[plain].values()) / statistics.fmean(
        r["sum_rel_error_final"] for r in arms[loco].values())
    out["sum_ratio"] = f"{round(ratio)}"
    for key, arm in (("plain", plain), ("loco", loco)):
        runs = arms[arm].values()
        out[f"err_norm_{key}"] = f"{statistics.fmean(r['grad_rel_error_mean'] for r in runs):.3f}"
        out[f"err_power_{key}"] = f"{statistics.fmean(statistics.fmean(x * x for x in r['series']['grad_rel_errors']) for r in runs):.3f}"
    gaps = [gap_at(r, GAP_STEP) for runs in arms.values() for r in runs.values()]
    out["gap200"] = span(gaps, 4)
    out["gap200_below"] = f"{sum(g < GAP_BELOW for g in gaps)} of {len(gaps)}"
    swings_early, swings_late = [], []
    for seed in p["per_seed"]:
        by_step = {s: whole_runs.paired(arms, loco, plain, s)[seed] for s in steps}
        early = [v for s, v in by_step.items() if s <= SWING_UNTIL]
        late = [v for s, v in by_step.items() if s >= SWING_UNTIL]
        swings_early.append(max(early) - min(early))
        swings_late.append(max(late) - min(late))
    out["swing_early"], out["swing_late"] = span(swings_early, 3), f"{max(swings_late):.4f}"
    out["T_sign"] = {s: signed(cells["LoCo - plain", s]["mean"]) for s in steps}
    out["T"] = {s: interval_text(cells["LoCo - plain", s]) for s in steps}
    out["T_bh"] = {s: f"{cells['LoCo - plain', s]['p_bh']:.2g}" for s in steps}
    out["result"] = result
    return out


def numbers(root="."):
    """Every quoted number, by stage: ``{"A": {...}, "C": {...}}``."""
    paths = sorted(glob.glob(os.path.join(root, RUNS, "*.jsonl")))
    a_arms, c_arms = (whole_runs.load(paths, whole_runs.STAGES[s][0]) for s in "AC")
    a, c = stage_numbers(a_arms, "split"), stage_numbers(c_arms, "joint")
    result = a["result"]
    for name in ("plain - full", "LoCo - full"):
        key = "E_plain" if name.startswith("plain") else "E_loco"
        cell = whole_runs.with_seeds(whole_runs.paired(a_arms, *(("plain4", "full") if key == "E_plain"
                                                              else ("loco4", "full"))))
        a[key], a[key + "_seeds"] = interval_text(cell), seeds_text(cell["per_seed"])
        a[key + "_holm"] = f"{result['E'][name]['p_holm']:.2g}"
        a[key + "_cards"] = ", ".join(str(s) for s in result["cards"][name])
    a["gen_full"] = signed(result["generalization"]["full"])
    a["gen3"] = {k: f"{v:+.3f}" for k, v in result["generalization"].items()}
    gain = result["second_half_gain_full"]
    a["half_gain"] = f"{gain:.3f}"
    a["share_of_gain"] = f"{round(100 * result['E']['LoCo - full']['mean'] / gain)}%"
    sd = statistics.stdev(result["P"]["LoCo - plain"]["per_seed"].values())
    a["power9"] = f"{round(100 * tost_power(9, sd, whole_runs.MARGIN))}%"
    a["seeds80"] = str(seeds_for_power(sd, whole_runs.MARGIN))
    first = first_attempt(root)
    restart = a_arms["plain4"][4]
    drift = {s: abs(v - whole_runs.loss_at(restart, s)) for s, v in first.items()}
    a["restart_100"] = f"{drift[100]:.3f}"
    a["restart_200_250"] = span([drift[200], drift[250]], 3)
    a["restart_card"] = f"{whole_runs.device(restart)}"
    early = [s for s in c["T_sign"] if 100 <= s <= 450]
    c["T_100_450"] = span([float(c["T_sign"][s]) for s in early], 4, sign=True)
    c["T_200"] = c["T_sign"][200]
    late = [s for s in c["T_sign"] if s >= 600]
    c["T_600_end"] = span([float(c["T_sign"][s]) for s in late], 4, sign=True)
    return {"A": a, "C": c}

