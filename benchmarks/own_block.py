"""What quantizing a rank's own block costs (issue 56, item 3): in each hop a rank sends one block to itself, which
never travels, yet plain qgZ and LoCo quantize it like the others (and LoCo keeps its error).

On real per-rank gradients (the bundled byte-level model on the bundled plays, ``W = nodes x local`` ranks, a few
AdamW steps of full-precision training so the gradients are not those at initialization), this computes the two-hop
reduce's communicated mean twice with the library's reference quantizer, plain (no error feedback): as shipped
(every block quantized) and with each rank's own block kept exact (hop 1: the block for its own local index; hop 2:
the row for its own node). It prints, per bit setting, the relative error of the mean both ways and the share of each
hop's quantization-error power that falls on own blocks, and the error-buffer rows an exact own block would save.
With ``--loco`` every quantizing step compensates with LoCo's error feedback (fp32 buffers, ``err_beta`` 0.8, one
per rank, hop and parameter; an exact own block keeps none) and the table adds the accumulated error: the relative
error of the means summed over the steps, which error feedback exists to keep small.

    OMP_NUM_THREADS=2 python3 benchmarks/own_block.py [--size small] [--nodes 2] [--local 8] [--steps 5] [--loco]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deepspeed_loco.layout import padded_partition_size, slot_to_row  # noqa: E402
from deepspeed_loco.layout.hop_plan import resolve_grid  # noqa: E402
from deepspeed_loco.ops.loco_reference import partition_rows  # noqa: E402
from deepspeed_loco.ops.quantizer import dequantize_groups, quantize_groups  # noqa: E402
from loco_lab.data import ByteCorpus  # noqa: E402
from loco_lab.model import SIZES, ByteLlama  # noqa: E402

GROUP = 256


def rank_gradients(size, world, micro_batch, steps, seed=0):
    """Per step, the list of each rank's flat fp32 gradient of every parameter ``[[rank grads per parameter]]``."""
    torch.manual_seed(seed)
    cfg = SIZES[size]
    model, corpus = ByteLlama(cfg), ByteCorpus()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = []
    for step in range(steps):
        ranks = []
        for rank in range(world):
            x, y = corpus.train_batch(step, seed, world * micro_batch, cfg.seq_len, rank, world)
            model.zero_grad()
            model(x, y).backward()
            ranks.append([p.grad.detach().float().reshape(-1).clone() for p in model.parameters()])
        for p, *gs in zip(model.parameters(), *ranks):
            p.grad = torch.stack(gs).mean(0).view_as(p)
        opt.step()
        out.append(ranks)
    return out


BETA = 0.8


def quantized(rows, bits, grid, errors=None, key=None, own=None):
    """``rows`` fp32 ``(R, P')`` as they arrive after quantization to ``bits``; with ``errors`` (a dict of fp32 error
    buffers, LoCo) compensated by and updating ``errors[key]``, whose rows ``own`` (a slice, or None) stay zero."""
    e = errors.get(key, torch.zeros_like(rows)) if errors is not None else None
    c = rows + e if e is not None else rows
    q, scale = quantize_groups(c, bits, GROUP, grid)
    deq = dequantize_groups(q, scale, GROUP, grid)
    if e is not None:
        new = e * BETA + (c - deq) * (1 - BETA)
        if own is not None:
            new[own] = 0
        errors[key] = new
    return deq


