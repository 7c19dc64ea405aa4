"""A toy regression problem for the simulation tests: a small MLP learning ``sin(x @ teacher)``."""
import torch


def toy_model(hidden: int = 64) -> torch.nn.Module:
    """An MLP 8 -> ``hidden`` -> 1 with tanh."""
    return torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))


def toy_batches(global_batch: int):
    """Endless ``(x, y)`` global batches of ``global_batch`` samples (``x`` ``(B, 8)``, ``y = sin(x @ teacher)``),
    the same sequence on every call."""
    gen = torch.Generator().manual_seed(3)
    teacher = torch.randn(8, 1, generator=gen)
    while True:
        x = torch.randn(global_batch, 8, generator=gen)
        yield x, torch.sin(x @ teacher)


def toy_loss(model: torch.nn.Module, batch) -> torch.Tensor:
    """Mean squared error of ``model`` on an ``(x, y)`` batch."""
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)
