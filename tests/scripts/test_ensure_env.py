"""scripts/ensure_env.sh and scripts/missing_requirements.py: what is missing is read from setup.py (the core and the
extras named), with nothing missing pip is not called at all, and a torch too old is an error, not replaced. (That the scripts leave an installed deepspeed-loco
as it was is tried from venvs holding one: README.md, "Install".)"""
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from tests.extras import needs_extra

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = os.path.join(REPO, "scripts")


SETUP_PY = """
    from setuptools import setup
    setup(name="x", install_requires=["pytest", "no-such-distribution-xyz>=1"],
          extras_require={"a": ["pytest>=999", "pytest"], "b": ["another-missing-one"]})
"""


def _missing(extras: str, tmp_path, without_packaging: bool = False) -> list:
    """missing_requirements.py's lines for a checkout whose setup.py is :data:`SETUP_PY` (``without_packaging``:
    as in a fresh environment, where ``import packaging`` fails)."""
    script = tmp_path / "scripts" / "missing_requirements.py"
    script.parent.mkdir(exist_ok=True)
    shutil.copy(os.path.join(SCRIPTS, "missing_requirements.py"), script)
    (tmp_path / "setup.py").write_text(textwrap.dedent(SETUP_PY))
    block = "sys.modules['packaging'] = None; " if without_packaging else ""
    code = f"import runpy, sys; {block}sys.argv = [{str(script)!r}, {extras!r}]; runpy.run_path(sys.argv[0], " \
           f"run_name='__main__')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


@pytest.mark.parametrize("without_packaging", [False, True])
def test_the_unsatisfied_requirements_of_the_core_and_the_named_extras_are_printed(tmp_path, without_packaging):
    assert _missing("a", tmp_path, without_packaging) == ["no-such-distribution-xyz>=1", "pytest>=999"]


def test_an_unknown_extra_is_refused_naming_the_extras():
    done = subprocess.run([sys.executable, os.path.join(SCRIPTS, "missing_requirements.py"), "tset"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "no extra ['tset'] in setup.py (extras: ['demo', 'hf', 'report', 'test'])" in \
        done.stderr


def _recording_python(tmp_path):
    """A python3 that appends its arguments to ``tmp_path/calls`` and runs this interpreter; (path, calls file)."""
    calls = tmp_path / "calls"
    python = tmp_path / "python3"
    python.write_text(f'#!/bin/sh\necho "$*" >> {calls}\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    return python, calls


def test_a_torch_too_old_for_setup_py_is_an_error_and_never_replaced(tmp_path):
    checkout = tmp_path / "checkout"
    (checkout / "scripts").mkdir(parents=True)
    for name in ("ensure_env.sh", "missing_requirements.py"):
        shutil.copy(os.path.join(SCRIPTS, name), checkout / "scripts")
    (checkout / "setup.py").write_text('from setuptools import setup\nsetup(name="x", install_requires=["torch>=999"], '
                                       'extras_require={"a": []})\n')
    python, calls = _recording_python(tmp_path)
    done = subprocess.run(["bash", str(checkout / "scripts" / "ensure_env.sh"), "a"], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHON=str(python)))
    assert done.returncode == 1 and "this checkout needs torch>=999: install a newer torch yourself" in done.stderr
    assert not any(" pip " in f" {line} " for line in calls.read_text().splitlines())


@pytest.mark.slow
def test_with_everything_installed_nothing_is_missing_and_pip_is_not_called(tmp_path):
    """This suite runs, so the core and the test command's extras are installed: ensure_env.sh finds nothing to
    install and never starts pip (a python3 that records its arguments says so). Run without the extras (pytest
    called directly, not through the test command), it is skipped, naming the first one missing."""
    for module, extra in (("matplotlib", "test"), ("scipy", "test"), ("tqdm", "test"), ("transformers", "hf"),
                          ("accelerate", "hf")):
        needs_extra(module, extra)
    python, calls = _recording_python(tmp_path)
    done = subprocess.run(["bash", os.path.join(SCRIPTS, "ensure_env.sh"), "test,demo,hf"], capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHON=str(python)))
    assert done.returncode == 0 and done.stderr == "", done.stderr
    ran = calls.read_text().splitlines()
    assert ran and not any(" pip " in f" {line} " for line in ran)
