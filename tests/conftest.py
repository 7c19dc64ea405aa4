"""Shared fixtures (process pools live for the whole session, one per world size, so that test cases share their
process groups instead of paying a start-up each) and the test tiers: every collected test is marked with the
pytest.ini markers it belongs to, here and nowhere else (docs/contributing.md says how to run each tier).

* ``lab``: a test of the study's code (``loco_lab/``, ``benchmarks/``): every test under :data:`LAB_FOLDERS`;
* ``gpu``: a CUDA-only test: one whose skip condition's reason starts with :data:`CUDA_REASON`;
* ``slow``: a test of seconds on 2 cores: every test that uses the ``process_pool`` fixture (a real gloo world of
  processes), and the test functions of :data:`SLOW_TESTS` (launched jobs, wheels, long simulations).
"""
import importlib.util
import os
import sys

import pytest
import torch

from tests.unit.process_pool import ProcessPool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LAB_FOLDERS = ("tests/loco_lab/", "tests/benchmarks/")  # the tests of loco_lab/ and benchmarks/
CUDA_REASON = "needs a CUDA device"  # how the reason of a CUDA-only test's skipif begins
# test functions (all their parametrizations) of a second or more on 2 cores that use no process pool
SLOW_TESTS = (
    "tests/unit/ops/test_library.py::test_compiled_reducer_has_no_graph_break_and_is_bit_identical",
    "tests/unit/runtime/comm/test_noise_stats.py::test_sampled_error_noise_and_signal_are_unbiased",
    "tests/unit/runtime/zero/test_stage3_hook.py::test_unmodified_script_runs_with_loco_through_the_module_runner",
    "tests/unit/simulation/test_advise.py::"
    "test_a_budget_smaller_than_the_probe_is_refused_with_the_smallest_that_answers",
    "tests/unit/simulation/test_advise.py::test_advise_end_to_end_gives_a_valid_block_with_its_evidence",
    "tests/unit/simulation/test_advise.py::test_an_open_question_gets_more_seeds_while_the_budget_lasts",
    "tests/unit/simulation/test_advise.py::test_runs_side_by_side_give_the_same_evidence_as_runs_one_at_a_time",
    "tests/unit/simulation/test_advise_cli.py::test_a_users_model_and_data_give_a_valid_block_and_the_files",
    "tests/unit/simulation/test_advise_cli.py::test_text_gives_byte_windows_and_a_held_out_loss",
    "tests/unit/simulation/test_advise_cli.py::test_the_console_script_needs_no_loco_lab",
    "tests/unit/simulation/test_charts.py::test_line_chart_draws_every_curve_in_its_colour",
    "tests/unit/simulation/test_report.py::test_every_panel_has_a_y_label_and_names_the_held_out_data_only_when_told",
    "tests/unit/simulation/test_report.py::test_records_of_simulate_results_carry_what_the_table_reads",
    "tests/unit/simulation/test_report.py::test_write_report_and_the_cli_give_the_table_the_json_and_the_png",
    "tests/unit/simulation/test_stream.py::test_streaming_keeps_at_most_one_nodes_gradients_alive",
    "tests/unit/simulation/test_stream.py::test_streaming_nodes_gives_the_same_results_bit_for_bit",
    "tests/unit/simulation/test_train.py::test_fidelity_is_measured_before_clipping",
    "tests/unit/simulation/test_train.py::test_quantized_arms_send_their_wire_bytes_and_loco_removes_the_bias",
    "tests/unit/simulation/test_train.py::test_rank_chunks_give_the_same_training_as_one_pass",
    "tests/unit/simulation/test_train.py::test_same_seed_same_run_and_eval_is_recorded",
    "tests/unit/simulation/test_train.py::test_vmap_and_loop_agree_within_rounding",
    "tests/unit/test_frameworks.py::test_accelerate_example_trains_with_loco_and_its_loss_falls",
    "tests/unit/test_examples.py::test_train_loco_runs_as_the_examples_readme_says",
    "tests/unit/test_frameworks.py::test_accelerate_launch_runs_the_example_with_loco_and_the_documented_figures",
    "tests/unit/test_frameworks.py::test_hugging_face_trainer_runs_loco_after_install",
    "tests/unit/test_megatron_example.py::test_compression_stand_in_and_the_next_sitecustomize",
    "tests/unit/test_megatron_example.py::test_unmodified_pretrain_gpt_trains_through_the_library_on_two_cpu_ranks",
    "tests/unit/test_packaging.py::test_sdist_has_every_kernel_source",
    "tests/unit/test_packaging.py::test_the_core_imports_and_runs_without_numpy_or_scipy_and_a_missing_extra_is_named",
    "tests/unit/test_packaging.py::test_wheel_installed_elsewhere_has_every_kernel_source_and_the_builder_finds_them",
    "tests/unit/test_packaging.py::test_wheel_requires_the_core_only",
    "tests/unit/test_run.py::test_deepspeed_launcher_runs_an_unmodified_megatron_style_script",
    "tests/unit/utils/test_clean_exit.py::test_short_gloo_jobs_all_end_with_return_code_zero",
    "tests/unit/utils/test_logging.py::test_caplog_captures_log_rank0_whatever_was_imported_first",
    "tests/unit/utils/test_logging.py::test_each_record_is_printed_once_with_or_without_a_root_handler",
    "tests/unit/utils/test_turn_on_hint.py::"
    "test_imported_but_not_installed_deepspeeds_rejection_is_followed_by_how_to_turn_loco_on",
    "tests/unit/utils/test_turn_on_hint.py::test_installed_the_same_script_trains_with_loco_and_no_hint",
)


