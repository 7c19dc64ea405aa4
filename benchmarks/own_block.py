"""What quantizing a rank's own block costs (issue 56, item 3): in each hop a rank sends one block to itself, which
never travels, yet plain qgZ and LoCo quantize it like the others (and LoCo keeps its error).

On real per-rank gradients (the bundled byte-level model on the bundled plays, ``W = nodes x local`` ranks, a few
AdamW steps of full-precision training so the gradients are not those at initialization), this computes the two-hop
reduce's communicated mean twice with the library's reference quantizer, plain (no error feedback): as shipped
(every block quantized) and with each rank's own block kept exact (hop 1: the block for its own local index; hop 2:
the row for its own node). It prints, per bit setting, the relative error of the mean both ways and the share of each
hop's quantization-error power that falls on own blocks, and the error-buffer rows an exact own block would save.

    OMP_NUM_THREADS=2 python3 benchmarks/own_block.py [--size small] [--nodes 2] [--local 8] [--steps 5]
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


def quantized(rows, bits, grid):
    q, scale = quantize_groups(rows, bits, GROUP, grid)
    return dequantize_groups(q, scale, GROUP, grid)


def reduce_mean(grads, nodes, local, bits, grid, own_exact):
    """The two-hop plain reduce of one parameter's rank gradients ``grads`` (W flat tensors) to the mean's
    ``(W, P')`` rows, every block quantized or each rank's own block exact; also the error power of each hop's
    quantization, on own blocks and on all."""
    world = nodes * local
    slots = slot_to_row(world, local)
    sent = []  # per rank (n, d): hop-1 rows in slot order, as they arrive (dequantized, or exact for the own block)
    powers = {"hop1_own": 0.0, "hop1": 0.0, "hop2_own": 0.0, "hop2": 0.0}
    for rank, grad in enumerate(grads):
        rows = partition_rows(grad, world, GROUP)[slots]
        deq = quantized(rows, bits[0], grid)
        err = (rows - deq).pow(2).sum(1)
        d = rank % local
        own = slice(d * nodes, (d + 1) * nodes)
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
            deq = quantized(total, bits[1], grid) if nodes > 1 else total
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
    args = p.parse_args(argv)
    world = args.nodes * args.local
    steps = rank_gradients(args.size, world, args.micro_batch, args.steps)
    print(f"model {args.size}, W = {world} ({args.nodes} nodes x {args.local}), group {GROUP}, {args.steps} steps "
          f"of rank gradients; plain qgZ (no error feedback), reference quantizer")
    print("| bits | rel. error of the mean, as shipped | own blocks exact | ratio | hop-1 error power on own blocks | "
          "hop-2 error power on own rows |\n|---|---|---|---|---|---|")
    for bits in ((2, 2), (4, 4), (8, 2)):
        grid = resolve_grid("auto", bits)
        err = {False: 0.0, True: 0.0}
        ref, powers = 0.0, {}
        for ranks in steps:
            for index in range(len(ranks[0])):
                grads = [r[index] for r in ranks]
                exact = partition_rows(torch.stack(grads).mean(0), world, GROUP)
                for own in (False, True):
                    mean, pw = reduce_mean(grads, args.nodes, args.local, bits, grid, own)
                    err[own] += float((mean - exact).pow(2).sum())
                    if not own:
                        for k, v in pw.items():
                            powers[k] = powers.get(k, 0.0) + v
                ref += float(exact.pow(2).sum())
        shipped, kept = (err[False] / ref) ** 0.5, (err[True] / ref) ** 0.5
        print(f"| {bits[0]}/{bits[1]} | {shipped:.4f} | {kept:.4f} | {kept / shipped:.3f} | "
              f"{powers['hop1_own'] / powers['hop1']:.3f} | {powers['hop2_own'] / max(powers['hop2'], 1e-300):.3f} |")
    print(f"error-buffer rows an exact own block saves: hop 1 {args.nodes} of {world} (1/L), hop 2 1 of "
          f"{args.nodes} (1/M)")


if __name__ == "__main__":
    main()
