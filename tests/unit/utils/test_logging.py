"""The ``deepspeed_loco`` logger: propagates (so ``caplog`` and an application's handlers see its records whatever
was imported first), prints each record once, and carries exactly one handler of ours after a reload."""
import importlib
import logging
import os
import subprocess
import sys
import textwrap

import pytest

from deepspeed_loco.utils import logging as loco_logging
from deepspeed_loco.utils.logging import HANDLER_NAME, log_rank0, logger

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
HOOK = "deepspeed_loco.runtime.zero.stage3_hook"  # imports DeepSpeed and the logger module


def _run_python(args, cwd):
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=REPO)
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def _ours():
    return [h for h in logger.handlers if h.get_name() == HANDLER_NAME]


@pytest.mark.slow
@pytest.mark.parametrize("first,then", [("deepspeed", HOOK), ("deepspeed_loco.utils.logging", "deepspeed")])
def test_caplog_captures_log_rank0_whatever_was_imported_first(tmp_path, first, then):
    """A fresh pytest process per import order, as import order is fixed once per process."""
    (tmp_path / "test_order.py").write_text(textwrap.dedent(f"""
        import importlib

        def test_capture(caplog):
            importlib.import_module("{first}")
            importlib.import_module("{then}")
            importlib.import_module("{HOOK}")
            from deepspeed_loco.utils.logging import log_rank0
            log_rank0("captured whatever the order")
            assert [r.getMessage() for r in caplog.records if r.name == "deepspeed_loco"] == [
                "captured whatever the order"]
    """))
    proc = _run_python(["-m", "pytest", "-q", "-p", "no:cacheprovider", "test_order.py"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.slow
def test_each_record_is_printed_once_with_or_without_a_root_handler(tmp_path):
    script = textwrap.dedent("""
        import logging
        from deepspeed_loco.utils.logging import log_rank0
        log_rank0("before basicConfig")
        logging.basicConfig(format="root: %(message)s")
        log_rank0("after basicConfig")
    """)
    proc = _run_python(["-c", script], tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    ours = [line for line in lines if "before basicConfig" in line]
    assert len(ours) == 1 and "[INFO] [<string>:4] before basicConfig" in ours[0]  # our handler, caller's line
    assert [line for line in lines if "after basicConfig" in line] == ["root: after basicConfig"]


def test_caplog_captures_log_rank0_in_process(caplog):
    log_rank0("a record for caplog", logging.WARNING)
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [(logging.WARNING, "a record for caplog")]


def test_reload_keeps_one_handler_propagation_and_the_level():
    for _ in range(2):
        importlib.reload(loco_logging)
    assert len(_ours()) == 1
    assert logger is logging.getLogger("deepspeed_loco") and logger.propagate
    assert logger.level == logging.INFO


def test_a_level_set_by_the_user_survives_a_reload():
    logger.setLevel(logging.WARNING)
    try:
        importlib.reload(loco_logging)
        assert logger.level == logging.WARNING
    finally:
        logger.setLevel(logging.INFO)


def test_our_handler_stays_quiet_while_the_root_logger_has_a_handler():
    record = logging.LogRecord("deepspeed_loco", logging.INFO, __file__, 1, "m", None, None)
    handler, root = _ours()[0], logging.getLogger()
    extra = logging.NullHandler()
    saved = root.handlers[:]
    try:
        root.handlers[:] = []
        assert handler.filter(record)
        root.addHandler(extra)
        assert not handler.filter(record)
    finally:
        root.handlers[:] = saved


def kernel_choice_lines(load_error):
    """On a pool rank: the ``deepspeed_loco`` records of choosing kernels for CPU and for CUDA tensors (the CUDA
    extension failing to load with ``load_error``, or loading when None)."""
    import torch

    from deepspeed_loco.ops import library as ops
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger.addHandler(handler)
    saved = ops._cuda_load_error
    ops._reset()
    ops._cuda_load_error = lambda: None if load_error is None else OSError(load_error)
    try:
        ops.kernels_for(torch.device("cpu"))
        ops.kernels_for(torch.device("cuda"))
    finally:
        ops._cuda_load_error = saved
        ops._reset()
        logger.removeHandler(handler)
    return records


@pytest.mark.parametrize("load_error", [None, "no nvcc"])
def test_kernel_choice_is_one_rank_0_line_and_a_failed_build_is_named_per_rank(process_pool, load_error):
    """The job's choice of kernels is printed once, by rank 0; a CUDA extension that failed to build or load is the
    rank's own fact: each rank says it, naming itself."""
    lines = process_pool(2).run(kernel_choice_lines, load_error)
    assert len(lines[0]) == 2 and "PyTorch reference kernels for cpu tensors" in lines[0][0]
    if load_error is None:
        assert "fused CUDA kernels (loco_ops)" in lines[0][1] and lines[1] == []
    else:
        for rank in range(2):
            assert lines[rank][-1].startswith(f"rank {rank}: deepspeed_loco: PyTorch reference kernels for CUDA")
            assert "(OSError: no nvcc)" in lines[rank][-1]
        assert len(lines[1]) == 1


def test_describe_ranks_joins_runs_of_consecutive_ranks():
    from deepspeed_loco.utils.logging import describe_ranks
    assert describe_ranks([2]) == "rank 2"
    assert describe_ranks([3, 1, 2, 0]) == "ranks 0-3"
    assert describe_ranks([7, 0, 2, 5, 6, 2]) == "ranks 0, 2, 5-7"
    assert describe_ranks([0, 1, 3]) == "ranks 0, 1, 3"


def _said_for_ranks():
    """Ranks 0, 1 and 3 pass one message, rank 2 another; what each rank's logger recorded."""
    import torch.distributed as dist
    from deepspeed_loco.utils.logging import log_rank0_for_ranks

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    try:
        log_rank0_for_ranks("buffers start from zero" if dist.get_rank() != 2 else "another reason")
        log_rank0_for_ranks(None)  # nobody has anything to say: nothing is logged
    finally:
        logger.removeHandler(handler)
    return [(record.levelno, record.getMessage()) for record in records]


def test_a_line_for_every_rank_is_logged_once_by_rank_0_naming_the_ranks(process_pool):
    said = process_pool(4).run(_said_for_ranks)
    assert said[0] == [(logging.WARNING, "deepspeed-loco: ranks 0, 1, 3: buffers start from zero"),
                       (logging.WARNING, "deepspeed-loco: rank 2: another reason")]
    assert said[1:] == [[], [], []]
