"""A device tensor read on the host without a synchronization: the copy holds the tensor's values as they were when it
started, and :class:`Landing` hands copies back in order, each once, as they land (waiting only for one beyond its
``in_flight``)."""
import pytest
import torch

from deepspeed_loco.utils.host_copy import HostCopy, Landing

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
def test_the_copy_holds_the_values_when_it_started_on_the_host(device):
    tensor = torch.arange(1000, dtype=torch.float64, device=device) / 7
    copy = HostCopy(tensor)
    want = tensor.cpu().clone()
    tensor.add_(1)  # queued after the copy on the device's stream: the copy keeps the earlier values
    result = copy.result()
    assert copy.ready() and result.device.type == "cpu" and torch.equal(result, want)


class _Copy:
    """A copy that lands after ``polls`` calls of ``ready``."""

    def __init__(self, value, polls):
        self.value, self.polls, self.waited = value, polls, False

    def ready(self):
        self.polls -= 1
        return self.polls < 0

    def result(self):
        self.waited = self.polls >= 0
        return torch.tensor([self.value])


def test_landing_hands_back_copies_in_order_once_landed_and_waits_only_beyond_in_flight():
    landing = Landing(in_flight=1)
    slow, fast = _Copy(1.0, polls=5), _Copy(2.0, polls=0)
    landing.add(10, slow)
    assert landing.landed() == []  # on its way: not waited for
    landing.add(20, fast)  # two waiting, one beyond in_flight: the older is waited for, then the landed one
    assert [(k, float(v)) for k, v in landing.landed()] == [(10, 1.0), (20, 2.0)]
    assert slow.waited and not fast.waited
    assert landing.landed() == []  # each once
    with pytest.raises(ValueError, match="in_flight 0 must be >= 1"):
        Landing(in_flight=0)
