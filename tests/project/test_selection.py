"""The fast selection (tests/selection.py) touches every module of liegroup_blr and
experiments: each is used by name in a test file with a test in the selection (imported, or
an attribute of an imported module or package, resolved to the module that defines it), or
imported by a module so used. Imports of a package's ``__init__`` do not count: it imports
its whole package."""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
from pathlib import Path

import pytest

from tests import selection
from tests.project.test_structure import ROOT, package_graph

PACKAGES = ("liegroup_blr", "experiments")


def _ours(name: str | None) -> bool:
    return name is not None and name.partition(".")[0] in PACKAGES


def _module_of(obj: object) -> str | None:
    """The module that defines ``obj`` (a module: itself)."""
    if inspect.ismodule(obj):
        return obj.__name__
    module = getattr(obj, "__module__", None)
    return module if isinstance(module, str) else None


def _load(name: str) -> object | None:
    """The module, or None where it needs what this environment lacks (the peers')."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def named(path: Path) -> set[str]:
    """The modules of the packages that the test file uses by name."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    bound: dict[str, object] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in (a for a in node.names if _ours(a.name)):
                found.add(alias.name)
                name = alias.asname or alias.name.partition(".")[0]
                bound[name] = _load(alias.name if alias.asname else name)
        elif isinstance(node, ast.ImportFrom) and _ours(node.module) and not node.level:
            found.add(node.module)
            module = _load(node.module)
            for alias in node.names:
                obj = getattr(module, alias.name, None)
                if obj is None or inspect.ismodule(obj):  # a submodule, maybe not imported yet
                    obj = _load(f"{node.module}.{alias.name}") or obj
                bound[alias.asname or alias.name] = obj
                found.add(_module_of(obj) or node.module)
    for node in ast.walk(tree):  # attribute chains on the names bound above: lgb.noise.X
        if isinstance(node, ast.Attribute):
            chain = []
            base: ast.expr = node
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in bound:
                obj = bound[base.id]
                for attr in reversed(chain):
                    obj = getattr(obj, attr, None)
                    if obj is None:
                        break
                    found.add(_module_of(obj) or "")
    # modules named in strings: run as commands (-m experiments.runs.train), or imported by a
    # prefix and a name the file lists (f"experiments.benchmarks.{module}", "scale_out")
    strings = {
        n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }
    prefixes = {
        n.values[0].value
        for n in ast.walk(tree)
        if isinstance(n, ast.JoinedStr) and n.values and isinstance(n.values[0], ast.Constant)
    }
    found |= strings | {p + s for p in prefixes if str(p).endswith(".") for s in strings}
    return {m for m in found if _ours(m)}


def uses(module: str, graph: dict[str, set[str]], packages: set[str]) -> set[str]:
    """The modules of the packages that ``module`` uses: the modules it imports at any depth,
    and those defining what it holds at the top (``from .groups import AdditiveGroup`` is
    ``liegroup_blr.groups.additive``)."""
    held = {_module_of(value) for value in getattr(_load(module), "__dict__", {}).values()}
    return (graph[module] - packages) | {m for m in held if m in graph}


def touched(paths: list[Path]) -> set[str]:
    """The modules the files name, and every module those use (but none through a
    package's ``__init__``, which imports its whole package)."""
    graph: dict[str, set[str]] = {}
    for package in PACKAGES:
        graph |= package_graph(ROOT, package)
    packages = {m for m in graph if (ROOT / m.replace(".", "/")).is_dir()}
    reached, todo = set(), [m for p in paths for m in named(p) if m in graph]
    while todo:
        module = todo.pop()
        if module not in reached:
            parts = module.split(".")  # importing a module runs its packages' __init__
            reached |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
            todo += [] if module in packages else sorted(uses(module, graph, packages))
    return reached


def test_the_reach_counts_names_and_their_imports_but_not_a_package_s(tmp_path):
    """The package alone reaches no module; a class named through it reaches its module and
    what that imports."""
    test = tmp_path / "test_x.py"
    test.write_text("import liegroup_blr as lgb\n", encoding="utf-8")
    assert touched([test]) == {"liegroup_blr"}
    test.write_text("import liegroup_blr as lgb\n\nlgb.kl.kl_monte_carlo\n", encoding="utf-8")
    reached = touched([test])
    assert {"liegroup_blr.kl", "liegroup_blr.fisher", "liegroup_blr.groups.base"} <= reached
    assert "liegroup_blr.posterior" not in reached and "liegroup_blr.mc" not in reached


@functools.cache
def _reached() -> set[str]:
    return touched([ROOT / f for f in selection.files()])


@pytest.mark.parametrize("package", PACKAGES)
def test_the_fast_selection_touches_every_module(package):
    modules = {m for m in package_graph(ROOT, package) if m != package}
    assert sorted(modules - _reached()) == []


def test_every_test_listed_slow_exists():
    """The list is regenerated when tests are renamed or removed (tests/selection.py)."""
    gone = [
        f"{path}::{name}"
        for path, names in selection.SLOW.items()
        for name in names
        if not (ROOT / path).is_file() or name not in selection.test_functions(ROOT / path)
    ]
    assert not gone


def test_the_selection_reads_marks_and_leaves_out_what_the_list_names(tmp_path):
    test = tmp_path / "test_x.py"
    test.write_text(
        "import pytest\n\npytestmark = pytest.mark.filterwarnings('ignore')\n\n\n"
        "@pytest.mark.slow\ndef test_a():\n    pass\n\n\n"
        "@pytest.mark.parametrize('x', [1])\n@pytest.mark.compile\ndef test_b(x):\n    pass\n\n\n"
        "class TestC:\n    def test_d(self):\n        pass\n",
        encoding="utf-8",
    )
    assert selection.test_functions(test) == {
        "test_a": {"filterwarnings", "slow"},
        "test_b": {"filterwarnings", "parametrize", "compile"},
        "TestC::test_d": {"filterwarnings"},
    }
    path, names = next(iter(selection.SLOW.items()))
    assert selection.is_listed(f"{path}::{names[0]}[x-1]")
    assert not selection.is_listed(f"{path}::test_not_listed")
