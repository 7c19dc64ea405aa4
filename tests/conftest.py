"""Shared fixtures: process pools live for the whole session, one per world size, so that test cases share
their process groups instead of paying a start-up each."""
import importlib.util
import os
import sys

import pytest
import torch

from tests.unit.process_pool import ProcessPool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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
