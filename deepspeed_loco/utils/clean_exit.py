"""Ends a job that trained without an abort at exit: the process groups are released before Python finalizes.

The abort ("terminate called without an active exception", SIGABRT; torchrun rc 1, the ``deepspeed`` launcher
rc 250): a gloo worker thread (``pt_gloo_runloop``) drops a finished collective's tensors a moment after the
caller's ``wait()`` returned, and dropping a tensor that has a Python object takes the GIL. Once finalization has
begun, Python ends any other thread that asks for the GIL with ``pthread_exit``, whose unwinding through a
``noexcept`` frame of torch calls ``std::terminate``. ``destroy_process_group()`` joins the worker threads of the
groups nobody else references, but DeepSpeed, LoCo and scripts keep their subgroups, whose threads live on into
finalization (torch 2.13 CPU; see docs/frameworks.md, "Clean exits", and pytorch/pytorch#190489).

:func:`release` (run by an ``atexit`` hook that :func:`register` adds once, and by ``deepspeed_loco.run`` after the
script) waits for the ranks at a barrier, destroys the process groups, and then leaves the GIL free for a moment,
so the threads of groups still referenced finish their releases while the interpreter is whole.
"""
import atexit
import sys
import time

import torch.distributed as dist

SETTLE_SECONDS = 0.2
"""How long :func:`release` leaves the GIL free after destroying the groups (a worker's release takes microseconds;
this covers a loaded machine)."""

_registered = False


def release() -> None:
    """Barrier and ``destroy_process_group()`` while a default process group is initialized; then, in any case,
    :data:`SETTLE_SECONDS` without the GIL (a script that destroyed the group itself still leaves the subgroups that
    DeepSpeed and LoCo hold, whose workers may be releasing)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # no rank tears down while a peer still waits for its part of the last collective
        dist.destroy_process_group()
    time.sleep(SETTLE_SECONDS)


def _release_at_exit() -> None:
    """The ``atexit`` hook: :func:`release` unless the script died of an uncaught exception (then the peers may be
    inside a collective that this rank will never join, and the job has failed anyway)."""
    if getattr(sys, "last_value", None) is None:
        release()


def register() -> None:
    """Adds the ``atexit`` hook that runs :func:`release` at a normal exit (idempotent). ``atexit`` runs hooks last
    registered first, after the script's non-daemon threads have ended and before finalization."""
    global _registered
    if not _registered:
        atexit.register(_release_at_exit)
        _registered = True
