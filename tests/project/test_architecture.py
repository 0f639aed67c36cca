"""docs/architecture.md's floor tables are the import tree of the code: every module and
folder listed once, on the floor its imports put it, and nothing listed that does not exist.

A table is found by its header, ``| floor | module in `FOLDER` | holds |``; a row gives one
floor and the modules on it, each in backticks (``name.py``, or ``name/`` for a folder taken
as one). A failing test prints the table as it should read, the page's words kept: paste it
over the old one and describe the rows marked TODO."""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest

from tests.project.test_structure import ROOT, package_graph

PAGE = ROOT / "docs" / "architecture.md"
# the folders with a floor table: (the package whose import graph it is, the folder in it)
SCOPES = {
    "liegroup_blr/": ("liegroup_blr", ""),
    "liegroup_blr/optim/": ("liegroup_blr", "optim"),
    "experiments/": ("experiments", ""),
    "experiments/common/": ("experiments", "common"),
}
HEADER = re.compile(r"^\| floor \| module in `(?P<scope>[^`]+)` \| holds \|$")
TODO = "TODO: what it holds"


def units(package: str, inside: str) -> dict[str, str]:
    """Each module of the folder → the name the page gives it: ``name.py`` for a module of
    the folder itself, ``sub/`` for anything in a subfolder (the folder's own
    ``__init__`` is none of them)."""
    prefix = ".".join(filter(None, (package, inside))) + "."
    named = {}
    for module in package_graph(ROOT, package):
        if not module.startswith(prefix):
            continue
        first, *rest = module[len(prefix) :].split(".")
        folder = (ROOT / package / inside / first).is_dir()
        named[module] = f"{first}/" if rest or folder else f"{first}.py"
    return named


def floors_of(graph: dict[str, set[str]]) -> dict[str, int]:
    """Floor 1 imports nothing of the graph; any other node is one floor above the highest
    it imports."""
    floors: dict[str, int] = {}

    def floor(node: str) -> int:
        if node not in floors:
            floors[node] = 1 + max((floor(w) for w in graph[node]), default=0)
        return floors[node]

    for node in graph:
        floor(node)
    return floors


def code_floors(scope: str) -> dict[str, int]:
    """The floor of each module and folder of ``scope``, from every import in the code (a
    folder taken as one: its modules' imports are its imports)."""
    package, inside = SCOPES[scope]
    named = units(package, inside)
    graph: dict[str, set[str]] = {name: set() for name in named.values()}
    for module, edges in package_graph(ROOT, package).items():
        if module in named:
            graph[named[module]] |= {named[w] for w in edges if w in named} - {named[module]}
    return floors_of(graph)


@dataclass
class Row:
    floor: int
    names: list[str]
    holds: str


def page_tables(text: str) -> dict[str, list[Row]]:
    """The floor tables of a page, by the folder each header names."""
    tables: dict[str, list[Row]] = {}
    lines = text.splitlines()
    for i, line in enumerate(lines):
        match = HEADER.match(line)
        if not match:
            continue
        rows = tables.setdefault(match["scope"], [])
        for row in lines[i + 2 :]:
            if not row.startswith("|"):
                break
            floor, names, holds = (cell.strip() for cell in row.strip("|").split("|", 2))
            rows.append(Row(int(floor), re.findall(r"`([^`]+)`", names), holds))
    return tables


def should_read(scope: str, rows: list[Row], floors: dict[str, int]) -> str:
    """The table as the code says it should be: the page's rows split where their modules
    now sit on different floors, in floor order, the modules that are gone left out and the
    new ones added with a TODO."""
    fixed: list[Row] = []
    for row in rows:
        for floor in sorted({floors[n] for n in row.names if n in floors}):
            fixed.append(Row(floor, [n for n in row.names if floors.get(n) == floor], row.holds))
    listed = {n for row in rows for n in row.names}
    fixed += [Row(f, [n], TODO) for n, f in sorted(floors.items()) if n not in listed]
    fixed.sort(key=lambda row: row.floor)  # stable: the page's order within a floor
    lines = [f"| floor | module in `{scope}` | holds |", "|---:|---|---|"]
    lines += [
        f"| {row.floor} | {', '.join(f'`{n}`' for n in row.names)} | {row.holds} |" for row in fixed
    ]
    return "\n".join(lines)


def test_the_floors_are_one_above_the_highest_import():
    graph = {"a": set(), "b": {"a"}, "c": {"a", "b"}, "d": {"a"}, "e": set()}
    assert floors_of(graph) == {"a": 1, "b": 2, "c": 3, "d": 2, "e": 1}


def test_a_table_is_read_and_rewritten_from_the_code():
    text = (
        "Intro\n\n| floor | module in `pkg/` | holds |\n|---:|---|---|\n"
        "| 1 | `a.py`, `b/` | the ground |\n| 2 | `c.py` | gone |\n\nMore text\n"
    )
    rows = page_tables(text)["pkg/"]
    assert rows == [Row(1, ["a.py", "b/"], "the ground"), Row(2, ["c.py"], "gone")]
    assert should_read("pkg/", rows, {"a.py": 1, "b/": 2, "d.py": 1}).splitlines()[2:] == [
        "| 1 | `a.py` | the ground |",
        f"| 1 | `d.py` | {TODO} |",
        "| 2 | `b/` | the ground |",
    ]


def test_the_page_has_one_floor_table_per_folder():
    assert sorted(page_tables(PAGE.read_text(encoding="utf-8"))) == sorted(SCOPES)


@pytest.mark.parametrize("scope", SCOPES)
def test_each_module_is_listed_once_on_its_floor(scope):
    rows = page_tables(PAGE.read_text(encoding="utf-8")).get(scope, [])
    listed = [n for row in rows for n in row.names]
    on_page = {n: row.floor for row in rows for n in row.names}
    floors = code_floors(scope)
    in_order = [row.floor for row in rows] == sorted(row.floor for row in rows)
    assert on_page == floors and len(listed) == len(set(listed)) and in_order, (
        f"{PAGE.relative_to(ROOT)}: the table of `{scope}` should read\n\n"
        + should_read(scope, rows, floors)
    )


def test_a_folder_taken_as_one_names_each_of_its_modules():
    """``groups/``, ``integrations/``, ``experiments/benchmarks/``: each module in the folder
    is named (in backticks) in the folder's row, unless the folder has a table of its own."""
    tables = page_tables(PAGE.read_text(encoding="utf-8"))
    unnamed = []
    for scope, rows in tables.items():
        for row in rows:
            for folder in (n for n in row.names if n.endswith("/")):
                if scope + folder in tables:
                    continue
                named = set(re.findall(r"`([^`]+)`", row.holds))
                modules = sorted((ROOT / scope / folder).glob("*.py"))
                unnamed += [
                    f"{scope}{folder}{path.name}"
                    for path in modules
                    if path.name != "__init__.py" and path.name not in named
                ]
    assert not unnamed, f"{PAGE.relative_to(ROOT)} does not name {unnamed}"


def test_the_scopes_are_folders():
    for scope in SCOPES:
        assert (ROOT / scope / "__init__.py").is_file(), scope
