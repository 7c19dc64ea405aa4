"""The regime map's statistics with seeds as blocks (issue 39, deliverable 5), the section "Statistics with seeds as
blocks" of ``map.md`` (written by ``benchmarks/regime_map.py``).

The map's pools (``regime_map.pooled_rows``) treat each regime's t-interval as an independent estimate, but the
regimes of one model size reuse the same seeds (the same initial weights and batches), so the pool counts a seed
once per regime. Here:

- **Seeds as blocks** (:func:`blocked_effect`): per model size, bits and grid, a two-way additive model of the
  per-(regime, seed) paired differences, ``d[r, s] = mu + a[r] + b[s] + e``, fitted by least squares (unbalanced
  allowed). The regime F-test compares it with the seeds-only model (do regimes differ, within seeds?), its
  residual variance pooled over the regimes. The pooled effect is the model's least-squares mean ``mu + mean(a)``,
  the unweighted mean over the regimes, with a cluster-robust interval over the distinct seeds (each seed one
  independent cluster; Student's t on ``distinct seeds - 1`` degrees of freedom): for a balanced design the
  t-interval of the seeds' means, for one regime its paired t-interval. It differs from the random-effects pool in
  its unit (a distinct seed, not a regime's interval), its weights (each regime equal, not by its precision, so a
  noisy regime weighs as much as a tight one) and its quantile (Student's t on the seeds, not the normal).
- **Multiplicity** (:func:`benjamini_hochberg`): the paired t-test behind each of the regime table's intervals, one
  family per difference, and which survive a false-discovery rate of :data:`FDR`.
- **Equivalence** (:func:`tost`): two one-sided t-tests against :data:`MARGIN`, so that "within noise" becomes
  either "equivalent within +-MARGIN" or "not shown equivalent".
- **The update-burst rule out of sample** (:func:`burst_rule_counts`): the rule "an update burst above
  ``UPDATE_BURST_WARNING`` flags a loss of more than :data:`BURST_LOSS`" judged separately on the runs it was drawn
  on (``results/regime_map/burst_rule_sample.json``) and on the runs recorded after it was fixed.
"""
import json
import math
import os
import statistics
import sys
from collections import defaultdict

import numpy as np
from scipy import stats as sps

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # run from a checkout without installing

from deepspeed_loco.findings import UPDATE_BURST_WARNING  # noqa: E402
from deepspeed_loco.utils.stats import t_interval  # noqa: E402

FDR = 0.05  # Benjamini-Hochberg's false-discovery rate over each family of intervals
# The equivalence margin, in nats of final validation loss, fixed before any equivalence test was run: 0.01 nats is
# a 1% change of perplexity (exp(0.01) = 1.010) and the size of the smallest gain the docs act on (LoCo 2/2 at 10.8M,
# W = 16, 1000 steps: -0.0098, for which they tell users to turn LoCo on); two arms closer than that differ by less
# than any effect the map's advice rests on.
MARGIN = 0.01
BURST_LOSS = 0.03  # the loss to plain qgZ (nats) that the update-burst rule was drawn to flag
BURST_RULE_SAMPLE = os.path.join(HERE, "results", "regime_map", "burst_rule_sample.json")
W_FAMILY = ("params", "grid", "bits", "steps", "warmup", "global_batch")  # regimes alike but in W (and micro-batch)


def paired_t_test(values):
    """``(n, mean, p)``: the two-sided one-sample t-test of ``values`` (paired differences, two or more) against 0
    on ``n - 1`` degrees of freedom; differences all equal give p = 0 (1 if all are 0)."""
    n, mean, se = _mean_se(values, "paired_t_test")
    return n, mean, _t_p(mean, se, n - 1)


def _mean_se(values, caller: str):
    """``(n, mean, standard error of the mean)`` of two or more ``values``."""
    values = list(values)
    if len(values) < 2:
        raise ValueError(f"{caller}: needs at least two differences, got {len(values)}")
    return len(values), statistics.fmean(values), statistics.stdev(values) / math.sqrt(len(values))


