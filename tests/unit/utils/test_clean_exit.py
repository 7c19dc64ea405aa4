"""Clean exits (deepspeed_loco.utils.clean_exit): short 2-process gloo jobs, real processes, every one must end 0.

Without the hook, the job in exit_job.py aborts at exit ("terminate called without an active exception", SIGABRT)
in 29 of 40 launches on torch 2.13 CPU (docs/frameworks.md, "Clean exits"), so ten clean runs in a row do not
happen by chance (0.275**10 < 3e-6)."""
import os
import subprocess
import sys

import pytest
from torch.distributed.elastic.utils.distributed import get_free_port

from deepspeed_loco.utils import clean_exit

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "exit_job.py")
RUNS = 10


def _launch(*job_args: str, world: int = 2):
    """Starts ``world`` ranks of ``exit_job.py job_args`` (each a plain ``python`` process, as a launcher would start
    them) and returns [(return code, stderr tail)] per rank."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(get_free_port()), WORLD_SIZE=str(world),
               OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    procs = [subprocess.Popen([sys.executable, JOB, *job_args], env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for rank in range(world)]
    return [(proc.wait(timeout=120), proc.stderr.read()[-2000:]) for proc in procs]


@pytest.mark.slow
def test_short_gloo_jobs_all_end_with_return_code_zero():
    """Half of the launches end with the script's own ``destroy_process_group()`` (the subgroup it holds lives on)."""
    failures = []
    for run in range(RUNS):
        job_args = ("register", "destroy") if run % 2 else ("register",)
        failures += [(run, rank, rc, err) for rank, (rc, err) in enumerate(_launch(*job_args)) if rc != 0]
    assert not failures, failures


def test_release_without_a_process_group_only_pauses_and_register_is_idempotent(monkeypatch):
    registered = []
    monkeypatch.setattr(clean_exit, "_registered", False)
    monkeypatch.setattr(clean_exit.atexit, "register", registered.append)
    clean_exit.register()
    clean_exit.register()
    assert registered == [clean_exit._release_at_exit]
    clean_exit.release()  # no process group here: only the pause


@pytest.mark.parametrize("uncaught", [False, True])
def test_the_hook_skips_the_release_after_an_uncaught_exception(monkeypatch, uncaught):
    released = []
    monkeypatch.setattr(clean_exit, "release", lambda: released.append(True))
    monkeypatch.setattr(sys, "last_value", RuntimeError("boom") if uncaught else None, raising=False)
    clean_exit._release_at_exit()
    assert released == ([] if uncaught else [True])
