"""What the live rho (``zeropp_loco_param.rho_every``) adds to a measured step, on one device: one rank's LoCo reduce
of a whole model's gradients with and without the measurement, beside that rank's own training step.

One rank (rank 1 of ``--nodes x --local``) of a ZeRO-3 job reduces its gradients through the library's
:class:`~deepspeed_loco.runtime.comm.loco_reduce.LocoReducer` in one bucket, with the all-to-alls replaced by copies
(one rank's view: the kernels do the work of the real layout; the exchanges are not timed). The measured reduce
lies in a measured step of the reducer (``noise_stats.begin_measured_step``): it also fills the noise sums and the
shared sample (:class:`~deepspeed_loco.runtime.comm.noise_stats.ReduceSums`, the reducer's probe), and
``noise_stats.end_measured_step`` packs the vector that the live rho's one all-reduce would sum (the all-reduce
itself is not timed: its size is printed). The training step is the bundled model's forward, backward and AdamW step
on the rank's micro-batch. Prints one table: milliseconds per reduce (median of ``--repeats``, CUDA-synchronized), the
measurement's extra time, and that extra as a share of the rank's step (training step + reduce), at ``rho_every``
1 (every step: the worst case) and the default 10.

    python3 benchmarks/live_rho_overhead.py --size 125m --micro-batch 16            # on a GPU
    python3 benchmarks/live_rho_overhead.py --size tiny --micro-batch 2 --device cpu # anywhere (reference kernels)
"""
import argparse
import os
import statistics
import sys
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # run from a checkout without installing


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="125m", help="bundled model size (loco_lab.model.SIZES)")
    p.add_argument("--micro-batch", dest="micro_batch", type=int, default=16, help="sequences per rank per step")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--local", type=int, default=8)
    p.add_argument("--bits", default="4/4", help="intra/inter-node bits")
    p.add_argument("--repeats", type=int, default=20, help="timed repetitions of each (after 3 untimed)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--profile", type=int, default=0,
                   help="also print the top N operators of one measured reduce (torch.profiler, by host time)")
    return p.parse_args(argv)


def measure(args) -> dict:
    """The timings (ms, medians) and sizes; see the module's doc."""
    import torch

    from deepspeed_loco.config import LocoConfig
    from deepspeed_loco.runtime.comm import noise_stats
    from deepspeed_loco.runtime.comm.loco_reduce import LocoReducer
    from loco_lab.model import SIZES, ByteLlama

    device = torch.device(args.device)
    torch.manual_seed(0)
    cfg = SIZES[args.size]
    model = ByteLlama(cfg).to(device)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    names = [n for n, _ in named]
    grads = [torch.randn_like(p, dtype=torch.bfloat16) * 1e-3 for _, p in named]
    intra, inter = (int(b) for b in args.bits.split("/"))
    config = LocoConfig(intra_node_bits=intra, inter_node_bits=inter, local_world_size=args.local)
    topology = types.SimpleNamespace(world_size=args.nodes * args.local, local_size=args.local, rank=1,
                                     exchanges={"intra_node": torch.clone, "inter_node": torch.clone})
    reducer = LocoReducer.for_topology(config, topology)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    step_count = [0]

    def reduce(measured: bool):
        step_count[0] += 1
        if measured:
            noise_stats.begin_measured_step(reducer, step_count[0])
        reducer.reduce_scatter(names, grads)
        return noise_stats.end_measured_step(reducer, device) if measured else None

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, 256, (args.micro_batch, cfg.seq_len), device=device)

    def train_step():
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
            loss = model(x, x)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def timed(fn, *a):
        times = []
        for i in range(args.repeats + 3):
            sync()
            start = time.perf_counter()
            fn(*a)
            sync()
            if i >= 3:
                times.append(1000 * (time.perf_counter() - start))
        return statistics.median(times)

    packed = reduce(True)
    plain_ms, measured_ms, step_ms = timed(reduce, False), timed(reduce, True), timed(train_step)
    if args.profile:
        with torch.profiler.profile() as prof:
            reduce(True)
            sync()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile), flush=True)
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "size": args.size, "params": sum(p.numel() for _, p in named), "tensors": len(named),
            "micro_batch": args.micro_batch, "layout": f"{args.nodes} x {args.local}", "bits": args.bits,
            "train_step_ms": step_ms, "reduce_ms": plain_ms, "reduce_measured_ms": measured_ms,
            "all_reduce_floats": packed.numel()}


def table(r: dict) -> str:
    extra = r["reduce_measured_ms"] - r["reduce_ms"]
    step = r["train_step_ms"] + r["reduce_ms"]
    rows = [("rank's training step (forward, backward, AdamW)", f"{r['train_step_ms']:.2f}"),
            ("LoCo reduce, not measured", f"{r['reduce_ms']:.2f}"),
            ("LoCo reduce, measured (sums, sample, packed vector)", f"{r['reduce_measured_ms']:.2f}"),
            ("extra per measured step", f"{extra:+.2f}"),
            ("extra / step, rho_every = 1", f"{extra / step:+.2%}"),
            ("extra / step, rho_every = 10 (default)", f"{extra / step / 10:+.2%}")]
    head = (f"{r['device']}: {r['size']} model ({r['params'] / 1e6:.1f}M parameters, {r['tensors']} tensors), "
            f"micro-batch {r['micro_batch']}, rank 1 of {r['layout']}, {r['bits']} bits, LoCo; the live rho's "
            f"all-reduce (not timed): {r['all_reduce_floats']} floats")
    return "\n".join([head, "", "| | ms |", "|---|---|"] + [f"| {a} | {b} |" for a, b in rows])


def main(argv=None) -> None:
    print(table(measure(parse_args(argv))), flush=True)


if __name__ == "__main__":
    main()