def benjamini_hochberg(pvalues, rate: float = FDR):
    """Benjamini-Hochberg's adjusted p-values of ``pvalues`` (in their order): ``min over j >= i of m p_(j) / j``
    over the sorted p-values, capped at 1; a hypothesis is rejected at false-discovery rate ``rate`` exactly where
    its adjusted p-value is at most ``rate``. Returns ``(adjusted, rejected)``, two lists."""
    if not 0 < rate < 1:
        raise ValueError(f"benjamini_hochberg: rate must lie in (0, 1), got {rate}")
    pvalues = list(pvalues)
    if any(not 0 <= p <= 1 for p in pvalues):
        raise ValueError(f"benjamini_hochberg: p-values must lie in [0, 1], got {pvalues}")
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    adjusted, running = [1.0] * m, 1.0
    for rank in range(m, 0, -1):
        i = order[rank - 1]
        running = min(running, m * pvalues[i] / rank)
        adjusted[i] = running
    return adjusted, [a <= rate for a in adjusted]


def tost(values, margin: float = MARGIN):
    """The two one-sided t-tests of ``values`` (paired differences, two or more) for equivalence within
    ``+-margin``: ``(p, low, high)``, p the larger of the two one-sided p-values (against ``mean <= -margin`` and
    ``mean >= margin``), ``[low, high]`` the 90% t-interval; equivalent at 5% iff ``p < 0.05``, that is iff the 90%
    interval lies inside ``(-margin, margin)``."""
    n, mean, se = _mean_se(values, "tost")
    _, low, high = t_interval(values, confidence=0.90)
    return _tost_p(mean, se, n - 1, margin), low, high


def equivalence_label(p: float, tost_p: float, margin: float = MARGIN) -> str:
    """How a paired difference reads against the margin: ``"equivalent within +-margin"`` where the two one-sided
    tests show it (``tost_p < 0.05``) and the 95% interval holds 0 (``p >= 0.05``); ``"resolved, inside +-margin"``
    where both tests pass but the interval excludes 0 (a real difference smaller than the margin, never called
    equivalent); ``"not shown"`` otherwise."""
    if tost_p >= 0.05:
        return "not shown"
    return f"resolved, inside +-{margin}" if p < 0.05 else f"equivalent within +-{margin}"


def _tost_p(estimate: float, se: float, df: int, margin: float) -> float:
    """The p-value of the two one-sided t-tests of equivalence within ``+-margin`` (> 0)."""
    if not margin > 0:
        raise ValueError(f"tost: the margin must be > 0, got {margin}")
    return max(_t_p(estimate + margin, se, df, "greater"), _t_p(estimate - margin, se, df, "less"))


