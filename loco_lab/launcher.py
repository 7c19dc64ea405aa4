"""Starts ``W = nodes x local`` worker processes on this machine (simulated nodes) and collects their reports."""
import os
import queue as queue_module
import time
from typing import Callable, Dict, List, Optional

import torch.multiprocessing
from torch.distributed.elastic.utils.distributed import get_free_port

from loco_lab.arms import RunSpec

POLL_S = 0.5


class LaunchError(RuntimeError):
    """A worker failed; the message holds its traceback (or the tail of its log)."""


def gpu_count() -> int:
    """CUDA GPUs this process can use (0 without CUDA)."""
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_sharing_line(spec: RunSpec, gpus: int) -> Optional[str]:
    """The line that says how the ranks of a CUDA ``spec`` share ``gpus`` GPUs; None when each has its own (or CPU)."""
    if spec.device != "cuda" or gpus >= spec.world_size:
        return None
    most = -(-spec.world_size // gpus)
    return (f"GPU sharing: {spec.world_size} ranks on {gpus} GPU{'s' if gpus > 1 else ''}, rank r on GPU r % {gpus} "
            f"(up to {most} per GPU); collectives through {spec.backend} (NCCL refuses two ranks on one GPU), so step "
            f"times include the sharing")


def worker_env(spec: RunSpec, rank: int, port: int) -> Dict[str, str]:
    """The launcher variables of ``rank``, as torchrun would set them for ``nodes`` agents of ``local`` ranks.

    On CPU, ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` describe the simulated node (DeepSpeed's CPU accelerator reads
    ``LOCAL_SIZE`` as its device count). On GPUs all ranks share this host: ``LOCAL_RANK`` is the rank here, and
    the worker replaces it by the index of the GPU it takes (``rank % device_count``, where DeepSpeed's engine then
    puts its tensors); the simulated layout reaches LoCo through ``zeropp_loco_param.local_world_size``.
    """
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": str(spec.world_size),
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    if spec.device == "cuda":
        env.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(spec.world_size), LOCAL_SIZE=str(spec.world_size))
    else:
        env.update(LOCAL_RANK=str(rank % spec.local), LOCAL_WORLD_SIZE=str(spec.local), LOCAL_SIZE=str(spec.local),
                   DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="")
    return env


def _rank_main(rank: int, spec: RunSpec, queue, port: int) -> None:
    """Entry point of worker ``rank`` (spawned by ``torch.multiprocessing``): its launcher variables, then the
    worker."""
    from loco_lab import worker
    os.environ.update(worker_env(spec, rank, port))
    worker.main(rank, spec, queue)


def launch(spec: RunSpec, on_message: Optional[Callable] = None, timeout_s: float = 3600) -> List[dict]:
    """Runs every arm of ``spec`` in ``spec.world_size`` spawned workers; returns rank 0's results, in arm order.

    ``on_message(message)`` sees every queue message (progress bar, log lines). Raises ``LaunchError`` if a
    worker fails or nothing is heard for ``timeout_s`` seconds.
    """
    os.makedirs(os.path.join(spec.out_dir, "logs"), exist_ok=True)
    queue = torch.multiprocessing.get_context("spawn").Queue()
    workers = None
    try:
        workers = torch.multiprocessing.start_processes(_rank_main, args=(spec, queue, get_free_port()),
                                                        nprocs=spec.world_size, join=False, start_method="spawn")
        results: Dict[int, dict] = {}
        done = set()
        last_heard = time.monotonic()
        while len(done) < spec.world_size:
            try:
                message = queue.get(timeout=POLL_S)
            except queue_module.Empty:
                for rank, proc in enumerate(workers.processes):
                    if rank not in done and proc.exitcode not in (None, 0):
                        reported = _reported_error(queue)
                        raise LaunchError(reported or f"rank {rank} exited with code {proc.exitcode}\n"
                                          f"{_log_tail(spec, rank)}")
                if time.monotonic() - last_heard > timeout_s:
                    raise LaunchError(f"no progress from the workers for {timeout_s:.0f} s\n{_log_tail(spec, 0)}")
                continue
            last_heard = time.monotonic()
            kind = message[0]
            if kind == "error":
                raise LaunchError(f"rank {message[1]} failed:\n{message[2]}")
            if kind == "done":
                done.add(message[1])
            elif kind == "arm":
                results[message[1]] = message[2]
            if on_message is not None:
                on_message(message)
        workers.join(timeout=60)
        return [results[i] for i in sorted(results)]
    finally:
        started = workers.processes if workers is not None else []
        for proc in started:
            if proc.is_alive():
                proc.terminate()
        for proc in started:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()


def _reported_error(queue) -> Optional[str]:
    """The first error a worker put on the queue before exiting, if any."""
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        try:
            message = queue.get(timeout=0.2)
        except queue_module.Empty:
            continue
        if message[0] == "error":
            return f"rank {message[1]} failed:\n{message[2]}"
    return None


def _log_tail(spec: RunSpec, rank: int, lines: int = 40) -> str:
    path = os.path.join(spec.out_dir, "logs", f"rank{rank}.log")
    try:
        with open(path, errors="replace") as f:
            tail = f.readlines()[-lines:]
    except OSError:
        return f"(no log at {path})"
    return f"--- last lines of {path} ---\n" + "".join(tail)
