"""The bundled plays as byte tensors: whole plays for training, other whole plays held out for validation.

Every rank and every arm sees the same data in the same order: the windows of step ``s`` are drawn from a
generator seeded by ``(seed, s)`` alone, and rank ``r`` takes its slice of the step's global batch.
"""
import os
from typing import Dict, Sequence, Tuple

import torch

PLAYS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "plays")
TRAIN_PLAYS = ("hamlet", "julius_caesar", "much_ado_about_nothing", "othello")
VALIDATION_PLAYS = ("macbeth", "midsummer_nights_dream")
SEPARATOR = b"\n\n\n"


def read_play(name: str) -> bytes:
    path = os.path.join(PLAYS_DIR, f"{name}.txt")
    if not os.path.exists(path):
        raise FileNotFoundError(f"bundled play {path} is missing: run from a complete checkout of the repository "
                                f"(loco_lab/plays/)")
    with open(path, "rb") as f:
        return f.read()


def to_tensor(text: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).clone()


class ByteCorpus:
    """``train`` and ``validation``: uint8 tensors of the plays joined by blank lines."""

    def __init__(self, train_plays: Sequence[str] = TRAIN_PLAYS, validation_plays: Sequence[str] = VALIDATION_PLAYS):
        overlap = set(train_plays) & set(validation_plays)
        if overlap:
            raise ValueError(f"plays {sorted(overlap)} are both in training and validation")
        self.train_plays, self.validation_plays = tuple(train_plays), tuple(validation_plays)
        self.train = to_tensor(SEPARATOR.join(read_play(p) for p in train_plays))
        self.validation = to_tensor(SEPARATOR.join(read_play(p) for p in validation_plays))

    def sizes(self) -> Dict[str, int]:
        return {"train_bytes": self.train.numel(), "validation_bytes": self.validation.numel()}

    def train_batch(self, step: int, seed: int, global_batch: int, seq_len: int, rank: int,
                    world_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Rank ``rank``'s ``global_batch // world_size`` windows of step ``step``: (inputs, next bytes), int64."""
        if global_batch % world_size:
            raise ValueError(f"global batch {global_batch} is not a multiple of the world size {world_size}")
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, self.train.numel() - seq_len - 1, (global_batch, ), generator=gen)
        per_rank = global_batch // world_size
        mine = starts[rank * per_rank:(rank + 1) * per_rank]
        return _windows(self.train, mine, seq_len)

    def validation_batches(self, windows: int, seq_len: int, rank: int, world_size: int, batch: int):
        """Rank ``rank``'s share of ``windows`` evenly spaced validation windows, in batches of ``batch``.

        ``windows`` is rounded down to a multiple of ``world_size`` so that every rank runs the same number
        of forward passes (ZeRO-3 gathers parameters collectively).
        """
        windows = max(world_size, windows - windows % world_size)
        last = self.validation.numel() - seq_len - 1
        starts = torch.linspace(0, last, windows).long()[rank::world_size]
        for i in range(0, starts.numel(), batch):
            yield _windows(self.validation, starts[i:i + batch], seq_len)


def _windows(data: torch.Tensor, starts: torch.Tensor, seq_len: int) -> Tuple[torch.Tensor, torch.Tensor]:
    index = starts[:, None] + torch.arange(seq_len + 1)[None, :]
    chunk = data[index].long()
    return chunk[:, :-1], chunk[:, 1:]
