"""The bundled plays as byte tensors: whole plays for training, other whole plays held out for validation.

Every rank and every arm sees the same data in the same order: the windows of step ``s`` are drawn from a
generator seeded by ``(seed, s)`` alone, and rank ``r`` takes its slice of the step's global batch.
"""
import os
from typing import Dict, Optional, Sequence, Tuple

import torch

from deepspeed_loco.simulation.text_windows import byte_windows

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


def bytes_needed(seq_len: int) -> Tuple[int, int]:
    """``(training, validation)``: the fewest bytes each part of a corpus must hold for a context of ``seq_len``.

    A window is ``seq_len + 1`` bytes (inputs and next bytes). Training draws window starts from
    ``[0, n - seq_len - 1)``, which needs ``n >= seq_len + 2``; validation's last window starts at
    ``n - seq_len - 1 >= 0``, which needs ``n >= seq_len + 1``.
    """
    return seq_len + 2, seq_len + 1


def file_bytes_needed(seq_len: int, validation_share: float) -> int:
    """The smallest text file whose split (:func:`_cut`) leaves both parts :func:`bytes_needed`."""
    train, validation = bytes_needed(seq_len)
    size = train + validation
    while _cut(size, validation_share) < train or size - _cut(size, validation_share) < validation:
        size += 1  # both parts grow with the file, so the first size that fits is the minimum
    return size


def _cut(size: int, validation_share: float) -> int:
    """Where a text file of ``size`` bytes splits: training before, the held-out ``validation_share`` after."""
    return int(size * (1 - validation_share))


def to_tensor(text: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).clone()


class ByteCorpus:
    """``train`` and ``validation``: uint8 tensors of texts joined by blank lines (by default the bundled plays,
    whole plays held out for validation; :meth:`from_path` takes a user's own text)."""

    def __init__(self, train_plays: Sequence[str] = TRAIN_PLAYS, validation_plays: Sequence[str] = VALIDATION_PLAYS):
        overlap = set(train_plays) & set(validation_plays)
        if overlap:
            raise ValueError(f"plays {sorted(overlap)} are both in training and validation")
        self.train_plays, self.validation_plays = tuple(train_plays), tuple(validation_plays)
        self.train = to_tensor(SEPARATOR.join(read_play(p) for p in train_plays))
        self.validation = to_tensor(SEPARATOR.join(read_play(p) for p in validation_plays))

    @classmethod
    def from_path(cls, path: str, seq_len: int, validation_share: float = 0.1) -> "ByteCorpus":
        """A corpus of the user's text for a context of ``seq_len`` bytes. A file: its last ``validation_share`` of
        bytes is held out. A folder: every ``*.txt`` in it, and whole files held out: those named after the bundled
        validation plays when present (so results compare with the bundled split), else the last
        ``validation_share`` of the files by name.

        Raises FileNotFoundError for a missing path; ValueError for a folder of fewer than 2 ``.txt`` files or a
        text too short for one window in each part, saying how many bytes it needs (:func:`bytes_needed`).
        """
        if os.path.isdir(path):
            files = sorted(f for f in os.listdir(path) if f.endswith(".txt"))
            held = [f for f in files if f.startswith(VALIDATION_PLAYS)]
            held = held or files[len(files) - max(1, round(validation_share * len(files))):]
            if len(held) == len(files):
                raise ValueError(f"text folder {path}: needs at least 2 .txt files (one to train on, one held out)")
            read = lambda names: SEPARATOR.join(open(os.path.join(path, f), "rb").read() for f in names)  # noqa
            train, validation = read(f for f in files if f not in held), read(held)
            names = tuple(f for f in files if f not in held), tuple(held)
            _check_parts(f"--text {path}", f"the held-out {', '.join(held)}", len(train), len(validation), seq_len)
        elif os.path.isfile(path):
            text = open(path, "rb").read()
            need = file_bytes_needed(seq_len, validation_share)
            if len(text) < need:
                raise ValueError(f"--text {path}: {len(text)} bytes is too short for a context of {seq_len} bytes: "
                                 f"a file needs at least {need} bytes (its last {validation_share:.0%}, held out for "
                                 f"validation, must hold a window of context + 1 bytes, the rest one more)")
            cut = _cut(len(text), validation_share)
            train, validation, names = text[:cut], text[cut:], ((path, ), (f"{path} (last {validation_share:.0%})", ))
        else:
            raise FileNotFoundError(f"--text {path}: no such file or folder")
        corpus = cls.__new__(cls)
        corpus.train_plays, corpus.validation_plays = names
        corpus.train, corpus.validation = to_tensor(train), to_tensor(validation)
        return corpus

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
        return byte_windows(self.train, mine, seq_len)

    def validation_batches(self, windows: int, seq_len: int, rank: int, world_size: int, batch: int):
        """Rank ``rank``'s share of ``windows`` evenly spaced validation windows, in batches of ``batch``.

        ``windows`` is rounded down to a multiple of ``world_size`` so that every rank runs the same number
        of forward passes (ZeRO-3 gathers parameters collectively).
        """
        windows = max(world_size, windows - windows % world_size)
        last = self.validation.numel() - seq_len - 1
        starts = torch.linspace(0, last, windows).long()[rank::world_size]
        for i in range(0, starts.numel(), batch):
            yield byte_windows(self.validation, starts[i:i + batch], seq_len)


def load_corpus(text: Optional[str], seq_len: int) -> ByteCorpus:
    """The bundled plays, or with ``text`` (a file or a folder of ``.txt`` files) the user's own text, for a
    context of ``seq_len`` bytes (:meth:`ByteCorpus.from_path` says what it raises; a context longer than the
    bundled plays allow is a ValueError too)."""
    if text:
        return ByteCorpus.from_path(text, seq_len)
    corpus = ByteCorpus()
    _check_parts("the bundled plays", f"the held-out {', '.join(VALIDATION_PLAYS)}", corpus.train.numel(),
                 corpus.validation.numel(), seq_len)
    return corpus


def _check_parts(source: str, held_out: str, train: int, validation: int, seq_len: int) -> None:
    """Raises ValueError unless ``train`` and ``validation`` bytes of ``source`` are :func:`bytes_needed`."""
    need_train, need_validation = bytes_needed(seq_len)
    if train < need_train or validation < need_validation:
        raise ValueError(f"{source}: too little text for a context of {seq_len} bytes: the training part holds {train} "
                         f"bytes and {held_out} {validation}; they need at least {need_train} and {need_validation} "
                         f"(one window of context + 1 bytes each)")


