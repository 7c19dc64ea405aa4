"""Convergence benchmark: full precision vs plain qgZ vs qgZ + LoCo at 4, 3 and 2 bits, over several seeds.

Trains the demo's Llama-style byte-level model on the bundled plays (whole plays held out for validation) on
``W = nodes x local`` simulated ranks, once per (arm, seed); every arm of a seed starts from the same weights and
sees the same batches. Per arm it reports the mean and spread of the final validation loss over seeds, the
share of the plain-vs-full gap that LoCo closes, and gradient fidelity: the relative error of the communicated
gradient against the exact mean (per step, averaged) and of its running sum (after the last step).

    python3 benchmarks/convergence.py                       # CPU defaults: 3 seeds x 7 arms x 150 steps
    python3 benchmarks/convergence.py --seeds 0 1 2 3 4 --steps 600 --model-size medium   # on GPUs

Results go to ``--out`` (default ``benchmarks/results/convergence``): ``runs.jsonl`` (one line per finished run,
so an interrupted benchmark resumes with ``--resume``), ``summary.md`` and ``convergence.png``.
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

from deepspeed_loco.demo.arms import RunSpec, parse_arms  # noqa: E402
from deepspeed_loco.demo.launcher import launch  # noqa: E402
from deepspeed_loco.demo.model import SIZES  # noqa: E402
from deepspeed_loco.demo.png import Panel, Series, line_chart  # noqa: E402
from deepspeed_loco.demo.report import _color, ema, gap_closed, human_bytes  # noqa: E402
from deepspeed_loco.demo.run import describe  # noqa: E402

DEFAULT_ARMS = "full,plain4,loco4,plain3,loco3,plain2,loco2"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--arms", default=DEFAULT_ARMS)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--model-size", choices=sorted(SIZES), default="small")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--group-size", type=int, default=256)
    p.add_argument("--err-beta", type=float, default=0.8)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--local", type=int, default=2)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--eval-windows", type=int, default=192)
    p.add_argument("--out", default=os.path.join(HERE, "results", "convergence"))
    p.add_argument("--resume", action="store_true", help="skip (arm, seed) runs already in runs.jsonl")
    p.add_argument("--summarize", action="store_true", help="only rebuild summary.md and the PNG from runs.jsonl")
    return p.parse_args(argv)


def base_spec(args) -> RunSpec:
    from deepspeed_loco.cli import resolve_device
    device = resolve_device(args.device, args.nodes * args.local)
    return RunSpec(model=SIZES[args.model_size], arms=(), steps=args.steps, micro_batch=args.micro_batch, lr=args.lr,
                   warmup=max(1, args.steps // 10), group_size=args.group_size, err_beta=args.err_beta,
                   nodes=args.nodes, local=args.local, device=device, dtype="bf16" if device == "cuda" else "fp32",
                   eval_every=args.eval_every, eval_windows=args.eval_windows, out_dir=args.out, fidelity=True)


def load_runs(path):
    runs = []
    if os.path.exists(path):
        with open(path) as f:
            runs = [json.loads(line) for line in f if line.strip()]
    return runs


def run_all(args) -> None:
    os.makedirs(args.out, exist_ok=True)
    runs_path = os.path.join(args.out, "runs.jsonl")
    done = {(r["key"], r["arm"]["seed"]) for r in load_runs(runs_path)} if args.resume else set()
    if not args.resume and os.path.exists(runs_path):
        os.rename(runs_path, runs_path + f".{int(time.time())}.bak")
    spec = base_spec(args)
    arms = parse_arms(args.arms, 4)
    print(describe(spec), flush=True)
    for seed in args.seeds:
        todo = [dataclasses.replace(a, seed=seed) for a in arms if (a.key, seed) not in done]
        if not todo:
            continue
        started = time.monotonic()

        def on_message(message, seed=seed, todo=todo):
            if message[0] == "arm":
                r = message[2]
                r["setup"] = {"steps": spec.steps, "model": spec.model.to_dict(), "nodes": spec.nodes,
                              "local": spec.local, "device": spec.device, "dtype": spec.dtype,
                              "micro_batch": spec.micro_batch, "lr": spec.lr, "group_size": spec.group_size,
                              "err_beta": spec.err_beta}
                with open(runs_path, "a") as f:
                    f.write(json.dumps(r) + "\n")
                fid = r.get("fidelity", {})
                print(f"[seed {seed}] {r['label']:>18}: val {r['val_loss']:.4f} train {r['train_loss']:.4f} "
                      f"grad err {fid.get('grad_rel_error_mean', float('nan')):.4f} "
                      f"sum err {fid.get('sum_rel_error_final', float('nan')):.4f} "
                      f"step {r['step_time_s'] * 1000:.0f} ms  ({time.monotonic() - started:.0f} s)", flush=True)
            elif message[0] == "log":
                pass

        launch(spec.with_arms(todo), on_message=on_message)
    summarize(args)


def _mean_sd(values):
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return float("nan"), float("nan"), 0
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else float("nan"), len(values)


def summarize(args) -> str:
    runs = load_runs(os.path.join(args.out, "runs.jsonl"))
    if not runs:
        raise SystemExit(f"no runs in {args.out}/runs.jsonl")
    by = {}
    for r in runs:
        by.setdefault(r["key"], {})[r["arm"]["seed"]] = r
    order = [a.key for a in parse_arms(DEFAULT_ARMS, 4)]
    keys = [k for k in order if k in by] + sorted(k for k in by if k not in order)
    setup = runs[0].get("setup", {})
    lines = []
    m = setup.get("model", {})
    lines.append(f"Setup: Llama-style byte LM {m.get('layers')} layers x {m.get('dim')} wide, context "
                 f"{m.get('seq_len')} ({runs[0]['parameters'] / 1e6:.2f}M parameters, {setup.get('dtype')}), "
                 f"{setup.get('nodes')} nodes x {setup.get('local')} ranks ({setup.get('device')}), "
                 f"{setup.get('steps')} steps, global batch {setup.get('micro_batch', 0) * setup.get('nodes', 0) * setup.get('local', 0)}"
                 f" x {m.get('seq_len')} bytes, AdamW lr {setup.get('lr')}, group size {setup.get('group_size')}, "
                 f"err_beta {setup.get('err_beta')}; validation on held-out plays.")
    lines.append("")
    header = ["arm", "seeds", "val loss mean", "val sd", "val min..max", "train loss mean", "grad rel. err",
              "running-sum rel. err", "bytes/step/rank", "step time"]
    rows = [header]
    stats, sds = {}, {}
    for key in keys:
        seeds = by[key]
        vals = [r["val_loss"] for r in seeds.values()]
        mean, sd, n = _mean_sd(vals)
        stats[key] = mean
        sds[key] = sd
        grad = _mean_sd([r.get("fidelity", {}).get("grad_rel_error_mean") for r in seeds.values()])
        summ = _mean_sd([r.get("fidelity", {}).get("sum_rel_error_final") for r in seeds.values()])
        first = next(iter(seeds.values()))
        rows.append([first["label"], str(n), f"{mean:.4f}", f"{sd:.4f}", f"{min(vals):.4f}..{max(vals):.4f}",
                     f"{_mean_sd([r['train_loss'] for r in seeds.values()])[0]:.4f}", _fmt(grad[0]), _fmt(summ[0]),
                     human_bytes(first["bytes_per_step"]),
                     f"{statistics.median(r['step_time_s'] for r in seeds.values()) * 1000:.0f} ms"])
    lines += _md(rows)
    lines.append("")
    gap_rows = [["bits", "plain - full (mean)", "loco - full (mean)", "gap LoCo closes (of means)",
                 "plain - loco per seed (paired)", "paired mean +- sd"]]
    full = by.get("full", {})
    for bits in (8, 4, 3, 2):
        plain, loco = by.get(f"plain{bits}"), by.get(f"loco{bits}")
        if not plain or not loco:
            continue
        paired = [plain[s]["val_loss"] - loco[s]["val_loss"] for s in sorted(plain) if s in loco]
        pm, psd, _ = _mean_sd(paired)
        share = gap_closed(stats.get("full"), stats[f"plain{bits}"], stats[f"loco{bits}"]) if full else None
        noise = max((sds.get(k, float("nan")) for k in ("full", f"plain{bits}")), default=float("nan"))
        gap = stats[f"plain{bits}"] - stats["full"] if full else float("nan")
        if share is None:
            share_text = "-"
        elif gap <= 0:
            share_text = "n/a (plain not worse than full)"
        else:
            share_text = f"{share:+.0%}" + (" (gap < 2 seed sd: noise)" if gap < 2 * noise else "")
        gap_rows.append([str(bits), f"{stats[f'plain{bits}'] - stats['full']:+.4f}" if full else "-",
                         f"{stats[f'loco{bits}'] - stats['full']:+.4f}" if full else "-",
                         share_text,
                         " ".join(f"{d:+.4f}" for d in paired), f"{pm:+.4f} +- {psd:.4f}"])
    lines += _md(gap_rows)
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "convergence.png"), "wb") as f:
        f.write(_plot(by, keys))
    print(text)
    return text


def _fmt(v):
    if v is None or not math.isfinite(v):
        return "-"
    return f"{v:.1e}" if v < 1e-3 else f"{v:.4f}"


def _md(rows):
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    out.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return out


def _plot(by, keys) -> bytes:
    """Seed-mean curves: train loss (EMA), validation loss, running-sum gradient error."""
    train, val, err = [], [], []
    for key in keys:
        seeds = list(by[key].values())
        first = seeds[0]
        color, label = _color(first["arm"]), first["label"]
        n = min(len(r["train_losses"]) for r in seeds)
        mean_train = [statistics.fmean(r["train_losses"][i] for r in seeds) for i in range(n)]
        train.append(Series(label, list(enumerate(ema(mean_train, 0.95), start=1)), color))
        steps = [s for s, _ in first["validation"]]
        val.append(Series(label, [(s, statistics.fmean(dict(r["validation"])[s] for r in seeds)) for s in steps
                                  if all(s in dict(r["validation"]) for r in seeds)], color, markers=True))
        sums = [r.get("fidelity", {}).get("sum_rel_errors") for r in seeds]
        if all(sums):
            k = min(len(s) for s in sums)
            err.append(Series(label, [(i + 1, statistics.fmean(s[i] for s in sums)) for i in range(k)], color))
    skip = max(len(s.points) for s in train) // 5
    tail = [y for s in train for x, y in s.points if x > skip]
    vtail = [y for s in val for x, y in s.points if x > 0]
    panels = [Panel("train loss (seed mean, EMA)", "step", train, (min(tail), max(tail)) if tail else None),
              Panel("validation loss (seed mean)", "step", val, (min(vtail), max(vtail)) if vtail else None)]
    if err:
        panels.append(Panel("running-sum grad rel. error", "step", err, (0.0, max(y for s in err for _, y in s.points))))
    return line_chart(panels, title="convergence: full precision vs plain qgZ vs qgZ + LoCo")


def main(argv=None):
    args = parse_args(argv)
    if args.summarize:
        summarize(args)
    else:
        run_all(args)


if __name__ == "__main__":
    main()
