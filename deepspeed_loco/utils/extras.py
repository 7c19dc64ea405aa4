"""Optional dependencies: a piece that needs one imports it through :func:`import_extra`, so that its absence says
which extra of the distribution installs it."""
import importlib
from types import ModuleType


def import_extra(module: str, extra: str) -> ModuleType:
    """``module`` imported; where it (or a package it needs) is not installed, an ImportError that names the pip
    extra ``extra`` (``setup.py``'s ``extras_require``) that installs it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        raise ImportError(f"{module} needs {exc.name}, which is not installed: "
                          f'pip install "deepspeed-loco[{extra}]"') from exc
