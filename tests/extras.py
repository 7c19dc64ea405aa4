"""Optional extras in tests: :func:`needs_extra` skips a test whose extra is missing, naming it."""
import types

import pytest


def needs_extra(module: str, extra: str) -> types.ModuleType:
    """``module`` imported, or the calling test (or test module, at import) skipped with a reason naming the module
    and the pip extra of ``setup.py`` that installs it."""
    return pytest.importorskip(module, reason=f'needs {module}, which is not installed: pip install '
                                              f'"deepspeed-loco[{extra}]"')