def reduce_mean(grads, nodes, local, bits, grid, own_exact, errors=None, param=0):
    """The two-hop reduce of one parameter's rank gradients ``grads`` (W flat tensors) to the mean's ``(W, P')``
    rows, every block quantized or each rank's own block exact; also the error power of each hop's quantization, on
    own blocks and on all. ``errors``: None (plain qgZ) or the LoCo error buffers of every rank, updated."""
    world = nodes * local
    slots = slot_to_row(world, local)
    sent = []  # per rank (n, d): hop-1 rows in slot order, as they arrive (dequantized, or exact for the own block)
    powers = {"hop1_own": 0.0, "hop1": 0.0, "hop2_own": 0.0, "hop2": 0.0}
    for rank, grad in enumerate(grads):
        rows = partition_rows(grad, world, GROUP)[slots]
        d = rank % local
        own = slice(d * nodes, (d + 1) * nodes)
        deq = quantized(rows, bits[0], grid, errors, (param, rank, 1), own if own_exact else None)
        err = (rows - deq).pow(2).sum(1)
        powers["hop1"] += float(err.sum())
        powers["hop1_own"] += float(err[own].sum())
        if own_exact:
            deq[own] = rows[own]
        sent.append(deq)
    means = torch.zeros(world, sent[0].shape[1])
    for n in range(nodes):
        for d in range(local):
            # rank (n, d) sums block d of every rank of its node: rows for partitions m*L + d, m = 0..M-1
            total = sum(sent[n * local + peer][d * nodes:(d + 1) * nodes] for peer in range(local))
            own = slice(n, n + 1) if own_exact else None
            deq = quantized(total, bits[1], grid, errors, (param, n * local + d, 2), own) if nodes > 1 else total
            err = (total - deq).pow(2).sum(1)
            powers["hop2"] += float(err.sum())
            powers["hop2_own"] += float(err[n])
            if own_exact:
                deq[n] = total[n]
            for m in range(nodes):  # row m goes to rank (m, d), owner of partition m*L + d
                means[m * local + d] += deq[m]
    return means / world, powers


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--local", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--loco", action="store_true", help="LoCo error feedback (fp32 buffers, err_beta 0.8)")
    args = p.parse_args(argv)
    world = args.nodes * args.local
    steps = rank_gradients(args.size, world, args.micro_batch, args.steps)
    mode = f"LoCo error feedback (fp32 buffers, err_beta {BETA})" if args.loco else "plain qgZ (no error feedback)"
    print(f"model {args.size}, W = {world} ({args.nodes} nodes x {args.local}), group {GROUP}, {args.steps} steps "
          f"of rank gradients; {mode}, reference quantizer")
    columns = ["bits", "rel. error of the mean, as shipped", "own blocks exact", "ratio",
               "hop-1 error power on own blocks", "hop-2 error power on own rows"]
    if args.loco:
        columns += ["accumulated error, as shipped", "own blocks exact", "ratio"]
    print("| " + " | ".join(columns) + " |\n" + "|---" * len(columns) + "|")
    for bits in ((2, 2), (4, 4), (8, 2)):
        grid = resolve_grid("auto", bits)
        err = {False: 0.0, True: 0.0}
        ref, powers = 0.0, {}
        errors = {False: {}, True: {}} if args.loco else {False: None, True: None}
        drift = {False: {}, True: {}}  # per parameter, the means' error summed over the steps
        total = {}  # per parameter, the exact means summed over the steps
        for ranks in steps:
            for index in range(len(ranks[0])):
                grads = [r[index] for r in ranks]
                exact = partition_rows(torch.stack(grads).mean(0), world, GROUP)
                total[index] = total.get(index, 0) + exact
                for own in (False, True):
                    mean, pw = reduce_mean(grads, args.nodes, args.local, bits, grid, own, errors[own], index)
                    err[own] += float((mean - exact).pow(2).sum())
                    drift[own][index] = drift[own].get(index, 0) + (mean - exact)
                    if not own:
                        for k, v in pw.items():
                            powers[k] = powers.get(k, 0.0) + v
                ref += float(exact.pow(2).sum())
        shipped, kept = (err[False] / ref) ** 0.5, (err[True] / ref) ** 0.5
        row = [f"{bits[0]}/{bits[1]}", f"{shipped:.4f}", f"{kept:.4f}", f"{kept / shipped:.3f}",
               f"{powers['hop1_own'] / powers['hop1']:.3f}", f"{powers['hop2_own'] / max(powers['hop2'], 1e-300):.3f}"]
        if args.loco:
            size = sum(float(t.pow(2).sum()) for t in total.values()) ** 0.5
            acc = {own: sum(float(t.pow(2).sum()) for t in drift[own].values()) ** 0.5 / size for own in (False, True)}
            row += [f"{acc[False]:.4f}", f"{acc[True]:.4f}", f"{acc[True] / acc[False]:.3f}"]
        print("| " + " | ".join(row) + " |")
    print(f"error-buffer rows an exact own block saves: hop 1 {args.nodes} of {world} (1/L), hop 2 1 of "
          f"{args.nodes} (1/M)")


if __name__ == "__main__":
    main()
