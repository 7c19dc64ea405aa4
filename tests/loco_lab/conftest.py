"""Fixtures of the demo tests."""
import pytest
import torch


@pytest.fixture
def gpus(monkeypatch):
    """``gpus(n)`` makes torch report ``n`` CUDA devices (0: CUDA unavailable) for the rest of the test."""

    def simulate(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    return simulate
