"""What DeepSpeed's monitor (with LoCo's telemetry) and the live rho cost a training step, on one device.

With one GPU a DeepSpeed world has one rank, and LoCo then has no hop: nothing to reduce, measure or report. So this
runs one rank's view of a 2 x 8 job (``--nodes x --local``; rank 1) as ``benchmarks/live_rho_overhead.py`` does: the
bundled model's forward, backward and AdamW step on the rank's micro-batch (bf16 parameters, so bf16 gradients as in
a bf16 ZeRO-3 run, held back to back in one buffer as DeepSpeed's contiguous gradients hold them), and the library's
:class:`~deepspeed_loco.runtime.comm.loco_reduce.LocoReducer` reducing all gradients in buckets of ``--bucket``
elements (DeepSpeed's default ``reduce_bucket_size``, 5e8: one bucket) with LoCo error feedback (int8 buffers), the
all-to-alls replaced by copies (the kernels do the real layout's work; the exchanges are not timed). Around them,
what the hook does in a real run: the reduce observers after each reduce and the step listeners after the optimizer
step (the live rho first, then the telemetry), through the library's own classes. The arms, run in the same process
on the same model:

``base``      monitor off, live rho off (``rho_every: 0``)
``ds_monitor`` DeepSpeed's csv monitor on, writing what DeepSpeed's engine writes per step (train loss, learning rate),
              without LoCo's telemetry: the monitor's own cost
``monitor``   ``ds_monitor`` and LoCo's telemetry (its byte counts every ``--telemetry-every`` steps, default
              ``telemetry_every``'s; its error norm every ``--rho-every`` steps: ``error_norm_every``'s default
              follows ``rho_every``)
``rho``       the live rho every ``--rho-every`` steps (default 10, ``rho_every``'s default), monitor off
``both``      ``monitor`` and ``rho``

Each arm runs ``--steps`` steps (a multiple of ``--rho-every``) between two device synchronizations, so that a
host synchronization inside a step costs what it costs in training; per arm the table gives the mean step time (the
median over ``--rounds`` rounds, each round in an order rotated by one), its ratio to ``base`` of the same run, and
the median over rounds of its ratio to ``base`` of the same round (paired: steadier where the host's speed drifts
between rounds). With ``--profile`` on a GPU, a second table gives each arm's kernel time on the device per step:
what the arm adds to a step that the device, not the host, bounds.
Not timed: the live rho's all-reduce across ranks (with one process it sums one rank's vector; its size is printed)
and the exchanges.

    python3 benchmarks/monitor_overhead.py --size 125m --micro-batch 16                # on a GPU
    python3 benchmarks/monitor_overhead.py --size tiny --micro-batch 2 --device cpu \\
        --steps 4 --rho-every 2 --rounds 1                                              # anywhere (reference kernels)
"""
import argparse
import os
import statistics
import sys
import tempfile
import time
import types
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # run from a checkout without installing

ARMS = ("base", "ds_monitor", "monitor", "rho", "both")
MONITOR_ARMS = ("ds_monitor", "monitor", "both")  # DeepSpeed's monitor on
TELEMETRY_ARMS = ("monitor", "both")  # LoCo's telemetry on
RHO_ARMS = ("rho", "both")


def parse_args(argv=None):
    from deepspeed_loco.config import LocoConfig
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="125m", help="bundled model size (loco_lab.model.SIZES; 125m: 116.4M)")
    p.add_argument("--micro-batch", dest="micro_batch", type=int, default=16, help="sequences per rank per step")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--local", type=int, default=8)
    p.add_argument("--bits", default="4/4", help="intra/inter-node bits")
    p.add_argument("--bucket", type=int, default=500_000_000, help="gradient elements per reduce (bucket)")
    p.add_argument("--rho-every", dest="rho_every", type=int, default=10,
                   help="live rho and error norm: measured every this many optimizer steps")
    p.add_argument("--telemetry-every", dest="telemetry_every", type=int, default=LocoConfig().telemetry_every,
                   help="LoCo's telemetry: byte counts and resets written every this many optimizer steps "
                        "(zeropp_loco_param.telemetry_every; default its default)")
    p.add_argument("--steps", type=int, default=30, help="timed steps per arm and round (a multiple of --rho-every)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before the first round (at least through "
                                                         "the first measured step)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--device", default="cuda")
    p.add_argument("--table", help="also write the table to this file")
    p.add_argument("--count-ops", dest="count_ops", action="store_true",
                   help="also count the ops each arm dispatches over --rho-every steps beyond the base arm's")
    p.add_argument("--profile", help="also write each arm's torch.profiler table of one measured step's run of "
                                     "--rho-every steps to this file")
    args = p.parse_args(argv)
    if args.rho_every < 1 or args.steps < 1 or args.steps % args.rho_every:
        p.error(f"--steps {args.steps} must be a positive multiple of --rho-every {args.rho_every} (>= 1): every arm "
                f"then runs the same number of measured steps")
    return args