def blocked_effect(observations, margin: float = MARGIN):
    """The seed-blocked analysis of ``observations``, ``(regime, seed, difference)`` triples (at most one per
    regime and seed): a dict with ``mean`` and its 95% interval ``low``, ``high`` (None below two distinct seeds),
    ``df`` (distinct seeds - 1), ``p`` (the effect against 0), ``tost_p`` (equivalence within ``+-margin``, None
    below two seeds), the counts ``n``, ``regimes`` and ``seeds``, and the regime F-test ``f``, ``df_regime``,
    ``df_residual``, ``p_regime`` (None for one regime or no residual degree of freedom); ``connected`` False (and
    no estimate) where the regimes share too few seeds for their effects to be told from the seeds'.

    The model ``d = mu + a[regime] + b[seed] + e`` is fitted by least squares; ``mean`` is its least-squares mean
    ``mu + mean(a)`` (the unweighted mean over regimes, seed effects summing to 0), a linear combination ``c . d``.
    Its variance is taken with the seeds as independent clusters, ``S / (S - 1) sum_s (sum_{i in s} c_i u_i)^2``
    (``S`` distinct seeds, ``u`` the differences less ``mean`` and their regime's effect, so each seed's own effect
    stays in: seeds are a sample), with Student's t on ``S - 1`` degrees of freedom. For a balanced design this is
    the t-interval of the seeds' means; for one regime, the paired t-interval."""
    observations = list(observations)
    if len({(r, s) for r, s, _ in observations}) != len(observations):
        raise ValueError("blocked_effect: two differences for one (regime, seed)")
    regimes = sorted({r for r, _, _ in observations}, key=str)
    seeds = sorted({s for _, s, _ in observations})
    n, k, m = len(observations), len(regimes), len(seeds)
    y = np.array([d for _, _, d in observations], dtype=float)
    in_regime = np.array([[r == q for q in regimes] for r, _, _ in observations], dtype=float)  # n x k
    in_seed = np.array([[s == q for q in seeds] for _, s, _ in observations], dtype=float)  # n x m
    full = np.hstack([np.ones((n, 1)), in_regime[:, 1:], in_seed[:, 1:]])
    seeds_only = np.hstack([np.ones((n, 1)), in_seed[:, 1:]])
    rss_full, rank_full = _least_squares(full, y)
    result = {"n": n, "regimes": k, "seeds": m, "df": m - 1, "connected": rank_full == k + m - 1,
              "mean": None, "low": None, "high": None, "p": None, "tost_p": None,
              "f": None, "df_regime": None, "df_residual": None, "p_regime": None}
    if not result["connected"]:
        return result
    effects = np.vstack([np.zeros(n), np.linalg.pinv(full)[1:k]])  # k x n: each regime's effect from d
    centred = in_regime @ (effects - effects.mean(axis=0))  # n x n: the effect of each difference's regime
    weights = (in_seed / in_seed.sum(axis=0)).T.mean(axis=0) @ (np.eye(n) - centred)  # c: mean over seeds
    mean = float(weights @ y)
    result["mean"] = mean
    if m >= 2:
        cluster = in_seed.T @ (weights * (y - mean - centred @ y))
        se = math.sqrt(m / (m - 1) * float(cluster @ cluster))
        half = float(sps.t.ppf(0.975, m - 1)) * se
        result.update(low=mean - half, high=mean + half, p=_t_p(mean, se, m - 1),
                      tost_p=_tost_p(mean, se, m - 1, margin))
    df_residual = n - rank_full
    if k > 1 and df_residual > 0:
        rss_seeds, rank_seeds = _least_squares(seeds_only, y)
        df_regime = rank_full - rank_seeds
        f = ((rss_seeds - rss_full) / df_regime) / (rss_full / df_residual) if rss_full > 0 else math.inf
        result.update(f=f, df_regime=df_regime, df_residual=df_residual,
                      p_regime=float(sps.f.sf(f, df_regime, df_residual)) if math.isfinite(f) else 0.0)
    return result


def _t_p(estimate: float, se: float, df: int, alternative: str = "two-sided") -> float:
    """The p-value of ``estimate / se`` on Student's t with ``df`` degrees of freedom against 0: two-sided, or
    one-sided where the alternative is that the true value is ``"greater"`` or ``"less"`` than 0; a zero ``se``
    gives 0 where the estimate lies on the alternative's side, else 1."""
    if se == 0:
        side = {"two-sided": estimate != 0, "greater": estimate > 0, "less": estimate < 0}[alternative]
        return 0.0 if side else 1.0
    t = estimate / se
    return float({"two-sided": 2 * sps.t.sf(abs(t), df), "greater": sps.t.sf(t, df),
                  "less": sps.t.cdf(t, df)}[alternative])


def _least_squares(design, y):
    """``(residual sum of squares, rank)`` of the least-squares fit of ``y`` on ``design``'s columns."""
    coef, _, rank, _ = np.linalg.lstsq(design, y, rcond=None)
    residual = y - design @ coef
    return float(residual @ residual), int(rank)


