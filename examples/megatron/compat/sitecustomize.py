"""Makes ``import deepspeed.compression.compress`` work on DeepSpeed >= 0.19 without touching DeepSpeed's files.

Megatron-DeepSpeed's ``megatron/training.py`` imports ``init_compression`` and ``redundancy_clean`` from
``deepspeed.compression.compress`` at module level; DeepSpeed 0.19 removed its compression library (only
``deepspeed.compression.helper`` is left, DeepSpeed issue 8489). Megatron calls the two only when the DeepSpeed
config has a ``compression_training`` section; here they raise, saying so. Python imports ``sitecustomize`` at
start-up from the first folder of ``sys.path`` that has one, so this folder goes first on ``PYTHONPATH``; the
stand-in module is created on first import (a meta-path finder), so DeepSpeed is not imported any earlier. The
next ``sitecustomize`` on the path (the environment's own, if any) still runs, after this one.
"""
import importlib.abc
import importlib.util
import os
import sys

_NAME = "deepspeed.compression.compress"


def _removed(*_args, **_kwargs):
    raise NotImplementedError("DeepSpeed >= 0.19 has no compression library (deepspeed.compression.compress): "
                              "remove compression_training from the DeepSpeed config")


class _CompressFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _NAME:
            return None
        for finder in sys.meta_path:  # a DeepSpeed that still has the module keeps its own
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    return spec
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.init_compression = module.redundancy_clean = _removed
        module.__doc__ = "Stand-in (examples/megatron/compat/sitecustomize.py): removed in DeepSpeed 0.19."


if not any(isinstance(finder, _CompressFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _CompressFinder())


def _run_next_sitecustomize():
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        folder = os.path.abspath(entry or os.curdir)
        candidate = os.path.join(folder, "sitecustomize.py")
        if folder != here and os.path.isfile(candidate):
            with open(candidate) as f:
                code = compile(f.read(), candidate, "exec")
            exec(code, {"__name__": "sitecustomize", "__file__": candidate, "__builtins__": __builtins__})
            return


_run_next_sitecustomize()
