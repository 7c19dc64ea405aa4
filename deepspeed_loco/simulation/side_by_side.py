"""Runs single-arm :func:`~deepspeed_loco.simulation.simulate` jobs side by side on one device: :class:`SideBySide`.

A small model's simulated step leaves most of a GPU idle (it is bound by kernel launches on one CPU core), so
``parallel`` runs in spawned worker processes cost little more wall time than one. With ``parallel == 1`` the jobs
run one after another in this process. Each job trains one arm: ``simulate`` builds every arm from
``model_fn()`` under ``torch.manual_seed(seed)`` and a fresh ``data_fn()``, so a job's result is the same whether
it runs alone, beside others or inside a multi-arm ``simulate`` call.
"""
import multiprocessing
import os
import pickle
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, List, Optional, Sequence

from deepspeed_loco.simulation.spec import SimulationSpec, TrainingSetup
from deepspeed_loco.simulation.arm_result import ArmResult
from deepspeed_loco.simulation.train import simulate


@dataclass(frozen=True)
class Job:
    """One run: ``arm`` (a single arm token such as ``"loco2"``), ``steps``, ``seed``; ``evaluate``: call the
    task's ``eval_fn`` after the last step."""
    arm: str
    steps: int
    seed: int
    evaluate: bool


@dataclass
class Finished:
    """A job, its result, and ``overhead_s``: the seconds the job took besides its training steps (model and
    cluster set-up, evaluation, and in a fresh worker the device's start-up)."""
    job: Job
    result: ArmResult
    overhead_s: float


@dataclass(frozen=True)
class Task:
    """What every job of one study shares: the training ``setup``. With ``parallel > 1`` it must pickle (its
    callables module-level functions, ``functools.partial`` of them, or instances of module-level classes), since
    the workers are spawned."""
    setup: TrainingSetup

    def run(self, job: Job) -> Finished:
        """Trains ``job`` in this process (without the setup's evaluation unless ``job.evaluate``)."""
        started = time.monotonic()
        setup = self.setup if job.evaluate else replace(self.setup, eval_fn=None, eval_every=0)
        (result, ) = simulate(SimulationSpec(setup, (job.arm, ), job.steps, job.seed))
        return Finished(job, result, max(0.0, time.monotonic() - started - result.wall_s))


class SideBySide:
    """Runs :class:`Job` lists of one :class:`Task`, ``parallel`` at a time. Use as a context manager (or call
    :meth:`close`): the worker processes live until then, so the device start-up is paid once per worker.

    Raises ValueError if ``parallel`` is not a positive integer or, for ``parallel > 1``, a field of ``task``
    does not pickle (naming it)."""

    def __init__(self, task: Task, parallel: int = 1):
        if isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1:
            raise ValueError(f"parallel = {parallel!r}: it must be an integer >= 1 (simulations side by side)")
        self.task, self.parallel, self._pool = task, parallel, None
        if parallel > 1:
            payload = _pickled(task)
            threads = max(1, (os.cpu_count() or 1) // parallel)
            self._pool = ProcessPoolExecutor(max_workers=parallel, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_start_worker, initargs=(payload, threads))

    def run(self, jobs: Sequence[Job], on_done: Optional[Callable[[int, int], None]] = None) -> List[Finished]:
        """The jobs' results in the jobs' order; ``on_done(done, total)`` after each finished job."""
        if self._pool is None:
            finished = []
            for job in jobs:
                finished.append(self.task.run(job))
                if on_done:
                    on_done(len(finished), len(jobs))
            return finished
        futures = {self._pool.submit(_run_in_worker, job): i for i, job in enumerate(jobs)}
        out: List[Optional[Finished]] = [None] * len(jobs)
        pending = set(futures)
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                out[futures[future]] = future.result()
            if on_done:
                on_done(len(jobs) - len(pending), len(jobs))
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> "SideBySide":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _pickled(task: Task) -> bytes:
    """``task`` pickled, or a ValueError naming the first field that does not pickle."""
    for item in fields(task.setup):
        _check_pickles(getattr(task.setup, item.name), item.name)
    return pickle.dumps(task)


def _check_pickles(value: Any, name: str) -> None:
    try:
        pickle.dumps(value)
    except Exception as err:  # pickle raises several types (PicklingError, AttributeError, TypeError)
        raise ValueError(f"{name} = {value!r} does not pickle ({err}); simulations side by side (parallel > 1) run "
                         f"in spawned processes: pass a module-level function, a functools.partial of one or an "
                         f"instance of a module-level class, or use parallel = 1") from None


_worker_task: Optional[Task] = None


def _start_worker(payload: bytes, threads: int) -> None:
    global _worker_task
    import torch
    torch.set_num_threads(threads)
    _worker_task = pickle.loads(payload)


def _run_in_worker(job: Job) -> Finished:
    import torch
    finished = _worker_task.run(job)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # hand the run's memory back to the neighbours
    return finished