def init_world(device):
    """A DeepSpeed world of this one process (the monitor and the live rho's all-reduce need one)."""
    import deepspeed
    import torch
    from torch.distributed.elastic.utils.distributed import get_free_port
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(get_free_port()))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:  # DeepSpeed's CPU backend would JIT-build a shared-memory all-reduce op only its inference path uses
        import deepspeed.ops
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo", auto_mpi_discovery=False,
                               verbose=False)


class Rank:
    """The model, optimizer and LoCo objects of the timed rank; :meth:`step` runs one optimizer step of an arm."""

    def __init__(self, args, device, out_dir: str):
        import torch
        from deepspeed.monitor.config import get_monitor_config
        from deepspeed.monitor.monitor import MonitorMaster

        from deepspeed_loco.config import LocoConfig
        from deepspeed_loco.runtime.comm.loco_reduce import LocoReducer
        from loco_lab.model import SIZES, ByteLlama

        self.args, self.device = args, device
        torch.manual_seed(0)
        self.cfg = SIZES[args.size]
        self.model = ByteLlama(self.cfg).to(device=device, dtype=torch.bfloat16)
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        self.buckets = _buckets([p.numel() for p in self.params], args.bucket)
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-4)
        # DeepSpeed's contiguous gradients: the gradients are views of one buffer, in backward's order (last layer
        # first), kept across steps (zeroed, not freed) and accumulated into in place by backward
        self.grad_buffer = torch.zeros(sum(p.numel() for p in self.params), dtype=torch.bfloat16, device=device)
        offset = 0
        for p in reversed(self.params):
            p.grad = self.grad_buffer[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        intra, inter = (int(b) for b in args.bits.split("/"))
        config = LocoConfig(intra_node_bits=intra, inter_node_bits=inter, local_world_size=args.local)
        topology = types.SimpleNamespace(world_size=args.nodes * args.local, local_size=args.local, rank=1,
                                         exchanges={"intra_node": torch.clone, "inter_node": torch.clone})
        self.reducer = LocoReducer.for_topology(config, topology)
        self.monitor = MonitorMaster(get_monitor_config(
            {"csv_monitor": {"enabled": True, "output_path": out_dir, "job_name": "monitor_overhead"}}))
        self.x = torch.randint(0, 256, (args.micro_batch, self.cfg.seq_len), device=device)
        self.samples = 0
        self.steps = 0
        self.hook_seconds = 0.0  # host time in the reduce observers and step listeners, since start-up

    def arm(self, name: str):
        """``(observers, listeners)`` of arm ``name``: fresh live rho and telemetry objects from the next step, after
        base steps up to a step count aligned with the measured ones (a measured step the previous arm's live rho
        began is dropped)."""
        from deepspeed_loco.runtime.comm.noise_stats import LiveRho
        from deepspeed_loco.runtime.zero.telemetry import LocoTelemetry
        if self.reducer.measuring:
            self.reducer.end_measured_step()
        while self.steps % self.args.rho_every:
            self.step("base", [], [])
        every = self.args.rho_every
        live_rho = LiveRho(self.reducer, None, every if name in RHO_ARMS else 0, 0, self.args.micro_batch, 1,
                           self.device, next_step=self.steps + 1)
        observers, listeners = [], [live_rho.on_step]
        if name in TELEMETRY_ARMS:
            telemetry = LocoTelemetry(self.monitor, self.reducer, self.reducer.plan.world_size, True, live_rho,
                                      every, next_step=self.steps + 1, every=self.args.telemetry_every)
            observers.append(telemetry.on_reduce)
            listeners.append(telemetry.on_step)
        return observers, listeners

    def step(self, arm: str, observers, listeners) -> None:
        """Forward, backward, the reduces (each followed by the reduce observers), the optimizer step, the step
        listeners, and with DeepSpeed's monitor on, the events its engine writes per step."""
        import torch
        loss = self.model(self.x, self.x)
        loss.backward()
        with torch.no_grad():
            for start, stop in self.buckets:
                names, grads = self.names[start:stop], [p.grad for p in self.params[start:stop]]
                partitions = self.reducer.reduce_scatter(names, grads)
                began = time.perf_counter()
                for observe in observers:
                    observe(names, grads, partitions)
                self.hook_seconds += time.perf_counter() - began
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)
        self.steps += 1
        self.samples += self.args.micro_batch
        reset = self.reducer.state.on_optimizer_step()
        began = time.perf_counter()
        for listen in listeners:
            listen(self.steps, reset)
        self.hook_seconds += time.perf_counter() - began
        if arm in MONITOR_ARMS:  # DeepSpeed's engine: the loss at the boundary, then the learning rate
            self.monitor.write_events([("Train/Samples/train_loss", loss.item(), self.samples),
                                       ("Train/Samples/lr", self.optimizer.param_groups[0]["lr"], self.samples)])


