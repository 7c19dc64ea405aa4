"""Convergence benchmark: full precision vs plain qgZ vs qgZ + LoCo, per bit width, per link and with Hadamard.

Trains the demo's Llama-style byte-level model on the bundled plays (whole plays held out for validation) on
``W = nodes x local`` simulated ranks, once per (arm, seed); every arm of a seed starts from the same weights and
sees the same batches. Per arm it reports the mean and spread of the final validation loss over seeds, the
share of the plain-vs-full gap that LoCo closes, and gradient fidelity: the relative error of the communicated
gradient against the exact mean (per step, averaged) and of its running sum (after the last step). The default
arms are issue 6's (equal bits on both hops: 4, 3, 2) and issue 8's (bits per link, e.g. ``loco8-2`` = 8-bit
intra-node and 2-bit inter-node hop, and Hadamard-rotated groups, ``h``); a third table sets issue 8's arms
against its goals.

    python3 benchmarks/convergence.py                       # CPU defaults: 3 seeds x 17 arms x 150 steps
    python3 benchmarks/convergence.py --seeds 0 1 2 3 4 --steps 600 --model-size medium   # on GPUs
    python3 benchmarks/convergence.py --device cuda         # 4 ranks sharing fewer GPUs (through gloo)

Results go to ``--out`` (default ``benchmarks/results/convergence``): ``runs.jsonl`` (one line per finished run,
so an interrupted benchmark resumes with ``--resume``), ``summary.md``, ``convergence.png`` (the equal-bits arms)
and ``convergence_bits.png`` (the per-link and Hadamard arms, with full and plain2 for reference).
"""
import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # run from a checkout without installing

from loco_lab.arms import Arm, RunSpec, parse_arms, record_arm  # noqa: E402
from loco_lab.launcher import gpu_count, launch  # noqa: E402
from loco_lab.model import SIZES  # noqa: E402
from deepspeed_loco.simulation.charts import Panel, Series, line_chart  # noqa: E402
from deepspeed_loco.simulation.loss_chart import arm_color  # noqa: E402
from deepspeed_loco.simulation.results_table import human_bytes  # noqa: E402
from loco_lab.run import describe  # noqa: E402
from deepspeed_loco.layout.wire import wire_bytes_per_element  # noqa: E402
from deepspeed_loco.utils.stats import ema, mean_sd  # noqa: E402

BIT_WIDTH_ARMS = "full,plain4,loco4,plain3,loco3,plain2,loco2"  # issue 6: the same bits on both hops
PER_LINK_ARMS = "loco8-4,plain8-2,loco8-2,plain4h,loco4h,loco8-4h,plain8-2h,loco8-2h,plain2h,loco2h"  # issue 8
DEFAULT_ARMS = f"{BIT_WIDTH_ARMS},{PER_LINK_ARMS}"
TRAIN_EMA_BETA = 0.95  # the plotted train loss: this EMA of the per-step seed mean
GAP_REFERENCE = "plain2"  # issue 8 measures every arm against the gap between plain 2/2-bit qgZ and full precision
GOAL_GAP_SHARE = 0.75  # issue 8 goal: LoCo with a 2-bit inter-node hop closes this share of that gap ...
GOAL_INTER_BITS = 4.25  # ... and an arm with at most this many inter-node wire bits per element (scales included)
GOAL_LOSS_PCT = 0.3  # ... ends within this many percent of full precision's validation loss


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--arms", default=DEFAULT_ARMS,
                   help=f"comma list of arms: full, plainN/locoN (both hops N bits), plainI-O/locoI-O (intra-node I, "
                        f"inter-node O bits), a trailing h for Hadamard; issue 6's arms are {BIT_WIDTH_ARMS}, issue "
                        f"8's add {PER_LINK_ARMS}")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--model-size", choices=sorted(SIZES), default="small")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--group-size", type=int, default=256)
    p.add_argument("--err-beta", type=float, default=0.8)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--local", type=int, default=2)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: CUDA if there is one GPU per rank, else CPU; cuda with fewer GPUs than ranks: the "
                        "ranks share the GPUs round-robin")
    p.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto",
                   help="collectives; auto: NCCL on CUDA with one GPU per rank, else gloo")
    p.add_argument("--dtype", choices=("auto", "fp32", "bf16"), default="auto",
                   help="training dtype; auto: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--eval-windows", type=int, default=192)
    p.add_argument("--out", default=os.path.join(HERE, "results", "convergence"))
    p.add_argument("--resume", action="store_true", help="skip (arm, seed) runs already in runs.jsonl")
    p.add_argument("--summarize", action="store_true", help="only rebuild summary.md and the PNGs from runs.jsonl")
    return p.parse_args(argv)


