"""Every module, attribute, file and import that README.md and docs/*.md name exists in this repository.

What counts as a reference (in inline code and fenced code blocks; nothing is imported, modules are read with ast):

* a dotted name starting with a package of the repository (``deepspeed_loco.simulation.simulate``): its longest
  prefix that is a module, then each further name bound in that module (a function, class, assignment or import,
  followed through ``from ... import`` into the repository's own modules), or in the class it names; a call,
  ``name(...)``, ends the name; quoted strings (logger names, dictionary keys) are not module names;
* a path whose first part is a top-level folder of the repository (``benchmarks/convergence.py``) or of
  ``deepspeed_loco/`` (the docs' short form ``runtime/zero/stage3_hook.py``);
* a bare file name in inline code (``quantizer.py``): a file of that name somewhere in the repository, unless it
  is one of :data:`EXTERNAL_FILES`;
* ``import X`` / ``from X import Y`` lines in code blocks: X and Y as above for the repository's packages, a
  standard-library module, or a distribution that ``setup.py`` declares.

Beyond references: every relative Markdown link of README.md, docs/ and benchmarks/ resolves to a file; the README's
first screen holds the install line and a configuration the library accepts; benchmarks/RESULTS.md stays an index
that links every study file.
"""
import ast
import functools
import re
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md"] + sorted((REPO / "docs").glob("*.md"))
PACKAGES = ("deepspeed_loco", "loco_lab")
LIBRARY = REPO / "deepspeed_loco"
EXTERNAL_FILES = {  # bare file names the docs use for files that are not the repository's
    "train.py": "the user's training script",
    "zero_to_fp32.py": "DeepSpeed's consolidation script in a checkpoint folder",
    "advise.json": "what python -m loco_lab.cli advise writes under --out",
    "pretrain_gpt.py": "Megatron-DeepSpeed's GPT pre-training script (docs/frameworks.md)",
    "run_deepspeed_example.sh": "Megatron-DeepSpeed's example launch script (docs/frameworks.md)",
}
SKIPPED_DIRS = {".git", "__pycache__", "build", "dist"}

_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
_SPAN = re.compile(r"`([^`\n]+)`")
_DOTTED = re.compile(r"(?<![\w./\"'])((?:%s)(?:\.\w+)*)(?![\w\"'])" % "|".join(PACKAGES))
_PATH = re.compile(r"(?<![\w./$<>-])([\w.-]+(?:/[\w.*-]+)+/?)")
_BARE_FILE = re.compile(r"^[\w-]+\.(?:py|sh|cu|cuh|cpp|md|json)$")
_IMPORT = re.compile(r"^[ \t]*(?:from[ \t]+([\w.]+)[ \t]+import[ \t]+([\w \t,]+?)"  # from X import Y, Z
                     r"|import[ \t]+([\w.]+)(?:[ \t]+as[ \t]+\w+)?)[ \t]*(?:#.*)?$", re.MULTILINE)  # import X [as Y]


# ------------------------------------------------------------------------------------------ the documents
def _code(text: str) -> Tuple[List[str], List[str]]:
    """``(blocks, spans)``: the fenced code blocks of a Markdown text and its inline code outside them."""
    blocks = _FENCE.findall(text)
    return blocks, _SPAN.findall(_FENCE.sub("", text))


@functools.lru_cache(maxsize=None)
def _references() -> Dict[str, List[Tuple[str, str]]]:
    """``{kind: [(document, reference)]}`` for the kinds ``dotted``, ``path``, ``bare``, ``import``."""
    found = {"dotted": [], "path": [], "bare": [], "import": []}
    for doc in DOCS:
        blocks, spans = _code(doc.read_text())
        for code in blocks + spans:
            found["dotted"] += [(doc.name, m) for m in _DOTTED.findall(code)]
            found["path"] += [(doc.name, m) for m in _PATH.findall(code)]
        found["bare"] += [(doc.name, s) for s in spans if _BARE_FILE.match(s)]
        for block in blocks:
            for source, names, module in _IMPORT.findall(block):
                found["import"] += ([(doc.name, f"{source}.{n.strip()}") for n in names.split(",")] if source
                                    else [(doc.name, module)])
    return found


# ---------------------------------------------------------------------------------- modules, read with ast
def _module_file(dotted: str) -> Optional[Path]:
    base = REPO.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@functools.lru_cache(maxsize=None)
def _bindings(dotted_module: str) -> Dict[str, ast.AST]:
    """The names a module binds at its top level (inside top-level ``if`` / ``try`` too), each with its node."""
    tree = ast.parse(_module_file(dotted_module).read_text())
    return _scope_bindings(tree.body)


