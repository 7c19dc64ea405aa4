"""Shared fixtures (process pools live for the whole session, one per world size, so that test cases share their
process groups instead of paying a start-up each) and the test tiers (docs/contributing.md says how to run each).

A test's tier is declared where the test is, by a pytest.ini marker on it (or its module's ``pytestmark``, or a
``pytest.param``'s marks), or by a fixture that implies one:

* ``slow``: ``@pytest.mark.slow``, or the ``process_pool`` fixture (a real gloo world of processes), which implies it;
* ``gpu``: ``@pytest.mark.gpu``; without a CUDA device such a test is skipped here ("needs a CUDA device");
* ``lab``: every test under :data:`LAB_FOLDERS` (a test of the study's code, ``loco_lab/`` and ``benchmarks/``).

The suite measures itself: at the end of a run, every test of the default tier (marked neither ``slow``, ``gpu`` nor
``lab``) that took longer than :data:`FAST_BUDGET_S` (setup, call and teardown together) is named in a warning of the
terminal summary, so that a test that grew slow is marked instead of slowing the default tier unnoticed. A warning,
not a failure: the durations depend on the machine's load, and a loaded machine must not fail a correct change.
"""
import importlib.util
import os
import sys
from typing import Dict

import pytest
import torch

from tests.unit.process_pool import ProcessPool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LAB_FOLDERS = ("tests/loco_lab/", "tests/benchmarks/")  # the tests of loco_lab/ and benchmarks/
FAST_BUDGET_S = 1.0  # a test of the default tier takes less (pytest.ini's "slow": a second or more on 2 cores)
NO_CUDA = pytest.mark.skip(reason="needs a CUDA device (marked gpu)")


@pytest.hookimpl(tryfirst=True)  # before pytest's -m deselects by these marks
def pytest_collection_modifyitems(config, items):
    """Adds the markers the module docstring derives (``lab`` by folder, ``slow`` by the process pool) and skips the
    ``gpu`` tests without a CUDA device."""
    cuda = torch.cuda.is_available()
    for item in items:
        if item.nodeid.startswith(LAB_FOLDERS):
            item.add_marker(pytest.mark.lab)
        if "process_pool" in item.fixturenames:
            item.add_marker(pytest.mark.slow)
        if not cuda and item.get_closest_marker("gpu") is not None:
            item.add_marker(NO_CUDA)


TIERS = ("slow", "gpu", "lab")  # the markers that take a test out of the default tier (pytest.ini's addopts)
_DURATIONS: Dict[str, float] = {}  # nodeid -> seconds (setup, call, teardown), of the default tier's tests


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Adds each phase's seconds of a default-tier test to :data:`_DURATIONS` (a skipped phase counts 0)."""
    report = (yield).get_result()
    if all(item.get_closest_marker(tier) is None for tier in TIERS) and not report.skipped:
        _DURATIONS[item.nodeid] = _DURATIONS.get(item.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    """Names every default-tier test that took longer than :data:`FAST_BUDGET_S` (module docstring)."""
    over = sorted(((s, nodeid) for nodeid, s in _DURATIONS.items() if s > FAST_BUDGET_S), reverse=True)
    if over:
        terminalreporter.write_sep("=", f"{len(over)} test(s) above the fast tier's {FAST_BUDGET_S:g} s without "
                                        f"@pytest.mark.slow", yellow=True)
        for seconds, nodeid in over:
            terminalreporter.write_line(f"{seconds:6.2f} s  {nodeid}")
        terminalreporter.write_line("mark each @pytest.mark.slow (docs/contributing.md), or make it faster")


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
