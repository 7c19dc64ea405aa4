"""Batches of byte windows from one text file, for a model that reads bytes: :class:`TextWindows`."""
import statistics
from typing import Callable, Iterator, Tuple

import torch

HELD_OUT_SHARE = 0.1  # the text's last tenth
HELD_OUT_WINDOWS = 64


def byte_windows(data: torch.Tensor, starts: torch.Tensor, seq_len: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The windows of the 1-D byte tensor ``data`` at ``starts``: ``(x, y)``, int64 ``(len(starts), seq_len)``,
    ``y`` the bytes after ``x``'s."""
    windows = data[starts[:, None] + torch.arange(seq_len + 1)].long()
    return windows[:, :-1], windows[:, 1:]


class TextWindows:
    """The bytes of ``path``: the first 90% train, the last 10% held out. A batch is ``(x, y)``, both int64
    ``(batch, seq_len)``, ``y`` the bytes after ``x``'s. Picklable (the text is read again in each process).

    Raises ValueError naming the file if it cannot be read or is too short for ``seq_len`` in either part."""

    def __init__(self, path: str, seq_len: int, global_batch: int):
        self.path, self.seq_len, self.global_batch = path, seq_len, global_batch
        self._data = None
        train, held_out = self._parts()
        for part, size in (("training", train.numel()), ("held-out", held_out.numel())):
            if size <= seq_len:
                raise ValueError(f"--text {path!r}: its {part} part has {size} bytes, fewer than seq_len + 1 = "
                                 f"{seq_len + 1}; give a longer text or a smaller --seq-len")

    def __getstate__(self):
        return dict(self.__dict__, _data=None)

    def batches(self) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        """Endless global batches of ``global_batch`` windows at random offsets of the training part, the same
        sequence on every call."""
        train, _ = self._parts()
        generator = torch.Generator().manual_seed(0)
        while True:
            starts = torch.randint(0, train.numel() - self.seq_len, (self.global_batch, ), generator=generator)
            yield byte_windows(train, starts, self.seq_len)

    def held_out_loss(self, model: torch.nn.Module, loss_fn: Callable) -> float:
        """The mean of ``loss_fn(model, batch)`` over up to 64 evenly spaced held-out windows, 16 per batch."""
        _, held_out = self._parts()
        last = held_out.numel() - self.seq_len - 1
        starts = torch.linspace(0, last, min(HELD_OUT_WINDOWS, last + 1)).long()
        device = next(model.parameters()).device
        batches = (tuple(t.to(device) for t in byte_windows(held_out, chunk, self.seq_len))
                   for chunk in starts.split(16))
        return statistics.fmean(float(loss_fn(model, batch)) for batch in batches)

    def _parts(self) -> Tuple[torch.Tensor, torch.Tensor]:
        if self._data is None:
            try:
                with open(self.path, "rb") as f:
                    raw = f.read()
            except OSError as err:
                raise ValueError(f"--text {self.path!r} cannot be read: {err.strerror}") from None
            self._data = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long() if raw else torch.zeros(0).long()
        cut = int(self._data.numel() * (1 - HELD_OUT_SHARE))
        return self._data[:cut], self._data[cut:]