def _buckets(numels, size: int):
    """``(start, stop)`` index ranges of consecutive parameters of at most ``size`` elements (at least one each)."""
    out, start, total = [], 0, 0
    for i, n in enumerate(numels):
        if i > start and total + n > size:
            out.append((start, i))
            start, total = i, 0
        total += n
    return out + [(start, len(numels))]


def measure(args) -> dict:
    """Per arm the mean step time (ms) of each round; the machine and sizes."""
    import torch

    from deepspeed_loco.ops import kernels_for
    from deepspeed_loco.runtime.comm import noise_stats

    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:  # torch.cuda.set_device needs an index
        device = torch.device("cuda", torch.cuda.current_device())
    init_world(device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    with tempfile.TemporaryDirectory() as out_dir:
        rank = Rank(args, device, out_dir)
        observers, listeners = rank.arm("both")
        # untimed: --warmup steps, and on through a measured step, so that what a first measured step does once
        # (the process group's first all-reduce, the allocator's first blocks) is not timed in the first round
        while rank.steps < max(args.warmup, args.rho_every + 1):
            rank.step("both", observers, listeners)
        rank.arm("base")
        noise_stats.begin_measured_step(rank.reducer, rank.steps + 1)  # the size of the live rho's all-reduce
        rank.step("base", [], [])
        floats = noise_stats.end_measured_step(rank.reducer, device).numel()
        times = {arm: [] for arm in ARMS}
        hook_ms = {arm: [] for arm in ARMS}
        for r in range(args.rounds):
            for arm in ARMS[r % len(ARMS):] + ARMS[:r % len(ARMS)]:
                observers, listeners = rank.arm(arm)
                sync()
                start, hook_before = time.perf_counter(), rank.hook_seconds
                for _ in range(args.steps):
                    rank.step(arm, observers, listeners)
                sync()
                times[arm].append(1000 * (time.perf_counter() - start) / args.steps)
                hook_ms[arm].append(1000 * (rank.hook_seconds - hook_before) / args.steps)
        kernel_ms = write_profiles(rank, args, sync, args.profile) if args.profile else None
        ops = count_ops(rank, args) if args.count_ops else None
        written = sorted(os.listdir(os.path.join(out_dir, "monitor_overhead")))
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "kernels": kernels_for(device).name, "size": args.size,
            "params": sum(p.numel() for p in rank.params), "tensors": len(rank.params),
            "buckets": len(rank.buckets), "micro_batch": args.micro_batch, "layout": f"{args.nodes} x {args.local}",
            "bits": args.bits, "rho_every": args.rho_every, "telemetry_every": args.telemetry_every,
            "steps": args.steps, "rounds": args.rounds, "ms": times, "hook_ms": hook_ms, "kernel_ms": kernel_ms,
            "ops": ops, "all_reduce_floats": floats, "written": written}


