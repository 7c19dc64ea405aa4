"""``torchvision.datasets`` names, as placeholders (the stand-in's ``__init__`` says why); ``VisionDataset`` is a
plain base class, since Megatron subclasses it at import time."""
from ._placeholder import placeholder


class VisionDataset:
    """Base class Megatron's ``ImageFolder`` derives from at import time."""


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return placeholder(__name__, name)
