"""Real multi-process test worlds: ``W`` spawned processes joined by gloo, reused across test cases.

``ProcessPool(W).run(fn, *args)`` calls the module-level function ``fn(*args)`` on every rank and returns
the per-rank results; an exception on any rank fails the caller with that rank's traceback.
"""
import os
import queue
import traceback
from datetime import timedelta
from typing import Any, Callable, Dict, List

import torch.multiprocessing
from torch.distributed.elastic.utils.distributed import get_free_port

TASK_TIMEOUT_S = 600
COLLECTIVE_TIMEOUT_S = 120


def _worker(rank: int, world_size: int, env: Dict[str, str], tasks, results) -> None:
    """Rank ``rank``'s loop: joins the gloo world, then runs each task from ``tasks[rank]`` until ``None``."""
    tasks = tasks[rank]
    os.environ.update(env)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank % int(env["LOCAL_WORLD_SIZE"])))
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    if env.get("DS_ACCELERATOR") == "cpu":
        # DeepSpeed's CPU backend JIT-builds a shared-memory all-reduce op on first use (minutes of C++ on a
        # fresh 2-core machine); only its inference path uses it, these tests' collectives are gloo's.
        import deepspeed.ops
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        try:
            results.put((rank, True, fn(*args)))
        except BaseException:  # reported to the parent, which fails the test
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class ProcessPool:
    """``world_size`` worker processes with an initialized gloo default group (``LOCAL_WORLD_SIZE`` = ``local``)."""

    def __init__(self, world_size: int, local: int = 2, extra_env: Dict[str, str] = None):
        self.world_size = world_size
        ctx = torch.multiprocessing.get_context("spawn")
        env = {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(get_free_port()),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(min(local, world_size)),
            "LOCAL_SIZE": str(min(local, world_size)),
            "DS_ACCELERATOR": "cpu",
            "OMP_NUM_THREADS": "1",
            **(extra_env or {}),
        }
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._workers = torch.multiprocessing.start_processes(_worker, args=(world_size, env, self._tasks,
                                                                             self._results),
                                                              nprocs=world_size, join=False, daemon=True)
        self._procs = self._workers.processes

    def run(self, fn: Callable, *args: Any) -> List[Any]:
        """Runs ``fn(*args)`` on every rank; returns the results in rank order."""
        for tasks in self._tasks:
            tasks.put((fn, args))
        results: Dict[int, Any] = {}
        failures = []
        while len(results) + len(failures) < self.world_size:
            try:
                rank, ok, value = self._results.get(timeout=TASK_TIMEOUT_S)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                raise AssertionError(f"{fn.__name__}: no answer in {TASK_TIMEOUT_S} s (dead ranks: {dead})")
            if ok:
                results[rank] = value
            else:
                failures.append(f"--- rank {rank} ---\n{value}")
        if failures:
            raise AssertionError(f"{fn.__name__} failed on {len(failures)} rank(s):\n" + "\n".join(failures))
        return [results[r] for r in range(self.world_size)]

    def close(self) -> None:
        for tasks in self._tasks:
            tasks.put(None)
        for proc in self._procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
