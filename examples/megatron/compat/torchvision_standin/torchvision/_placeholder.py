"""Placeholder classes for the names Megatron's vision modules import and ``pretrain_gpt.py`` never uses."""


def placeholder(module: str, name: str) -> type:
    """A class named ``name`` whose construction raises, saying that this is the stand-in."""

    def refuse(*_args, **_kwargs):
        raise NotImplementedError(f"{module}.{name}: examples/megatron/compat/torchvision_standin is a stand-in for "
                                  f"torchvision (pretrain_gpt does not use it); install a torchvision built for "
                                  f"this torch to train vision models")

    return type(name, (), {"__init__": refuse, "__module__": module})