def _scope_bindings(body: List[ast.stmt]) -> Dict[str, ast.AST]:
    names: Dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        names[name.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names[alias.asname or alias.name.split(".")[0]] = node
        elif isinstance(node, (ast.If, ast.Try)):
            for part in (node.body, node.orelse, *(h.body for h in getattr(node, "handlers", [])),
                         getattr(node, "finalbody", [])):
                names.update(_scope_bindings(part))
    return names


def _source_module(module: str, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` inside ``module`` reads from."""
    if not node.level:
        return node.module
    package = module.split(".") if _module_file(module).name == "__init__.py" else module.split(".")[:-1]
    base = package[:len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _resolves(dotted: str) -> bool:
    """Whether ``dotted`` names a module of the repository, or a name bound in one (see the module docstring)."""
    parts = dotted.split(".")
    k = next((k for k in range(len(parts), 0, -1) if _module_file(".".join(parts[:k]))), 0)
    if not k:
        return False
    module, rest = ".".join(parts[:k]), parts[k:]
    if not rest:
        return True
    node = _bindings(module).get(rest[0])
    if node is None:
        return False
    if isinstance(node, ast.ImportFrom):
        source = _source_module(module, node)
        original = next(a.name for a in node.names if (a.asname or a.name) == rest[0])
        return not source.startswith(PACKAGES) or _resolves(".".join([source, original] + rest[1:]))
    if isinstance(node, ast.ClassDef) and len(rest) > 1:
        return rest[1] in _scope_bindings(node.body)
    return True  # a function, a value or a plain import: what lies beyond it is not followed


# ------------------------------------------------------------------------------------------ files, setup.py
def _path_exists(path: str) -> bool:
    """A repository path, from the root or from ``deepspeed_loco/``; ``*`` is a glob."""
    for base in (REPO, LIBRARY):
        if ("*" in path and any(base.glob(path))) or (base / path).exists():
            return True
    return False


def _rooted(path: str) -> bool:
    """Whether ``path`` starts at a folder of the repository's root or of ``deepspeed_loco/``."""
    first = path.split("/")[0]
    return (REPO / first).is_dir() or (LIBRARY / first).is_dir()


@functools.lru_cache(maxsize=None)
def _repository_file_names() -> frozenset:
    names = set()
    for path in REPO.rglob("*"):
        if path.is_file() and not SKIPPED_DIRS & set(path.relative_to(REPO).parts):
            names.add(path.name)
    return frozenset(names)


@functools.lru_cache(maxsize=None)
def _declared_distributions() -> frozenset:
    """The distribution names in ``setup.py``'s ``install_requires`` and ``extras_require``, normalised."""
    setup_call = next(n for n in ast.walk(ast.parse((REPO / "setup.py").read_text()))
                      if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    requirements = []
    for keyword in setup_call.keywords:
        if keyword.arg in ("install_requires", "extras_require"):
            requirements += [c.value for c in ast.walk(keyword.value)
                             if isinstance(c, ast.Constant) and isinstance(c.value, str)]
    return frozenset(re.match(r"[\w.-]+", r).group().lower().replace("-", "_") for r in requirements)


def _importable(dotted: str) -> bool:
    top = dotted.split(".")[0]
    if top in PACKAGES:
        return _resolves(dotted)
    return top in sys.stdlib_module_names or top.lower() in _declared_distributions()


# ---------------------------------------------------------------------------------------------------- tests
def _missing(kind: str, exists) -> List[str]:
    refs = _references()[kind]
    assert refs, f"no {kind} references found: the parser no longer reads the docs"
    return sorted({f"{doc}: {ref}" for doc, ref in refs if not exists(ref)})


def test_every_dotted_name_resolves_to_a_module_or_a_name_defined_in_it():
    assert _missing("dotted", _resolves) == []


def test_every_repository_path_exists():
    assert _missing("path", lambda p: not _rooted(p) or _path_exists(p)) == []


def test_every_bare_file_name_is_a_repository_file_or_a_known_external_one():
    assert _missing("bare", lambda name: name in EXTERNAL_FILES or name in _repository_file_names()) == []


def test_every_import_in_a_code_block_exists_or_is_declared():
    assert _missing("import", _importable) == []


def test_the_resolver_catches_what_does_not_exist():
    assert _resolves("deepspeed_loco.simulation.simulate") and _resolves("deepspeed_loco.layout.HopArgs")
    assert not _resolves("deepspeed_loco.simulation.simulated")  # a name after the module is checked too
    assert not _resolves("deepspeed_loco.runtime.comm.wire")
    assert _path_exists("runtime/zero/stage3_hook.py") and not _path_exists("runtime/comm/wire.py")
    assert _rooted("runtime/comm/wire.py") and not _rooted("$OUT/runs.jsonl")
    assert _importable("torch") and _importable("json") and not _importable("numpyy")
    blocks, spans = _code("a `x.py` b\n```\nfrom deepspeed_loco import initialize\n```\n")
    assert spans == ["x.py"] and blocks == ["from deepspeed_loco import initialize\n"]


# ------------------------------------------------------------------------------ links and the documents' shape
FIRST_SCREEN_LINES = 40
RESULTS_INDEX = REPO / "benchmarks" / "RESULTS.md"
RESULTS_INDEX_MAX_LINES = 300
_LINK = re.compile(r"\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)
_UNDEFINED_ON_FIRST_SCREEN = ("rho", "mid-rise", "midrise", "burst", "the map")


def _markdown_files() -> List[Path]:
    return DOCS + sorted((REPO / "benchmarks").rglob("*.md"))


def _relative_links(text: str) -> List[str]:
    """The relative link targets of a Markdown text outside code, without their ``#anchor``."""
    prose = _SPAN.sub("", _FENCE.sub("", text))
    targets = [m.split("#")[0] for m in _LINK.findall(prose)]
    return [t for t in targets if t and not re.match(r"^[a-z]+:", t)]


def test_every_relative_link_resolves():
    broken = [f"{doc.relative_to(REPO)}: {target}" for doc in _markdown_files()
              for target in _relative_links(doc.read_text()) if not (doc.parent / target).exists()]
    assert broken == []


def test_the_link_checker_finds_links_and_ignores_code():
    text = "see [a](x/a.md#top) and ![p](p.png), [w](https://e.org)\n`[c](code.md)`\n```\n[d](block.md)\n```\n"
    assert _relative_links(text) == ["x/a.md", "p.png"]


def _first_screen() -> str:
    return "\n".join((REPO / "README.md").read_text().split("\n")[:FIRST_SCREEN_LINES])


def _readme_loco_block() -> dict:
    """The ``zeropp_loco_param`` block of the README's first-screen configuration (a dict)."""
    configs = [block for block in _FENCE.findall(_first_screen() + "\n") if "zeropp_loco_param" in block]
    call = next(n for n in ast.walk(ast.parse(configs[0])) if isinstance(n, ast.Call))
    return ast.literal_eval(next(k.value for k in call.keywords if k.arg == "config"))["zero_optimization"][
        "zeropp_loco_param"]


@pytest.mark.parametrize("params", [1_000_000, 10_818_432, 116_000_000, 7_000_000_000])
def test_the_start_up_note_has_nothing_to_say_against_the_readme_example(params):
    """Issue 39 goal (c): the configuration the README recommends is what the start-up note recommends, at every
    model size, on 16 ranks of 8 per node (the note speaks only where the map disagrees with a run's setting)."""
    from deepspeed_loco.config import LocoConfig
    from deepspeed_loco.layout.hop_plan import plan_hops
    from deepspeed_loco.runtime.zero.regime_note import regime_note
    config = LocoConfig.from_dict(_readme_loco_block())
    assert regime_note(plan_hops(16, 8, config), config.error_feedback, params) is None


def test_readme_first_screen_has_the_install_line_and_an_accepted_configuration():
    from deepspeed_loco.config import LocoConfig
    screen = _first_screen()
    blocks = _FENCE.findall(screen + "\n")
    assert any(line.startswith("pip install") for block in blocks for line in block.splitlines())
    configs = [block for block in blocks if "zeropp_loco_param" in block]
    assert len(configs) == 1, "the first screen shows exactly one configuration"
    call = next(n for n in ast.walk(ast.parse(configs[0])) if isinstance(n, ast.Call))
    config = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "config"))
    zero = config["zero_optimization"]
    assert zero["stage"] == 3 and zero["zero_quantized_gradients"] is True
    LocoConfig.from_dict(zero["zeropp_loco_param"])  # raises on a key or value the library rejects


def test_readme_first_screen_uses_no_term_it_does_not_define():
    screen = _first_screen().lower()
    assert [term for term in _UNDEFINED_ON_FIRST_SCREEN if re.search(r"\b%s\b" % term, screen)] == []


def test_results_is_a_short_index_that_links_every_study():
    text = RESULTS_INDEX.read_text()
    assert len(text.splitlines()) <= RESULTS_INDEX_MAX_LINES
    linked = {(RESULTS_INDEX.parent / target).resolve() for target in _relative_links(text)}
    studies = set((REPO / "benchmarks" / "results").glob("*/README.md")) | {REPO / "benchmarks/results/HISTORY.md"}
    assert sorted(str(s.relative_to(REPO)) for s in studies if s.resolve() not in linked) == []