def _function(item) -> str:
    """``path::function`` of a collected test, without its parametrization."""
    return item.nodeid.split("[", 1)[0]


def _needs_cuda(item) -> bool:
    return any(str(mark.kwargs.get("reason", "")).startswith(CUDA_REASON) for mark in item.iter_markers("skipif"))


@pytest.hookimpl(tryfirst=True)  # before pytest's -m deselects by these marks
def pytest_collection_modifyitems(config, items):
    """Marks each test ``lab``, ``gpu`` and ``slow`` by the module docstring's rules. A :data:`SLOW_TESTS` entry
    whose test module was collected but has no such function (renamed or removed) is a usage error naming it."""
    slow = set(SLOW_TESTS)
    for item in items:
        if item.nodeid.startswith(LAB_FOLDERS):
            item.add_marker(pytest.mark.lab)
        if _needs_cuda(item):
            item.add_marker(pytest.mark.gpu)
        if "process_pool" in item.fixturenames or _function(item) in slow:
            item.add_marker(pytest.mark.slow)
    modules = {item.nodeid.split("::", 1)[0]: item.module for item in items if isinstance(item, pytest.Function)}
    stale = [test for test in SLOW_TESTS if test.split("::", 1)[0] in modules
             and not callable(getattr(modules[test.split("::", 1)[0]], test.split("::", 1)[1], None))]
    if stale:
        raise pytest.UsageError(f"tests/conftest.py SLOW_TESTS names no collected test: {stale}; rename or remove "
                                f"the entries")

_POOLS = {}


@pytest.fixture(scope="session")
def process_pool():
    """``process_pool(W)``: a live gloo world of ``W`` CPU processes (created once per session)."""

    def get(world_size: int) -> ProcessPool:
        if world_size not in _POOLS:
            _POOLS[world_size] = ProcessPool(world_size)
        return _POOLS[world_size]

    yield get
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


@pytest.fixture(scope="session")
def benchmark_module():
    """``benchmark_module(name)``: ``benchmarks/<name>.py`` imported as a module (the benchmarks are scripts)."""

    def load(name: str):
        folder = os.path.join(ROOT, "benchmarks")
        spec = importlib.util.spec_from_file_location(f"benchmark_{name}", os.path.join(folder, name + ".py"))
        module = importlib.util.module_from_spec(spec)
        # its siblings import as a script's would (the script's folder first on the path), and the folder leaves the
        # path again: benchmarks/kernels.py must not shadow an installed ``kernels`` that transformers imports later
        sys.path.insert(0, folder)
        try:
            spec.loader.exec_module(module)
        finally:
            sys.path.remove(folder)
        return module

    return load


@pytest.fixture
def gpus(monkeypatch):
    """``gpus(n)`` makes torch report ``n`` CUDA devices (0: CUDA unavailable) for the rest of the test."""

    def simulate(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    return simulate


@pytest.fixture(autouse=True)
def seeded_torch():
    """Every test starts from torch's global seed 0, so a test that draws from the global generator draws the same
    numbers whatever ran before it (in any order, with any ``-k``): a failure reproduces."""
    torch.manual_seed(0)
