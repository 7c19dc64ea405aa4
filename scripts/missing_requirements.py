"""Prints, one a line, the requirements of this checkout (setup.py's ``install_requires`` and the extras named in the
first argument, a comma list) that the running Python does not satisfy; nothing when all are.

    python3 scripts/missing_requirements.py test,demo,hf

setup.py is read, not run: its ``install_requires`` and ``extras_require`` are literals. deepspeed-loco itself is
never printed, whatever is installed: the scripts run the checkout's code. Versions are compared by ``packaging``,
or, in a fresh environment without it, by the copy pip carries.
"""
import ast
import os
import re
import sys
from importlib import metadata

SETUP = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "setup.py")


def declared(extras):
    """setup.py's core requirements, then those of each extra in ``extras`` (in that order, each once)."""
    with open(SETUP) as f:
        tree = ast.parse(f.read(), SETUP)
    call = next(node for node in ast.walk(tree)
                if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setup")
    keywords = {k.arg: ast.literal_eval(k.value) for k in call.keywords
                if k.arg in ("install_requires", "extras_require")}
    unknown = sorted(set(extras) - set(keywords["extras_require"]))
    if unknown:
        raise SystemExit(f"missing_requirements.py: no extra {unknown} in setup.py (extras: "
                         f"{sorted(keywords['extras_require'])})")
    wanted = list(keywords["install_requires"])
    for extra in extras:
        wanted += [r for r in keywords["extras_require"][extra] if r not in wanted]
    return wanted


def satisfied(requirement: str) -> bool:
    """The requirement's distribution is installed at a version it admits."""
    name = re.match(r"[A-Za-z0-9._-]+", requirement).group(0)
    try:
        installed = metadata.version(name)
    except metadata.PackageNotFoundError:
        return False
    try:
        from packaging.requirements import Requirement
    except ImportError:  # a fresh environment: the copy pip carries (pip installs whatever this prints)
        from pip._vendor.packaging.requirements import Requirement
    return Requirement(requirement).specifier.contains(installed, prereleases=True)


def main(argv):
    extras = [e for e in (argv[0] if argv else "").split(",") if e]
    for requirement in declared(extras):
        if not satisfied(requirement):
            print(requirement)


if __name__ == "__main__":
    main(sys.argv[1:])
