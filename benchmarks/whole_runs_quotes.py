"""Recomputes every number the whole-runs study (stages A and C) quotes from its raw records and checks each quoted
passage: ``benchmarks/results/whole_runs/README.md``, ``benchmarks/RESULTS.md``, ``docs/when_loco_pays.md``, the
package's findings (``deepspeed_loco/findings.json``) and their evidence
(``benchmarks/results/findings_evidence.json``).

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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import whole_runs  # noqa: E402  (a sibling: its folder is on the path when it runs, and while the tests load it)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout this script is in
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
        powers = [statistics.fmean(x * x for x in r["series"]["grad_rel_errors"]) for r in runs]
        out[f"err_power_{key}"] = f"{statistics.fmean(powers):.3f}"
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


def numbers(root=ROOT):
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



README, RESULTS, WHEN, FINDINGS, EVIDENCE = ("benchmarks/results/whole_runs/README.md", "benchmarks/RESULTS.md",
                                             "docs/when_loco_pays.md", "deepspeed_loco/findings.json",
                                             "benchmarks/results/findings_evidence.json")
QUOTES = [  # (file, passage): each {A[key]} / {C[key]} is the recomputed number
    (README, "| LoCo - plain at step 1000 (family P) | {A[P]}; per seed {A[P_seeds]}; not resolved; equivalence "
             "within +-0.003 not shown (two one-sided tests p = {A[tost_p]}); as a bound: no resolved gain, a gain "
             "larger than {A[bound]} nats excluded"),
    (README, "mean above 0 at {A[above]} evaluations ({A[T_sign][100]} at step 100;"),
    (README, "+0.0040 [-0.0038, +0.0118] (per seed {A[E_plain_seeds]}), adjusted p {A[E_plain_holm]}"),
    (README, "(family E; seeds 0-3 across cards, see below) | {A[E_plain]} (per seed"),
    (README, "**{A[E_loco]}** (per seed {A[E_loco_seeds]}), Holm-adjusted p {A[E_loco_holm]}: a resolved cost"),
    (README, "| LoCo - plain {A[slope_lp]}"),
    (README, "{A[gen3][full]} (full), {A[gen3][plain4]} (plain), {A[gen3][loco4]} (LoCo); it grew on every run "
             "from {A[gap200]} at step 200 (below 0.02 on {A[gap200_below]} runs)"),
    (README, "a gain larger than {A[bound]} nats is excluded (minus the interval's lower end). Its mean difference at "
             "the end, {A[P_sign]}"),
    (README, "+0.0056 nats at step 1000, positive on every seed, {A[share_of_gain]} of the {A[half_gain]} nats full"),
    (README, "for seeds {A[E_loco_cards_span]} plain and LoCo ran on the H100 and full precision on the H200"),
    (README, "differed from that first attempt by {A[restart_100]} at step 100 and by {A[restart_200_250]} at steps "
             "200-250"),
    (README, "LoCo - plain over steps 901-1000 was {A[train_last100]} by seed"),
    (README, "(standard deviation {A[sd]} for LoCo - plain) is four times what the plan assumed (0.001); with it, 5 "
             "seeds give a half-width of {A[half_width]}"),
    (README, "with {A[power9]} power at 9 seeds and need about {A[seeds80]} seeds for 80%"),
    (README, "swings by {A[swing_early]} (largest minus smallest) over the evaluations up to step 400"),
    (README, "by at most {A[swing_late]} from step 400 on"),
    (README, "was {A[sum_loco]} with LoCo against {A[sum_plain]} with plain qgZ (about {A[sum_ratio]} times smaller"),
    (README, "(error norm {A[err_norm_loco]} of the exact mean's with LoCo, {A[err_norm_plain]} plain; error power "
             "{A[err_power_loco]} and {A[err_power_plain]} of the exact mean's"),
    (README, "| {C[P]}; per seed {C[P_seeds]}; Holm-adjusted p at most {C[p_holm]}: not resolved. Its 90% interval, "
             "{C[low90]}, lies inside +-0.003 (two one-sided tests p = {C[tost_p]}), but not at the family's rate "
             "(x 3: {C[tost_family]})"),
    (README, "a gain larger than {C[bound]} nats excluded | between -0.002 and +0.003"),
    (README, "between {C[T_100_450_words]} over steps 100-450 (above 0 except at step 200, {C[T_200]}; {C[T][300]} "
             "at step 300, BH-adjusted p {C[T_bh][300]}), below 0 from step 600 to the end ({C[T_600_end]})"),
    (README, "| {C[slope_lp]} per 100 steps: flat within resolution"),
    (README, "| {C[gen_plain]} (plain), {C[gen_loco]} (LoCo) |"),
    (README, "({C[T][100]} at step 100 here"),
    (README, "the seeds spread by {C[sd]} (standard deviation of LoCo - plain at step 1000)"),
    (README, "was {C[sum_loco]} with LoCo against {C[sum_plain]} plain (about {C[sum_ratio]} times smaller"),
    (README, "steps 901-1000: LoCo - plain {C[train_last100]} by seed"),
    (RESULTS, "LoCo 4/4 - plain 4/4 at step 1000 {A[P]} (no resolved gain, a gain larger than {A[bound]} nats "
              "excluded; equivalence within +-0.003 not shown), above 0 at {A[above]} evaluations"),
    (RESULTS, "**LoCo 4/4 - full {A[E_loco]}** (Holm over 2), plain - full {A[E_plain]}"),
    (RESULTS, "differed from its first attempt by {A[restart_100]} at step 100 and {A[restart_200_250]} at steps "
              "200-250"),
    (RESULTS, "from {A[sum_plain]} to {A[sum_loco]}"),
    (RESULTS, "LoCo 4/4 - plain 4/4 at step 1000 {C[P]} (Holm over 3 at most {C[p_holm]}; as predicted, -0.002 to "
              "+0.003; no resolved gain, a gain larger than {C[bound]} nats excluded): {C[T_100_450]} over steps "
              "100-450"),
    (WHEN, "over a whole 1000-step schedule at 1024 sequences (262K tokens) a step, 5 seeds: {A[P]} (LoCo - full "
           "there: **{A[E_loco]}**, a resolved cost, its arms on different cards for 4 of 5 seeds); 116M over a "
           "whole 1000-step schedule at 64 sequences, 3 seeds: {C[P]}"),
    (WHEN, "a gain larger than {A[bound]} nats (10.8M, 262K tokens a step, 5 seeds) and {C[bound]} (116M, 16K "
           "tokens a step, 3 seeds) is excluded"),
    (WHEN, "- LoCo 4/4 - plain 4/4 at step 1000: {A[P]}. As a bound: no resolved gain, and a gain larger than "
           "{A[bound]} nats excluded; not resolved either way, and not shown equivalent within +-0.003 (two "
           "one-sided tests p = {A[tost_p]}): the seeds spread by {A[sd]}"),
    (WHEN, "- LoCo 4/4 - full precision: **{A[E_loco]}**, positive on every seed (Holm-adjusted p {A[E_loco_holm]}): "
           "a resolved cost, {A[share_of_gain]} of what full precision gained over the last half. Plain 4/4 - full: "
           "{A[E_plain]}, not resolved."),
    (WHEN, "differed from its first attempt by {A[restart_100]} at step 100 and {A[restart_200_250]} at steps "
           "200-250"),
    (WHEN, "above 0 at {A[above]} evaluations (none resolved) and flat over the last 450 steps ({A[slope_lp]} per "
           "100 steps)"),
    (WHEN, "about {A[sum_ratio]} times closer to the exact gradients' (its relative error at step 1000: "
           "{A[sum_loco]} with LoCo, {A[sum_plain]} plain;"),
    (WHEN, "a gain larger than {A[bound]} nats excluded."),
    (WHEN, "- LoCo 4/4 - plain 4/4 at step 1000: {C[P]} (per seed {C[P_seeds]}). No gain and no cost resolved; as a "
           "bound, a gain larger than {C[bound]} nats excluded"),
    (WHEN, "Its family is incomplete (the full-precision runs are not run), so its Holm adjustment is a bound (at "
           "most {C[p_holm]})."),
    (WHEN, "- Along the run LoCo - plain was {C[T_100_450]} over steps 100-450 (above 0 except at step 200; none "
           "resolved after correction) and {C[T_600_end]} from step 600 on"),
    (WHEN, "(a gain larger than {C[bound]} nats excluded), with 3 seeds"),
    (WHEN, "5 seeds: LoCo - plain {A[P_sign]}, not resolved, a gain larger than {A[bound]} nats excluded"),
    (WHEN, "3 seeds: LoCo - plain {C[P_sign]}, not resolved, a gain larger than {C[bound]} excluded)"),
    (FINDINGS, "over whole runs a gain larger than {A[bound]}-{C[bound]} nats excluded"),
    (FINDINGS, "where LoCo 4/4 - plain 4/4 at the end was {A[P]} over 5 seeds (a gain larger than {A[bound]} "
               "excluded) and LoCo 4/4 ended {A[E_loco_mean]} nats behind full precision (resolved; its arms on "
               "different cards for 4 of 5 seeds)"),
    (FINDINGS, "where LoCo 4/4 - plain 4/4 at the end was {C[P]} over 3 seeds (a gain larger than {C[bound]} "
               "excluded; no early cost resolved: {C[T_100_450]} over steps 100-450)"),
    (FINDINGS, "no gain resolved, >{A[bound_rounded]} excluded ("),
    (EVIDENCE, "LoCo - plain at step 1000 {A[P]} (not resolved; equivalence within +-0.003 not shown, two one-sided "
               "tests p = {A[tost_p]}), flat over the last half ({A[slope_lp]} per 100 steps); plain - full "
               "{A[E_plain]}, LoCo - full {A[E_loco]} (Holm-adjusted p {A[E_loco_holm]} over the 2"),
    (EVIDENCE, "LoCo - plain at step 1000 {C[P]} (Holm-adjusted p at most {C[p_holm]} over stage C's family of 3"),
    (EVIDENCE, "{C[T][300]} at step 300 (BH-adjusted p {C[T_bh][300]})"),
]


def derived(values):
    """The few quoted forms built from other numbers (signs alone, words for a range, rounded bounds)."""
    a, c = values["A"], values["C"]
    for stage in (a, c):
        stage["P_sign"] = stage["P"].split(" ")[0]
    c["T_100_450_words"] = c["T_100_450"].replace(" to ", " and ")
    a["E_loco_mean"] = a["E_loco"].split(" ")[0].lstrip("+")
    seeds = [int(s) for s in a["E_loco_cards"].split(", ")]
    a["E_loco_cards_span"] = f"{seeds[0]}-{seeds[-1]}" if seeds == list(range(seeds[0], seeds[-1] + 1)) else \
        a["E_loco_cards"]
    a["bound_rounded"] = f"{max(float(a['bound']), float(c['bound'])):.3f}"
    return values


def flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def check(root=ROOT, values=None):
    """``[(file, passage, found)]`` for every :data:`QUOTES` entry with the recomputed numbers placed in it."""
    values = derived(values or numbers(root))
    texts = {}
    rows = []
    for path, template in QUOTES:
        if path not in texts:
            texts[path] = flat(open(os.path.join(root, path)).read())
        passage = flat(template.format(**values))
        rows.append((path, passage, passage in texts[path]))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=ROOT,
                    help="the checkout whose records and documents are checked (default: this one)")
    args = ap.parse_args(argv)
    rows = check(args.root)
    for path, passage, found in rows:
        print(f"{'OK     ' if found else 'MISSING'} {path}: {passage}")
    missing = sum(not found for _, _, found in rows)
    print(f"{len(rows) - missing} of {len(rows)} quoted passages match the records"
          + (f"; {missing} missing: a misquote, or a passage reworded without its check" if missing else ""))
    return 1 if missing else 0


if __name__ == "__main__":
    raise SystemExit(main())
