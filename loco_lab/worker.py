"""One rank of the demo: trains every arm of a ``RunSpec`` in turn and reports to the launcher's queue.

Messages put on the queue (rank 0 reports progress and results; every rank reports its end):
``("log", text)``, ``("step", arm_index, step, loss)``, ``("arm", arm_index, result)``, ``("done", rank)``,
``("error", rank, traceback)``.
"""
import gc
import logging
import os
import statistics
import sys
import time
import traceback
from datetime import timedelta
from typing import Optional

LOCO_MARKERS = ("deepspeed-loco", "LoCo")


def main(rank: int, spec, queue) -> None:
    """Process entry point; the launcher has set the distributed environment variables."""
    _redirect_output(os.path.join(spec.out_dir, "logs", f"rank{rank}.log"))
    try:
        _run(rank, spec, queue)
        queue.put(("done", rank))
    except BaseException:
        text = traceback.format_exc()
        print(text, file=sys.stderr, flush=True)
        queue.put(("error", rank, text))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # peers may be blocked in a collective: do not wait for process-group teardown


def _redirect_output(path: str) -> None:
    """Sends this process's stdout and stderr (Python and C level: gloo, DeepSpeed) to ``path``."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    log = open(path, "w", buffering=1)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log


class _Forward(logging.Handler):
    """Forwards LoCo's own log lines (and errors) from rank 0 to the launcher, which prints each once."""

    def __init__(self, queue):
        super().__init__(logging.INFO)
        self.queue = queue

    def emit(self, record):
        try:
            text = record.getMessage()
        except Exception:
            return
        if record.levelno >= logging.ERROR or any(m in text for m in LOCO_MARKERS):
            self.queue.put(("log", text))


def _note(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] demo: {text}", flush=True)


def _run(rank: int, spec, queue) -> None:
    _note("importing torch and deepspeed")
    import torch
    torch.set_num_threads(1)
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import logger as ds_logger

    from loco_lab.data import load_corpus
    from deepspeed_loco.utils.logging import logger as loco_logger

    ds_logger.setLevel(logging.INFO)  # the full log goes to logs/rankN.log; the console gets LoCo's lines only
    if rank == 0:
        handler = _Forward(queue)
        ds_logger.addHandler(handler)
        loco_logger.addHandler(handler)
        loco_logger.setLevel(logging.INFO)
    if spec.device == "cpu":
        # DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce op at start-up (a minute or more of C++
        # on a fresh 2-core machine) that only its inference all-reduce uses; the demo's collectives are gloo's.
        import deepspeed.ops
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    where = "cpu"
    if spec.device == "cuda":  # round-robin: with fewer GPUs than ranks, several ranks share one (over gloo)
        gpu = rank % torch.cuda.device_count()
        torch.cuda.set_device(gpu)
        os.environ["LOCAL_RANK"] = str(gpu)  # DeepSpeed's engine puts its tensors on cuda:LOCAL_RANK
        where = f"cuda:{gpu}"
    timeout = timedelta(minutes=10)
    if spec.device == "cuda" and spec.backend == "gloo":
        # DeepSpeed binds the default group to the rank's GPU on CUDA (init_process_group(device_id=...)), which
        # makes torch build every later group by splitting it, an operation gloo groups lack. Start the group
        # unbound here; deepspeed.init_distributed then adopts it.
        dist.init_process_group("gloo", timeout=timeout, rank=rank, world_size=spec.world_size)
    deepspeed.init_distributed(dist_backend=spec.backend, auto_mpi_discovery=False, verbose=False, timeout=timeout)
    world = dist.get_world_size()
    _note(f"process group up: rank {rank} of {world} ({spec.backend}, {where})")
    if world != spec.world_size:
        raise RuntimeError(f"world size {world} != {spec.nodes} nodes x {spec.local} ranks")
    corpus = load_corpus(spec.text, spec.model.seq_len)
    for index, arm in enumerate(spec.arms):
        _note(f"arm {index}: {arm.label}, seed {arm.seed}")
        result = train_arm(spec, arm, index, corpus, rank, world, queue)
        if rank == 0:
            queue.put(("arm", index, result))
        gc.collect()
        dist.barrier()
    dist.destroy_process_group()