def burst_rule_counts(bursts, sample):
    """The update-burst rule's record: per ``"in_sample"`` (runs whose ``(tag, arm, seed)`` is in ``sample``, the
    runs it was drawn on) and ``"out_of_sample"``: ``hits`` (burst above ``UPDATE_BURST_WARNING``, LoCo - plain above
    :data:`BURST_LOSS`), ``false_alarms`` (above the line, no such loss), ``misses`` (at or below it, such a loss)
    and ``quiet`` (neither), and the out-of-sample runs themselves. ``bursts``: ``regime_map.burst_rows``."""
    counts = {part: {"hits": 0, "false_alarms": 0, "misses": 0, "quiet": 0} for part in ("in_sample", "out_of_sample")}
    outside = []
    for b in bursts:
        part = "in_sample" if (b["tag"], b["arm"], b["seed"]) in sample else "out_of_sample"
        flagged, lost = b["update_burst"] > UPDATE_BURST_WARNING, b["loco_minus_plain"] > BURST_LOSS
        counts[part][{(True, True): "hits", (True, False): "false_alarms", (False, True): "misses",
                      (False, False): "quiet"}[(flagged, lost)]] += 1
        if part == "out_of_sample":
            outside.append(b)
    return dict(counts, out_of_sample_runs=outside)


def load_burst_sample(path: str = BURST_RULE_SAMPLE):
    """The ``(tag, arm, seed)`` set of the LoCo runs the update-burst rule was drawn on."""
    with open(path) as f:
        return {tuple(run) for run in json.load(f)["runs"]}


def analyse(regimes, rows, bursts, bits_arms, differences, sample=None):
    """The section's numbers as a JSON-ready dict. ``regimes``: ``regime_map.load``'s ``{tag: {arm: {seed:
    record}}}`` (after ``borrow_full``); ``rows``: ``regime_map.regime_rows``' rows; ``bursts``:
    ``regime_map.burst_rows``; ``bits_arms``: ``(bits, plain arm, LoCo arm)`` triples; ``differences``: ``(key,
    label)`` pairs, each key ``<first>_minus_<second>`` of the roles ``plain``, ``loco`` and ``full``; ``sample``: the
    burst rule's sample (:func:`load_burst_sample` when None)."""
    roles = {bits: {"plain": plain, "loco": loco, "full": "full"} for bits, plain, loco in bits_arms}

    def seed_diffs(row, key):
        first, second = (roles[row["bits"]][role] for role in key.split("_minus_"))
        arms = regimes[row["tag"]]
        if first not in arms or second not in arms:
            return {}
        return {s: arms[first][s]["final_val_loss"] - arms[second][s]["final_val_loss"]
                for s in sorted(set(arms[first]) & set(arms[second]))}

    def blocked(members):
        return {key: blocked_effect([(m["tag"], s, d) for m in members for s, d in seed_diffs(m, key).items()])
                if any(seed_diffs(m, key) for m in members) else None for key, _ in differences}

    order = [bits for bits, _, _ in bits_arms]
    by_model, by_w = defaultdict(list), defaultdict(list)
    for r in rows:
        by_model[(r["grid"], r["bits"], r["params"])].append(r)
        by_w[tuple(r[k] for k in W_FAMILY)].append(r)
    models = [dict(grid=grid, bits=bits, params=params, regimes=[m["tag"] for m in members], **blocked(members))
              for (grid, bits, params), members in sorted(by_model.items(), key=lambda g: (
                  g[0][0] != "auto", order.index(g[0][1]), g[0][2]))]
    w_families = [dict(zip(W_FAMILY, key), worlds=[m["world"] for m in members], regimes=[m["tag"] for m in members],
                       **blocked(members))
                  for key, members in sorted(by_w.items(), key=lambda g: (g[0][0], g[0][1] != "auto",
                                                                         order.index(g[0][2]), g[0][3:]))
                  if len({m["world"] for m in members}) > 1]
    families = {}
    for key, _ in differences:
        tests = []
        for r in rows:
            diffs = list(seed_diffs(r, key).values())
            if len(diffs) >= 2:
                n, mean, p = paired_t_test(diffs)
                tost_p, low90, high90 = tost(diffs)
                tests.append({"tag": r["tag"], "bits": r["bits"], "n": n, "mean": mean, "p": p,
                              "tost_p": tost_p, "low90": low90, "high90": high90})
        adjusted, rejected = benjamini_hochberg([t["p"] for t in tests]) if tests else ([], [])
        for t, q, keep in zip(tests, adjusted, rejected):
            t.update(p_bh=q, survives=keep)
        families[key] = {"count": len(tests), "excluding_zero": sum(t["p"] < 0.05 for t in tests),
                         "surviving": sum(t["survives"] for t in tests), "tests": tests}
    return {"margin": MARGIN, "fdr": FDR, "by_model": models, "w_families": w_families, "families": families,
            "burst_rule": burst_rule_counts(bursts, load_burst_sample() if sample is None else sample)}


