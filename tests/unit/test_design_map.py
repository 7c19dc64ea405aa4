"""docs/design.md against the code: its import layers ("Import layers": every module of the package named once, and
no module imports one of a layer above its own, counting imports inside functions too), no import cycle, and the
package's ``__all__`` (its public functions and ``__version__``, nothing it merely imports)."""
import ast
import inspect
import re
from pathlib import Path
from typing import Dict, List, Set

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "deepspeed_loco"
DESIGN = ROOT / "docs" / "design.md"


def modules() -> Dict[str, Path]:
    """Every module of the package by its path relative to ``deepspeed_loco/`` (``ops/library.py``)."""
    return {path.relative_to(PACKAGE).as_posix(): path for path in sorted(PACKAGE.rglob("*.py"))}


def layers() -> List[List[str]]:
    """The module paths of each layer of docs/design.md's "Import layers", top first."""
    text = DESIGN.read_text()
    section = text.split("### Import layers", 1)[1].split("\n#", 1)[0]
    items = re.findall(r"^(\d+)\. (.*(?:\n   .*)*)", section, re.M)
    assert [int(number) for number, _ in items] == list(range(1, len(items) + 1)), "layers numbered 1, 2, ..."
    out = []
    for _, body in items:
        paths = []
        for segment in " ".join(body.split()).split(";"):
            folder, _, names = segment.strip().rpartition(":")
            prefix = folder.strip().strip("`") if folder else ""
            paths += [prefix + name for name in re.findall(r"`([^`]+)`", names)]
        out.append(paths)
    return out


def _module_name(path: str) -> str:
    dotted = "deepspeed_loco." + path[:-3].replace("/", ".")
    return dotted[:-len(".__init__")] if dotted.endswith(".__init__") else dotted


def imports(path: str, names: Set[str]) -> Set[str]:
    """The package's modules that module ``path`` imports, anywhere in it (``from a import b`` counts ``a.b`` when
    that is a module, else ``a``), itself left out."""
    own = _module_name(path)
    package = own if path.endswith("__init__.py") else own.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse((PACKAGE / path).read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            found |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in names else base for alias in node.names}
    return {name for name in found if name in names and name != own}


def test_every_module_is_named_once_in_the_import_layers():
    named = [path for layer in layers() for path in layer]
    assert sorted(set(named)) == sorted(named), f"named twice: {sorted(p for p in set(named) if named.count(p) > 1)}"
    assert sorted(named) == sorted(modules()), (f"not in docs/design.md: {sorted(set(modules()) - set(named))}; "
                                                f"named but missing: {sorted(set(named) - set(modules()))}")


def test_no_module_imports_one_the_document_places_above_it():
    layer_of = {_module_name(path): i for i, layer in enumerate(layers()) for path in layer}
    upward = [f"{_module_name(path)} (layer {layer_of[_module_name(path)] + 1}) imports {target} (layer "
              f"{layer_of[target] + 1})" for path in modules()
              for target in sorted(imports(path, set(layer_of))) if layer_of[target] < layer_of[_module_name(path)]]
    assert not upward, "\n".join(upward)


def test_the_package_has_no_import_cycle():
    names = {_module_name(path): path for path in modules()}
    graph = {name: imports(path, set(names)) for name, path in names.items()}
    done, stack = set(), []

    def visit(name):
        if name in stack:
            raise AssertionError(f"import cycle: {' -> '.join(stack[stack.index(name):] + [name])}")
        if name not in done:
            stack.append(name)
            for target in sorted(graph[name]):
                visit(target)
            stack.pop()
            done.add(name)

    for name in sorted(graph):
        visit(name)


def test_the_layer_check_sees_an_upward_import():
    """The parser of imports finds a module-level and a function-level import of a package module (the check above
    cannot pass by reading nothing)."""
    names = {_module_name(path) for path in modules()}
    assert "deepspeed_loco.config" in imports("utils/turn_on_hint.py", names)  # inside a function
    assert "deepspeed_loco.ops.library" in imports("ops/__init__.py", names)
    assert "deepspeed_loco.runtime.comm.noise_stats" in imports("simulation/cluster.py", names)  # from pkg import mod


def test_all_names_the_public_api_only():
    import deepspeed_loco
    public = {name for name, value in vars(deepspeed_loco).items() if inspect.isfunction(value)
              and value.__module__ == "deepspeed_loco" and not name.startswith("_")}
    assert set(deepspeed_loco.__all__) == public | {"__version__"}
    assert len(deepspeed_loco.__all__) == len(set(deepspeed_loco.__all__))