def train_arm(spec, arm, index, corpus, rank, world, queue) -> dict:
    """Trains ``arm`` from scratch; returns its curves and measurements (complete on rank 0)."""
    import deepspeed
    import torch
    import torch.distributed as dist

    import deepspeed_loco
    from loco_lab.arms import ds_config
    from loco_lab.fidelity import GradientFidelity
    from loco_lab.model import ByteLlama, count_parameters

    device = torch.device("cuda", torch.cuda.current_device()) if spec.device == "cuda" else torch.device("cpu")
    torch.manual_seed(arm.seed)  # the same initial weights on every rank and in every arm of a seed
    model = ByteLlama(spec.model)
    numel = count_parameters(model)
    config = ds_config(spec, arm)
    if arm.kind == "full":
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        hook = None
    else:
        engine, _, _, _ = deepspeed_loco.initialize(model=model, model_parameters=model.parameters(), config=config)
        hook = deepspeed_loco.loco_hook(engine)
        if hook is None:
            raise RuntimeError(f"{arm.label}: deepspeed_loco.initialize returned an engine without a LoCo hook")
    _note("engine ready")
    memory = CudaMemory.start(device)
    probe = GradientFidelity.attach(engine) if spec.fidelity else None
    start_bytes = _wire_bytes(hook)

    losses, times, phases, validation = [], [], [], [(0, evaluate(engine, corpus, spec, rank, world, device))]
    for step in range(spec.steps):
        x, y = corpus.train_batch(step, arm.seed, spec.global_batch, spec.model.seq_len, rank, world)
        x, y = x.to(device), y.to(device)
        _sync(device)
        t0 = time.perf_counter()
        loss = engine(x, y)
        _sync(device)
        t1 = time.perf_counter()
        engine.backward(loss)  # ZeRO-3 reduces the gradient buckets here
        _sync(device)
        t2 = time.perf_counter()
        measuring = probe.take_overhead() if probe is not None else 0.0
        engine.step()
        _sync(device)
        t3 = time.perf_counter()
        if probe is not None:
            probe.after_step()
            probe.take_overhead()
        times.append(t3 - t0 - measuring)
        phases.append((t1 - t0, t2 - t1 - measuring, t3 - t2))
        losses.append(loss.item())
        if rank == 0:
            queue.put(("step", index, step + 1, losses[-1]))
        if (step + 1) % spec.eval_every == 0 or step + 1 == spec.steps:
            validation.append((step + 1, evaluate(engine, corpus, spec, rank, world, device)))

    _note("training done")
    memory_bytes = memory.over_ranks() if memory is not None else None
    mean_losses = torch.tensor(losses, dtype=torch.float64, device=device)
    dist.all_reduce(mean_losses)
    mean_losses = (mean_losses / world).tolist()
    step_times = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(step_times, op=dist.ReduceOp.MAX)  # a step takes as long as its slowest rank
    step_times = step_times.tolist()
    last_k = max(1, spec.steps // 10)
    elem_bytes = 4 if spec.dtype == "fp32" else 2
    if hook is None:  # a ring reduce-scatter sends (W-1)/W of the gradient from every rank
        bytes_per_step = (world - 1) / world * elem_bytes * numel
        buffer_bytes = 0
        reduces = None
    else:
        sent = _wire_bytes(hook) - start_bytes
        if hook.reducer.stats.reduces == 0:
            raise RuntimeError(f"{arm.label}: the LoCo reducer was never called: gradients did not go through it")
        bytes_per_step = sent / spec.steps
        buffer_bytes = hook.state.memory_bytes()
        reduces = hook.reducer.stats.reduces
    result = {
        "arm": arm.to_dict(),
        "key": arm.key,
        "label": arm.label,
        "parameters": numel,
        "train_losses": mean_losses,
        "train_loss": statistics.fmean(mean_losses[-last_k:]),
        "train_loss_last_k": last_k,
        "validation": validation,
        "val_loss": validation[-1][1],
        "step_time_s": statistics.median(step_times),
        "step_times_s": step_times,
        "phase_medians_s": {name: statistics.median(p[i] for p in phases)
                            for i, name in enumerate(("forward", "backward_and_reduce", "optimizer"))},
        "bytes_per_step": bytes_per_step,
        "full_precision_bytes_per_step": (world - 1) / world * elem_bytes * numel,
        "error_buffer_bytes": buffer_bytes,
        "cuda_memory_bytes": memory_bytes,
        "reduces": reduces,
    }
    if probe is not None:
        result["fidelity"] = probe.summary()
    if hasattr(engine, "destroy"):
        engine.destroy()
    del engine, model, hook, probe
    return result


class CudaMemory:
    """This rank's CUDA memory over an arm's training (each process has its own caching allocator, so ranks
    sharing a GPU are counted apart): bytes allocated once the engine is ready (before the first step creates
    LoCo's error buffers) and after the last step, and the peak in between."""

    def __init__(self, device):
        import torch
        self.device = device
        self.ready = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)

    @classmethod
    def start(cls, device) -> "Optional[CudaMemory]":
        """Starts counting on a CUDA ``device``; None on any other."""
        return cls(device) if device.type == "cuda" else None

    def over_ranks(self) -> dict:
        """``{"ready", "trained", "peak"}``: each the largest over ranks, in bytes; ``trained - ready`` is what
        training left allocated (LoCo's error buffers, DeepSpeed's own lasting buffers), ``peak - ready`` its most."""
        import torch
        import torch.distributed as dist
        values = torch.tensor([self.ready, torch.cuda.memory_allocated(self.device),
                               torch.cuda.max_memory_allocated(self.device)], dtype=torch.float64, device=self.device)
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        return dict(zip(("ready", "trained", "peak"), (int(v) for v in values.tolist())))


def evaluate(engine, corpus, spec, rank, world, device) -> float:
    """Mean next-byte cross-entropy over the held-out plays (the same windows in every arm)."""
    import torch
    import torch.distributed as dist
    total = torch.zeros(2, dtype=torch.float64, device=device)
    engine.eval()
    with torch.no_grad():
        for x, y in corpus.validation_batches(spec.eval_windows, spec.model.seq_len, rank, world, spec.eval_batch):
            loss = engine(x.to(device), y.to(device))
            total[0] += loss.double() * x.shape[0]
            total[1] += x.shape[0]
    engine.train()
    dist.all_reduce(total)
    return (total[0] / total[1]).item()


def _wire_bytes(hook) -> int:
    if hook is None:
        return 0
    return hook.reducer.stats.total_bytes


def _sync(device) -> None:
    if device.type == "cuda":
        import torch
        torch.cuda.synchronize(device)
