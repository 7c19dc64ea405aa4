"""``torchvision.transforms`` names, as placeholders (the stand-in's ``__init__`` says why)."""
from ._placeholder import placeholder


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return placeholder(__name__, name)