def _effect(cell) -> str:
    """A :func:`blocked_effect` as table text: mean [95% interval], its degrees of freedom, equivalence."""
    if cell is None:
        return "-"
    if not cell["connected"]:
        return "regimes share too few seeds"
    if cell["low"] is None:
        return f"{cell['mean']:+.4f} (1 seed)"
    mark = " **yes**" if cell["low"] > 0 or cell["high"] < 0 else ""
    label = equivalence_label(cell["p"], cell["tost_p"])
    equivalent = f"; {label}" if label != "not shown" else ""
    regime = f"; regime effect {_regime_test(cell)}" if cell["p_regime"] is not None else ""
    return (f"{cell['mean']:+.4f} [{cell['low']:+.4f}, {cell['high']:+.4f}]{mark} ({cell['regimes']} "
            f"regime{'s' if cell['regimes'] > 1 else ''}, {cell['n']} pairs, {cell['seeds']} seeds: "
            f"{cell['df']} df{equivalent}{regime})")


def _bold_equivalent(label: str) -> str:
    """An :func:`equivalence_label` for the per-regime table: the equivalence shown, in bold."""
    return f"**{label}**" if label.startswith("equivalent") else label


def _regime_test(cell) -> str:
    """The regime F-test of a :func:`blocked_effect` as table text."""
    if cell is None or cell["p_regime"] is None:
        return "-"
    return f"F({cell['df_regime']}, {cell['df_residual']}) = {cell['f']:.2f}, p = {cell['p_regime']:.2g}"


