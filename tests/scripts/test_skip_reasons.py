"""scripts/pytest_plugins/skip_reasons.py, the plugin scripts/test.sh loads: the summary says why tests skipped, in
one line counting each reason, and pytest's own counts stay the last line. A real pytest run in a subprocess."""
import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLUGINS = os.path.join(REPO, "scripts", "pytest_plugins")

TESTS = """
    import pytest

    @pytest.mark.skipif(True, reason="needs a CUDA device (fused LoCo kernels)")
    @pytest.mark.parametrize("i", range(3))
    def test_kernel(i):
        pass

    def test_extra():
        pytest.skip("transformers is not installed")

    def test_runs():
        pass
"""


def _pytest(tmp_path, *args) -> list:
    (tmp_path / "test_some.py").write_text(textwrap.dedent(TESTS))
    env = dict(os.environ, PYTHONPATH=PLUGINS)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "skip_reasons", *args,
                           "test_some.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.strip().splitlines()


@pytest.mark.slow
def test_the_skips_are_counted_by_reason_and_pytests_counts_stay_last(tmp_path):
    lines = _pytest(tmp_path)
    assert lines[-2] == "skipped: 3 needs a CUDA device (fused LoCo kernels), 1 transformers is not installed"
    assert lines[-1].startswith("1 passed, 4 skipped in ")


@pytest.mark.slow
def test_without_skips_there_is_no_line(tmp_path):
    lines = _pytest(tmp_path, "-k", "runs")
    assert not any(line.startswith("skipped:") for line in lines) and lines[-1].startswith("1 passed, 4 deselected")


def test_the_test_command_loads_the_plugin():
    with open(os.path.join(REPO, "scripts", "test.sh")) as handle:
        command = handle.read()
    assert "-p skip_reasons" in command and "scripts/pytest_plugins" in command
