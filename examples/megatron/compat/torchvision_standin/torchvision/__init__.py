"""Stand-in for torchvision (examples/megatron/compat/torchvision_standin), on the path only when the real one does
not import: Megatron-DeepSpeed's vision modules import ``torchvision.datasets`` and ``torchvision.transforms`` at
module level, and ``pretrain_gpt.py`` never calls them. Every name is a placeholder class; using one is an error."""
from . import datasets, transforms  # noqa: F401