def markdown(analysis, differences) -> str:
    """The section "Statistics with seeds as blocks" of ``map.md`` from :func:`analyse`'s dict."""
    margin = analysis["margin"]
    labels = [label for _, label in differences]
    lines = ["", "#### Statistics with seeds as blocks", "",
             "Regimes of one model size reuse the same seeds (initial weights and batches), so the pools above, which "
             "treat each regime's interval as independent, count a seed once per regime. Here, per model size, bits "
             "and grid, the per-(regime, seed) paired differences are fitted by least squares to regime + seed "
             "effects; the pooled effect is the unweighted mean over the regimes (the fit's least-squares mean), "
             "its 95% interval cluster-robust over the distinct seeds (Student's t on distinct seeds - 1 degrees of "
             "freedom). Unlike the random-effects pool it counts distinct seeds, not regimes' intervals, as "
             "independent, weighs each regime equally (a noisy regime as much as a tight one; the pool weighs by "
             "precision) and uses Student's t on the seeds (not the normal quantile). 'Regime "
             "effect': the F-test of regime + seed against seed alone (do the regimes differ within seeds?). "
             f"'Equivalent within +-{margin}': two one-sided t-tests at 5% (the 90% interval inside +-{margin} "
             f"nats, a margin fixed in advance: 1% of perplexity, and the size of the smallest gain the docs act "
             f"on).", "",
             "| grid | bits | model | " + " | ".join(f"{label} (seed-blocked)" for label in labels) + " |",
             "|" + "---|" * (3 + len(labels))]
    for m in analysis["by_model"]:
        lines.append(f"| {m['grid']} | {m['bits']} | {m['params'] / 1e6:.1f}M | "
                     + " | ".join(_effect(m[key]) for key, _ in differences) + " |")
    lines += ["", "Regimes that differ only in W (same model, bits, grid, steps, warm-up and global batch), seeds as "
              "blocks: does W change the difference?", "",
              "| model | bits | steps | global batch | W | " + " | ".join(f"{label}: regime effect" for label in labels)
              + " |", "|" + "---|" * (5 + len(labels))]
    for w in analysis["w_families"]:
        lines.append(f"| {w['params'] / 1e6:.1f}M | {w['bits']} ({w['grid']}) | {w['steps']} | {w['global_batch']} "
                     f"| {', '.join(str(x) for x in w['worlds'])} | "
                     + " | ".join(_regime_test(w[key]) for key, _ in differences) + " |")
    lines += ["", f"Multiplicity: the paired t-test behind each interval of the regime table, Benjamini-Hochberg at a "
              f"false-discovery rate of {analysis['fdr']:.0%} within each family:", "",
              "| family | intervals | excluding 0 (p < 0.05, uncorrected) | surviving BH | survivors (BH-adjusted p) |",
              "|---|---|---|---|---|"]
    for (key, label) in differences:
        family = analysis["families"][key]
        survivors = "; ".join(f"{t['tag']} {t['bits']} {t['mean']:+.4f} ({t['p_bh']:.2g})"
                              for t in family["tests"] if t["survives"]) or "none"
        lines.append(f"| {label} | {family['count']} | {family['excluding_zero']} | {family['surviving']} | "
                     f"{survivors} |")
    lines += ["", f"Equivalence per regime (two one-sided t-tests at 5%, margin +-{margin} nats; the cell: 90% "
              f"interval, TOST p): 'equivalent' only where the test shows it and the 95% interval holds 0, "
              f"'resolved, inside' where the test passes but the 95% interval excludes 0 (a real difference smaller "
              f"than the margin), 'not shown' elsewhere:", "", "| regime | bits | " + " | ".join(labels) + " |",
              "|" + "---|" * (2 + len(labels))]
    tests = {key: {(t["tag"], t["bits"]): t for t in analysis["families"][key]["tests"]} for key, _ in differences}
    for regime in dict.fromkeys(k for key, _ in differences for k in tests[key]):
        cells = [f"{_bold_equivalent(equivalence_label(t['p'], t['tost_p'], margin))} [{t['low90']:+.4f}, "
                 f"{t['high90']:+.4f}] p = {t['tost_p']:.2g}" if t else "-"
                 for t in (tests[key].get(regime) for key, _ in differences)]
        lines.append(f"| {regime[0]} | {regime[1]} | " + " | ".join(cells) + " |")
    rule = analysis["burst_rule"]
    lines += ["", f"The update-burst rule (burst above {UPDATE_BURST_WARNING} flags a LoCo run that loses more than "
              f"{BURST_LOSS} nats to plain qgZ) on the runs it was drawn on (`burst_rule_sample.json`) and on the "
              f"runs recorded after it was fixed:", "",
              "| runs | hits (flagged, lost) | false alarms (flagged, did not) | misses (not flagged, lost) | quiet |",
              "|---|---|---|---|---|"]
    for part, label in (("in_sample", "in sample"), ("out_of_sample", "out of sample")):
        c = rule[part]
        lines.append(f"| {label} ({sum(c.values())}) | {c['hits']} | {c['false_alarms']} | {c['misses']} | "
                     f"{c['quiet']} |")
    lines += ["", "Out of sample: " + "; ".join(
        f"{b['tag']} {b['arm']} seed {b['seed']}: {b['update_burst']:.2f}, {b['loco_minus_plain']:+.4f}"
        for b in rule["out_of_sample_runs"]) if rule["out_of_sample_runs"] else "Out of sample: no run yet."]
    return "\n".join(lines) + "\n"