def count_ops(rank: Rank, args) -> dict:
    """Per arm, ``(computing, views)``: the ops dispatched by its run of ``--rho-every`` steps (one measured), less
    the base arm's; a computing op is a kernel launch on a GPU, a view only host work. Machine-independent."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class Dispatched(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.kinds = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.kinds["views" if func.is_view else "computing"] += 1
            return func(*args, **(kwargs or {}))

    counts = {}
    for arm in ARMS:
        observers, listeners = rank.arm(arm)
        with Dispatched() as dispatched:
            for _ in range(args.rho_every):
                rank.step(arm, observers, listeners)
        counts[arm] = dispatched.kinds
    return {arm: (counts[arm]["computing"] - counts["base"]["computing"],
                  counts[arm]["views"] - counts["base"]["views"]) for arm in ARMS}


def write_profiles(rank: Rank, args, sync, path: str) -> Optional[dict]:
    """Per arm, ``torch.profiler``'s table of ``--rho-every`` steps (one measured step) after one untimed such run,
    the ops sorted by their total time on the device (on the CPU without one), into ``path``. Returns per arm the
    kernels' time on the device per step of that run (ms; what the arm adds to a step that the device, not the host,
    bounds), or None without a device."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if rank.device.type == "cuda" else [])
    sort = "cuda_time_total" if rank.device.type == "cuda" else "cpu_time_total"
    kernel_ms = {}
    with open(path, "w") as f:
        for arm in ARMS:
            observers, listeners = rank.arm(arm)
            for _ in range(args.rho_every):
                rank.step(arm, observers, listeners)
            sync()
            with profile(activities=activities) as prof:
                for _ in range(args.rho_every):
                    rank.step(arm, observers, listeners)
                sync()
            f.write(f"## {arm}: {args.rho_every} steps, one measured\n\n")
            f.write(prof.key_averages().table(sort_by=sort, row_limit=25) + "\n\n")
            # the kernels' own rows only: not the ranges a GPU timeline shows for user annotations (the optimizer
            # step's, in some arms), which overlap the kernels they enclose: the profile's "Self CUDA time total"
            kernel_ms[arm] = sum(e.self_device_time_total for e in prof.key_averages()
                                 if e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False)
                                 ) / 1000 / args.rho_every
    return kernel_ms if rank.device.type == "cuda" else None


def table(r: dict) -> str:
    base = statistics.median(r["ms"]["base"])
    rows = []
    for arm in ARMS:
        ms = statistics.median(r["ms"][arm])
        spread = f"{min(r['ms'][arm]):.2f} .. {max(r['ms'][arm]):.2f}"
        paired = statistics.median(a / b for a, b in zip(r["ms"][arm], r["ms"]["base"]))
        rows.append(f"| {arm} | {ms:.2f} | {spread} | {ms / base:.4f} | {ms / base - 1:+.2%} | {paired - 1:+.2%} | "
                    f"{statistics.median(r['hook_ms'][arm]):.3f} |")
    head = (f"{r['device']} ({r['kernels']}): {r['size']} model ({r['params'] / 1e6:.1f}M parameters, {r['tensors']} "
            f"tensors, {r['buckets']} bucket(s)), micro-batch {r['micro_batch']}, rank 1 of {r['layout']}, "
            f"{r['bits']} bits, LoCo (int8 error); live rho and error norm every {r['rho_every']} steps, telemetry's "
            f"byte counts every {r['telemetry_every']}; "
            f"{r['steps']} steps per arm and round, {r['rounds']} round(s); the live rho's all-reduce (not timed): "
            f"{r['all_reduce_floats']} floats")
    counts = []
    if r["ops"]:
        counts = ["", f"ops dispatched over {r['rho_every']} steps (one measured) beyond the base arm's (with "
                      f"{r['kernels']}: on the CPU the reference kernels' own ops count too):", "",
                  "| arm | computing (a kernel launch each on a GPU) | views (host work only) |", "|---|---|---|"]
        counts += [f"| {arm} | {computing} | {views} |" for arm, (computing, views) in r["ops"].items()]
    kernels = []
    if r.get("kernel_ms"):
        k_base = r["kernel_ms"]["base"]
        kernels = ["", f"kernels' time on the device per step (ms; the profiled run of {r['rho_every']} steps, one "
                       "measured): what each arm adds where the device, not the host, bounds the step", "",
                   "| arm | device ms per step | extra |", "|---|---|---|"]
        kernels += [f"| {arm} | {ms:.3f} | {ms / k_base - 1:+.2%} |" for arm, ms in r["kernel_ms"].items()]
    return "\n".join([head, "", "| arm | ms per step (median of rounds) | rounds' range | / base | extra | extra, "
                      "paired (median over rounds of arm / base of the same round) | host ms in LoCo's observers and "
                      "listeners per step |", "|---|---|---|---|---|---|---|"] + rows + kernels + counts
                     + ["", f"monitor files written: {', '.join(r['written'])}"])


def main(argv=None) -> None:
    args = parse_args(argv)
    text = table(measure(args))
    print(text, flush=True)
    if args.table:
        with open(args.table, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
