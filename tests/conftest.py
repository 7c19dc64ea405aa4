"""Shared fixtures: process pools live for the whole session, one per world size, so that test cases share
their process groups instead of paying a start-up each."""
import pytest

from tests.unit.process_pool import ProcessPool

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
