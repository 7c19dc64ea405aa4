"""The kernel sources ship: a wheel installed away from the checkout, and an sdist, carry every file of
``deepspeed_loco/csrc``, and the op builder finds its sources and header in the installed package."""
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


def test_wheel_installed_elsewhere_has_every_kernel_source_and_the_builder_finds_them(source_tree, tmp_path):
    wheels, target, elsewhere = tmp_path / "wheels", tmp_path / "site", tmp_path / "cwd"
    elsewhere.mkdir()
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels), "."],
         source_tree)
    (wheel, ) = wheels.glob("deepspeed_loco-*.whl")
    assert set(_kernel_files()) <= set(zipfile.ZipFile(wheel).namelist())
    _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)], elsewhere)
    probe = ("import json, os, deepspeed_loco\n"
             "from deepspeed_loco.ops.op_builder.loco import LocoBuilder\n"
             "b = LocoBuilder()\n"
             "print(json.dumps({'package': deepspeed_loco.__file__, 'sources': b.sources(),"
             " 'includes': b.include_paths()}))\n")
    env = dict(os.environ, PYTHONPATH=str(target), DS_ACCELERATOR="cpu")
    found = json.loads(_run([sys.executable, "-c", probe], elsewhere, env).strip().splitlines()[-1])
    assert Path(found["package"]).is_relative_to(target)  # the installed copy, not the checkout
    assert found["sources"] and all(Path(s).is_file() and Path(s).is_relative_to(target) for s in found["sources"])
    for name in _kernel_files():
        assert (target / name).is_file(), name
        if name.endswith((".h", ".cuh")):  # every header is on an include path
            assert any((Path(inc) / Path(name).name).is_file() for inc in found["includes"]), name


def test_sdist_has_every_kernel_source(source_tree, tmp_path):
    _run([sys.executable, "setup.py", "-q", "sdist", "--dist-dir", str(tmp_path)], source_tree)
    (sdist, ) = tmp_path.glob("deepspeed_loco-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    assert set(_kernel_files()) <= names
