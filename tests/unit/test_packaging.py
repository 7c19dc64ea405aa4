"""What ships: a wheel installed away from the checkout, and an sdist, carry every file of ``deepspeed_loco/csrc``
and the perf model's kernel table, and the op builder finds its sources and header in the installed package; the
wheel requires only the core (no numpy, no scipy); the core imports and runs with numpy and scipy missing, and a
piece that needs an extra says which one."""
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CSRC = REPO / "deepspeed_loco" / "csrc"
# build from a copy: pip and setuptools write build/ and *.egg-info next to setup.py
_IGNORE = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", "*.so", ".venv", ".whl", "out",
                                 "loco_demo_out", ".pytest_cache")


@pytest.fixture(scope="module")
def source_tree(tmp_path_factory) -> Path:
    tree = tmp_path_factory.mktemp("src") / "deepspeed-loco"
    shutil.copytree(REPO, tree, ignore=_IGNORE)
    return tree


def _kernel_files():
    files = sorted(str(p.relative_to(REPO)).replace(os.sep, "/") for p in CSRC.rglob("*") if p.is_file()
                   and "__pycache__" not in p.parts)
    assert any(f.endswith(".cu") for f in files) and any(f.endswith(".cuh") for f in files)
    return files


def _run(cmd, cwd, env=None):
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_wheel_installed_elsewhere_has_every_kernel_source_and_the_builder_finds_them(source_tree, tmp_path):
    wheels, target, elsewhere = tmp_path / "wheels", tmp_path / "site", tmp_path / "cwd"
    elsewhere.mkdir()
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels), "."],
         source_tree)
    (wheel, ) = wheels.glob("deepspeed_loco-*.whl")
    assert set(_kernel_files()) <= set(zipfile.ZipFile(wheel).namelist())
    _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)], elsewhere)
    assert "deepspeed_loco/perf/kernel_times.json" in zipfile.ZipFile(wheel).namelist()
    probe = ("import json, os, deepspeed_loco\n"
             "from deepspeed_loco.ops.op_builder.loco import LocoBuilder\n"
             "from deepspeed_loco.perf.model import DEFAULT_KERNELS, KERNEL_TIMES\n"
             "b = LocoBuilder()\n"
             "print(json.dumps({'package': deepspeed_loco.__file__, 'sources': b.sources(),"
             " 'includes': b.include_paths(), 'kernel_times': str(KERNEL_TIMES),"
             " 'kernel_sets': sorted(DEFAULT_KERNELS.per_element_s)}))\n")
    env = dict(os.environ, PYTHONPATH=str(target), DS_ACCELERATOR="cpu")
    found = json.loads(_run([sys.executable, "-c", probe], elsewhere, env).strip().splitlines()[-1])
    assert Path(found["package"]).is_relative_to(target)  # the installed copy, not the checkout
    assert Path(found["kernel_times"]).is_relative_to(target) and len(found["kernel_sets"]) == 4
    assert found["sources"] and all(Path(s).is_file() and Path(s).is_relative_to(target) for s in found["sources"])
    for name in _kernel_files():
        assert (target / name).is_file(), name
        if name.endswith((".h", ".cuh")):  # every header is on an include path
            assert any((Path(inc) / Path(name).name).is_file() for inc in found["includes"]), name


@pytest.mark.slow
def test_sdist_has_every_kernel_source(source_tree, tmp_path):
    _run([sys.executable, "setup.py", "-q", "sdist", "--dist-dir", str(tmp_path)], source_tree)
    (sdist, ) = tmp_path.glob("deepspeed_loco-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    assert set(_kernel_files()) <= names


@pytest.mark.slow
def test_wheel_requires_the_core_only(source_tree, tmp_path):
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), "."],
         source_tree)
    (wheel, ) = tmp_path.glob("deepspeed_loco-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        metadata = zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    requires = [line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    core = {r.split(">")[0].split("=")[0].strip() for r in requires if "extra ==" not in r}
    assert core == {"torch", "deepspeed", "pydantic", "packaging", "hjson", "ninja"}
    assert any(r.startswith("matplotlib") and 'extra == "report"' in r for r in requires)


# numpy, scipy and matplotlib made uninstalled for one interpreter: every import of them fails as a missing module
_BLOCK = """
import sys
class _Missing:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("numpy", "scipy", "matplotlib"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name.partition(".")[0])
sys.meta_path.insert(0, _Missing())
"""
_CORE = """
import json
import deepspeed_loco, deepspeed_loco.config, deepspeed_loco.findings, deepspeed_loco.ops.loco_reference
import deepspeed_loco.runtime.zero.stage3_hook  # deepspeed_loco.initialize's import path
import deepspeed_loco.simulation, deepspeed_loco.simulation.advise, deepspeed_loco.simulation.report
from deepspeed_loco.config import LocoConfig
from deepspeed_loco.perf.cli import main
from deepspeed_loco.simulation.charts import line_chart
from deepspeed_loco.utils.stats import t_interval
LocoConfig.from_dict({"intra_node_bits": 2})
assert abs(t_interval([1.0, 2.0, 3.0])[2] - 2.0 - 4.302653 / 3 ** 0.5) < 1e-6
main(["predict", "--params", "7e9", "--layers", "32", "--hidden", "4096", "--seq", "4096", "--tokens-per-gpu", "4096",
      "--gpus", "64", "--gpus-per-node", "8", "--gpu", "h100", "--intra-gbps", "3600", "--inter-gbps", "100",
      "--method", "loco4"])
try:
    line_chart([])
except ImportError as exc:
    print(json.dumps({"chart": str(exc)}))
print(json.dumps({"loaded": sorted(m for m in __import__("sys").modules if m.split(".")[0] in ("numpy", "scipy"))}))
"""


@pytest.mark.slow
def test_the_core_imports_and_runs_without_numpy_or_scipy_and_a_missing_extra_is_named(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), DS_ACCELERATOR="cpu")
    out = _run([sys.executable, "-c", _BLOCK + _CORE], tmp_path, env).strip().splitlines()
    assert json.loads(out[-1]) == {"loaded": []}
    assert json.loads(out[-2])["chart"].endswith('pip install "deepspeed-loco[report]"')
    assert json.loads("\n".join(out[:-2]))["step_s"] > 0  # perf predict's JSON