def base_spec(args) -> RunSpec:
    """The run's ``RunSpec`` without arms; ``--device``, ``--backend`` and ``--dtype`` resolved on this host."""
    from loco_lab.cli import resolve_backend, resolve_device
    world = args.nodes * args.local
    device = resolve_device(args.device, world)
    backend = resolve_backend(args.backend, device, world)
    dtype = args.dtype if args.dtype != "auto" else ("bf16" if device == "cuda" else "fp32")
    return RunSpec(model=SIZES[args.model_size], arms=(), steps=args.steps, micro_batch=args.micro_batch, lr=args.lr,
                   warmup=max(1, args.steps // 10), group_size=args.group_size, err_beta=args.err_beta,
                   nodes=args.nodes, local=args.local, device=device, backend=backend, dtype=dtype,
                   eval_every=args.eval_every, eval_windows=args.eval_windows, out_dir=args.out, fidelity=True)


def load_runs(path):
    runs = []
    if os.path.exists(path):
        with open(path) as f:
            runs = [json.loads(line) for line in f if line.strip()]
    return runs


def run_all(args) -> None:
    try:
        arms = parse_arms(args.arms, 4)
    except ValueError as err:
        raise SystemExit(f"--arms: {err}")
    try:
        spec = base_spec(args)
    except ValueError as err:  # --device / --backend this host cannot run
        raise SystemExit(str(err))
    gpus = gpu_count() if spec.device == "cuda" else 0
    os.makedirs(args.out, exist_ok=True)
    runs_path = os.path.join(args.out, "runs.jsonl")
    done = {(r["key"], r["arm"]["seed"]) for r in load_runs(runs_path)} if args.resume else set()
    if not args.resume and os.path.exists(runs_path):
        os.rename(runs_path, runs_path + f".{int(time.time())}.bak")
    print(describe(spec), flush=True)
    for seed in args.seeds:
        todo = [dataclasses.replace(a, seed=seed) for a in arms if (a.key, seed) not in done]
        if not todo:
            continue
        started = time.monotonic()

        def on_message(message, seed=seed):
            if message[0] == "arm":
                r = message[2]
                r["setup"] = {"steps": spec.steps, "model": spec.model.to_dict(), "nodes": spec.nodes,
                              "local": spec.local, "device": spec.device, "backend": spec.backend, "gpus": gpus,
                              "dtype": spec.dtype, "micro_batch": spec.micro_batch, "lr": spec.lr,
                              "group_size": spec.group_size, "err_beta": spec.err_beta}
                with open(runs_path, "a") as f:
                    f.write(json.dumps(r) + "\n")
                fid = r.get("fidelity", {})
                print(f"[seed {seed}] {r['label']:>30}: val {r['val_loss']:.4f} train {r['train_loss']:.4f} "
                      f"grad err {fid.get('grad_rel_error_mean', float('nan')):.4f} "
                      f"sum err {fid.get('sum_rel_error_final', float('nan')):.4f} "
                      f"step {r['step_time_s'] * 1000:.0f} ms  ({time.monotonic() - started:.0f} s)", flush=True)

        launch(spec.with_arms(todo), on_message=on_message)
    summarize(args)


def _measured(values):
    """``(mean, sd, n)`` over the runs that measured a finite value (records without one and diverged runs are left
    out)."""
    return mean_sd([v for v in values if v is not None and math.isfinite(v)])


def wire_bits(bits, group_size):
    """Bits per element on a hop of ``bits``-bit groups of ``group_size`` with one fp32 scale each (None if unknown)."""
    return 8 * wire_bytes_per_element(bits, group_size) if group_size else None


def summarize(args) -> str:
    """Rebuilds ``summary.md`` and the PNGs from ``runs.jsonl``; returns the summary's text.

    Only runs of ``args.seeds`` count, so every arm is compared over the same seeds (extra seeds of some arms
    stay in ``runs.jsonl``). The summary holds the setup, one row per arm over its seeds, the plain-vs-LoCo gap
    per quantization, and issue 8's bits-per-link table with its goals. Of each record it reads ``key``, ``arm.seed``, ``label``, ``setup`` and the
    measurements, so records from before the per-link arms (whose ``arm`` holds one ``bits``) are read alike.
    """
    runs = [r for r in load_runs(os.path.join(args.out, "runs.jsonl")) if r["arm"]["seed"] in args.seeds]
    if not runs:
        raise SystemExit(f"no runs of seeds {args.seeds} in {args.out}/runs.jsonl")
    by = {}
    for r in runs:
        by.setdefault(r["key"], {})[r["arm"]["seed"]] = r
    order = [a.key for a in parse_arms(DEFAULT_ARMS, 4)]
    keys = [k for k in order if k in by] + sorted(k for k in by if k not in order)
    arms = {k: record_arm(next(iter(by[k].values()))) for k in keys}
    stats = {k: _measured([r["val_loss"] for r in by[k].values()]) for k in keys}
    lines = [_setup_line(runs), ""]
    lines += _md(_arm_rows(by, keys, stats))
    lines.append("")
    lines += _md(_gap_rows(by, keys, arms, stats))
    lines += ["", f"Bits per link (issue 8): wire bits per element include one fp32 scale per group; 'vs full' is "
                  f"(arm - full) / full; 'gap closed' is ({GAP_REFERENCE} - arm) / ({GAP_REFERENCE} - full), "
                  f"of seed means.", ""]
    lines += _md(_link_rows(by, keys, arms, stats))
    lines.append("")
    lines += _goal_lines(by, keys, arms, stats)
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(text)
    width_keys = [k for k in keys if _same_bits_arm(arms[k])]
    link_keys = [k for k in keys if k in ("full", GAP_REFERENCE) or not _same_bits_arm(arms[k])]
    if width_keys:
        with open(os.path.join(args.out, "convergence.png"), "wb") as f:
            f.write(_plot(by, width_keys, arms, "convergence: full precision vs plain qgZ vs qgZ + LoCo, the same "
                                                "bits on both hops"))
    if any(not _same_bits_arm(arms[k]) for k in link_keys):
        with open(os.path.join(args.out, "convergence_bits.png"), "wb") as f:
            f.write(_plot(by, link_keys, arms, "bits per link and Hadamard (legend: arm keys, e.g. loco8-2h = LoCo, "
                                               "8-bit intra-node and 2-bit inter-node hop, Hadamard)",
                          key_labels=True, panel_size=(640, 480)))
    print(text)
    return text


def gap_closed(full, plain, loco):
    """``(plain - loco) / (plain - full)``: 1 = LoCo matches full precision, 0 = no better than plain qgZ; None where
    a value is missing or plain equals full."""
    if None in (full, plain, loco) or plain == full:
        return None
    return (plain - loco) / (plain - full)


def _same_bits_arm(arm: Arm) -> bool:
    """Issue 6's arms: full precision, or the same bits on both hops without Hadamard."""
    return arm.kind == "full" or (arm.intra_bits == arm.inter_bits and not arm.hadamard)


def _setup_line(runs) -> str:
    setup = runs[0].get("setup", {})
    m = setup.get("model", {})
    world = setup.get("nodes", 0) * setup.get("local", 0)
    where = ", ".join(str(setup[k]) for k in ("device", "backend") if setup.get(k))
    if setup.get("gpus") and setup["gpus"] < world:
        where += f", sharing {setup['gpus']} GPU(s)"
    return (f"Setup: Llama-style byte LM {m.get('layers')} layers x {m.get('dim')} wide, context {m.get('seq_len')} "
            f"({runs[0]['parameters'] / 1e6:.2f}M parameters, {setup.get('dtype')}), {setup.get('nodes')} nodes x "
            f"{setup.get('local')} ranks ({where}), {setup.get('steps')} steps, global batch "
            f"{setup.get('micro_batch', 0) * world} x {m.get('seq_len')} bytes, AdamW lr {setup.get('lr')}, group size "
            f"{setup.get('group_size')}, err_beta {setup.get('err_beta')}; validation on held-out plays.")


def _arm_rows(by, keys, stats):
    """One row per arm: validation loss over seeds, train loss, gradient fidelity, bytes and step time."""
    rows = [["arm", "seeds", "val loss mean", "val sd", "val min..max", "train loss mean", "grad rel. err",
             "running-sum rel. err", "bytes/step/rank", "step time"]]
    for key in keys:
        seeds = by[key]
        vals = [r["val_loss"] for r in seeds.values()]
        mean, sd, n = stats[key]
        grad = _measured([r.get("fidelity", {}).get("grad_rel_error_mean") for r in seeds.values()])
        summ = _measured([r.get("fidelity", {}).get("sum_rel_error_final") for r in seeds.values()])
        first = next(iter(seeds.values()))
        rows.append([first["label"], str(n), f"{mean:.4f}", _fmt_sd(sd, n), f"{min(vals):.4f}..{max(vals):.4f}",
                     f"{_measured([r['train_loss'] for r in seeds.values()])[0]:.4f}", _fmt(grad[0]), _fmt(summ[0]),
                     human_bytes(first["bytes_per_step"]),
                     f"{statistics.median(r['step_time_s'] for r in seeds.values()) * 1000:.0f} ms"])
    return rows


def _gap_rows(by, keys, arms, stats):
    """One row per LoCo arm whose plain twin (same bits, same rotation) ran: the plain-vs-full gap LoCo closes."""
    rows = [["bits", "plain - full (mean)", "loco - full (mean)", "gap LoCo closes (of means)",
             "plain - loco per seed (paired)", "paired mean +- sd"]]
    full = stats.get("full")
    for key in keys:
        arm = arms[key]
        plain_key = dataclasses.replace(arm, kind="plain").key if arm.kind == "loco" else None
        if plain_key not in by:
            continue
        plain, loco = by[plain_key], by[key]
        paired = [plain[s]["val_loss"] - loco[s]["val_loss"] for s in sorted(plain) if s in loco]
        pm, psd, pn = _measured(paired)
        plain_mean, loco_mean = stats[plain_key][0], stats[key][0]
        if full is None:
            plain_gap = loco_gap = share_text = "-"
        else:
            gap = plain_mean - full[0]
            share = gap_closed(full[0], plain_mean, loco_mean)
            noise = max((stats[k][1] for k in ("full", plain_key) if stats[k][2] > 1), default=math.nan)
            if share is None:
                share_text = "-"
            elif gap <= 0:
                share_text = "n/a (plain not worse than full)"
            else:
                share_text = f"{share:+.0%}" + (" (gap < 2 seed sd: noise)" if gap < 2 * noise else "")
            plain_gap, loco_gap = f"{gap:+.4f}", f"{loco_mean - full[0]:+.4f}"
        rows.append([arm.widths + (" + Hadamard" if arm.hadamard else ""), plain_gap, loco_gap, share_text,
                     " ".join(f"{d:+.4f}" for d in paired), f"{pm:+.4f} +- {_fmt_sd(psd, pn)}"])
    return rows


def _group_size(seeds):
    return next(iter(seeds.values())).get("setup", {}).get("group_size")


def _vs_full_pct(stats, key):
    """``(arm - full) / full * 100`` of the seed means; None without a full-precision arm."""
    if "full" not in stats:
        return None
    full = stats["full"][0]
    return (stats[key][0] - full) / full * 100


def _reference_share(stats, key):
    """``(plain2 - arm) / (plain2 - full)`` of the seed means; None without both references or without a gap."""
    if "full" not in stats or GAP_REFERENCE not in stats or stats[GAP_REFERENCE][0] <= stats["full"][0]:
        return None
    return gap_closed(stats["full"][0], stats[GAP_REFERENCE][0], stats[key][0])


def _link_rows(by, keys, arms, stats):
    """Issue 8's table: one row per quantized arm, its bits per link and where it lands between plain2 and full."""
    rows = [["arm", "intra bits", "inter bits", "Hadamard", "inter-node bits/elem", "intra-node bits/elem",
             "val loss mean +- sd (n)", "vs full", f"{GAP_REFERENCE}-to-full gap closed", "bytes/step/rank"]]
    for key in keys:
        arm = arms[key]
        if arm.kind == "full":
            continue
        seeds = by[key]
        group = _group_size(seeds)
        mean, sd, n = stats[key]
        pct, share = _vs_full_pct(stats, key), _reference_share(stats, key)
        rows.append([next(iter(seeds.values()))["label"], str(arm.intra_bits), str(arm.inter_bits),
                     "yes" if arm.hadamard else "no", _bits(wire_bits(arm.inter_bits, group)),
                     _bits(wire_bits(arm.intra_bits, group)), f"{mean:.4f} +- {_fmt_sd(sd, n)} ({n})",
                     "-" if pct is None else f"{pct:+.2f}%", "-" if share is None else f"{share:+.1%}",
                     human_bytes(next(iter(seeds.values()))["bytes_per_step"])])
    return rows


def _goal_lines(by, keys, arms, stats):
    """Issue 8's two goals against the numbers: the gap LoCo closes at 2 inter-node bits, and the loss at ~4 bits."""
    return [_gap_goal(keys, arms, stats), _loss_goal(by, keys, arms, stats)]


def _gap_goal(keys, arms, stats) -> str:
    goal = (f"Goal: LoCo with a 2-bit inter-node hop closes >= {GOAL_GAP_SHARE:.0%} of the {GAP_REFERENCE}-to-full "
            f"gap: ")
    if "full" not in stats or GAP_REFERENCE not in stats:
        return goal + f"not measured (needs the arms full and {GAP_REFERENCE})"
    gap = stats[GAP_REFERENCE][0] - stats["full"][0]
    if gap <= 0:
        return goal + f"not measurable: {GAP_REFERENCE} - full = {gap:+.4f}, there is no gap to close"
    candidates = [k for k in keys if arms[k].kind == "loco" and arms[k].inter_bits == 2]
    if not candidates:
        return goal + "not measured (no LoCo arm with a 2-bit inter-node hop ran)"
    best = max(candidates, key=lambda k: _reference_share(stats, k))
    share = _reference_share(stats, best)
    verdict = "met" if share >= GOAL_GAP_SHARE else f"not met, {(GOAL_GAP_SHARE - share) * 100:.1f} points short"
    return (goal + f"best is {arms[best].label} ({best}), closing {share:+.1%} of {GAP_REFERENCE} - full = "
            f"{gap:+.4f} ({stats[best][2]} seeds): {verdict}")


def _loss_goal(by, keys, arms, stats) -> str:
    goal = (f"Goal: an arm with <= {GOAL_INTER_BITS:g} inter-node bits per element ends within "
            f"{GOAL_LOSS_PCT:g}% of full precision's validation loss: ")
    if "full" not in stats:
        return goal + "not measured (needs the arm full)"
    candidates = [k for k in keys if arms[k].kind != "full"
                  and (wire_bits(arms[k].inter_bits, _group_size(by[k])) or math.inf) <= GOAL_INTER_BITS]
    if not candidates:
        return goal + f"not measured (no arm with <= {GOAL_INTER_BITS:g} inter-node bits per element ran)"
    full_mean, full_sd, full_n = stats["full"]
    reference = f" (full: {full_mean:.4f} +- {_fmt_sd(full_sd, full_n)})"
    met = [k for k in candidates if _vs_full_pct(stats, k) <= GOAL_LOSS_PCT]
    if met:
        return goal + "met by " + ", ".join(f"{k} ({_vs_full_pct(stats, k):+.2f}%)" for k in met) + reference
    closest = min(candidates, key=lambda k: _vs_full_pct(stats, k))
    pct = _vs_full_pct(stats, closest)
    return (goal + f"not met; closest is {arms[closest].label} ({closest}) at {pct:+.2f}%, "
            f"{pct - GOAL_LOSS_PCT:.2f} points over" + reference)


def _bits(value):
    return "-" if value is None else f"{value:.3f}"


def _fmt_sd(sd, n):
    """A seed sd, ``"-"`` below two seeds (where there is no spread to show)."""
    return f"{sd:.4f}" if n > 1 else "-"


def _fmt(v):
    if v is None or not math.isfinite(v):
        return "-"
    return f"{v:.1e}" if v < 1e-3 else f"{v:.4f}"


def _md(rows):
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    out.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return out


def _plot(by, keys, arms, title, key_labels=False, panel_size=(560, 400)) -> bytes:
    """Seed-mean curves of ``keys``: train loss (EMA), validation loss, running-sum gradient error.

    ``key_labels``: the legend names arms by key (``loco8-2h``), which keeps it narrow for many arms.
    """
    train, val, err = [], [], []
    for key in keys:
        seeds = list(by[key].values())
        first = seeds[0]
        color, label = arm_color(arms[key]), key if key_labels else first["label"]
        n = min(len(r["train_losses"]) for r in seeds)
        mean_train = [statistics.fmean(r["train_losses"][i] for r in seeds) for i in range(n)]
        train.append(Series(label, list(enumerate(ema(mean_train, TRAIN_EMA_BETA), start=1)), color))
        steps = [s for s, _ in first["validation"]]
        val.append(Series(label, [(s, statistics.fmean(dict(r["validation"])[s] for r in seeds)) for s in steps
                                  if all(s in dict(r["validation"]) for r in seeds)], color, markers=True))
        sums = [r.get("fidelity", {}).get("sum_rel_errors") for r in seeds]
        if all(sums):
            k = min(len(s) for s in sums)
            err.append(Series(label, [(i + 1, statistics.fmean(s[i] for s in sums)) for i in range(k)], color))
    skip = max(len(s.points) for s in train) // 5
    tail = [y for s in train for x, y in s.points if x > skip]
    panels = [Panel("train loss (seed mean, EMA, zoomed past the first drop)", "step", "loss (nats)", train,
                    (min(tail), max(tail)) if tail else None),
              Panel("validation loss (seed mean, every point)", "step", "loss (nats)", val)]
    if err:
        top = max(y for s in err for _, y in s.points)
        panels.append(Panel("running-sum grad rel. error", "step", "||sum sent - sum exact|| / ||sum exact||", err,
                            (0.0, top)))
    return line_chart(panels, title=title, panel_size=panel_size)


def main(argv=None):
    args = parse_args(argv)
    if args.summarize:
        summarize(args)
    else:
        run_all(args)


if __name__ == "__main__":
    main()
