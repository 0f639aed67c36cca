"""The documentation: its examples run, and every public name has a docstring and an entry.

Every ```python block of a Markdown page under docs/ is executed, in order and in one
namespace per page, so the tutorials cannot rot. The Sphinx build itself (warnings are
errors, broken cross-references included) runs in CI as
``sphinx-build -W --keep-going -q -b html docs docs/_build/html``.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pytest
import torch

import liegroup_blr

DOCS = Path(__file__).resolve().parents[2] / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.parts)
FENCE = re.compile(
    r"""
    ^(?P<indent>[ \t]*)(?P<fence>`{3,})python[ \t]*\n   # opening fence: ```python
    (?P<body>.*?)                                       # the code
    ^(?P=indent)(?P=fence)[ \t]*$                       # the matching closing fence
    """,
    re.S | re.M | re.X,
)


def python_blocks(page: Path) -> list[tuple[int, str]]:
    """The ```python blocks of a Markdown page with the line number of their first line."""
    text = page.read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start("body")) + 1, m["body"]) for m in FENCE.finditer(text)]


DEPRECATED_MODULES = {"liegroup_blr.memory": "liegroup_blr.memory_maps"}
"""Old module names kept for one release, each re-exporting its new module's names with a
DeprecationWarning on import: documented under the new name, and not imported here."""


def public_modules() -> list[str]:
    """liegroup_blr and its public first-level modules (subpackage internals are private;
    deprecated module names are left out)."""
    names = ["liegroup_blr"]
    for info in pkgutil.iter_modules(liegroup_blr.__path__, "liegroup_blr."):
        if info.name in DEPRECATED_MODULES:
            continue
        if not info.name.rsplit(".", 1)[1].startswith("_"):
            names.append(info.name)
    return names


MODULES = public_modules()
PUBLIC = [(m, name) for m in MODULES for name in getattr(importlib.import_module(m), "__all__", [])]
EXAMPLE_PAGES = [p for p in PAGES if python_blocks(p)]


def _page_id(page: Path) -> str:
    return page.relative_to(DOCS).as_posix()


@pytest.fixture
def one_thread():
    """Single-threaded torch: the examples are small and CI runs two workers on two cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def test_the_pages_exist_and_the_tutorial_has_code():
    names = {_page_id(p) for p in PAGES}
    for page in ("index.md", "quickstart.md", "concepts.md", "custom_group.md"):
        assert page in names
    for page in ("hyperparameters.md", "experiments.md"):
        assert page in names
    assert len(python_blocks(DOCS / "custom_group.md")) >= 5


def test_fence_extraction_finds_only_python_blocks():
    page = "text\n```python\nx = 1\n```\n\n```bash\nls\n```\n  ```python\n  y = 2\n  ```\n"
    blocks = [(page.count("\n", 0, m.start("body")) + 1, m["body"]) for m in FENCE.finditer(page)]
    assert blocks == [(3, "x = 1\n"), (10, "  y = 2\n")]


@pytest.mark.parametrize("module", MODULES)
def test_public_module_declares_all(module):
    assert hasattr(importlib.import_module(module), "__all__"), f"{module} has no __all__"


@pytest.mark.parametrize("page", EXAMPLE_PAGES, ids=_page_id)
def test_page_examples_run(page, one_thread, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a reader runs the examples in a folder of their own
    torch.manual_seed(0)
    namespace: dict[str, object] = {"__name__": f"docs_{page.stem}"}
    for line, code in python_blocks(page):
        indent = len(code) - len(code.lstrip(" "))
        code = "\n".join(row[indent:] for row in code.splitlines())
        source = "\n" * (line - 1) + code  # tracebacks show the page's own line numbers
        exec(compile(source, str(page), "exec"), namespace)
    litter = sorted(p.name for p in tmp_path.iterdir())
    assert not litter, f"the examples wrote {litter} into the current folder: name a folder"


def _attribute_docstrings(module: str) -> dict[str, str]:
    """Docstrings written under module-level assignments (``NAME = ...`` then a string)."""
    tree = ast.parse(inspect.getsource(importlib.import_module(module)))
    docs = {}
    for node, after in zip(tree.body, tree.body[1:], strict=False):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign):
            targets = [node.target]
        else:
            continue
        if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            for target in targets:
                if isinstance(target, ast.Name) and isinstance(after.value.value, str):
                    docs[target.id] = after.value.value
    return docs


@pytest.mark.parametrize(("module", "name"), PUBLIC, ids=[f"{m}.{n}" for m, n in PUBLIC])
def test_public_name_has_a_docstring(module, name):
    obj = getattr(importlib.import_module(module), name)
    if inspect.ismodule(obj) or inspect.isclass(obj) or inspect.isroutine(obj):
        doc = obj.__doc__  # its own docstring: classes do not inherit __doc__
    else:
        doc = _attribute_docstrings(module).get(name)
    assert doc and doc.strip(), f"{module}.{name} has no docstring"


def _documented() -> set[str]:
    """Qualified names that the API pages (docs/api/*.rst) document with a directive."""
    directive = re.compile(r"^\.\. (?:auto|py:)?(\w+):: ([\w.]+)", re.M)
    found: set[str] = set()
    for page in sorted((DOCS / "api").glob("*.rst")):
        module = ""
        for kind, target in directive.findall(page.read_text(encoding="utf-8")):
            if kind in ("module", "currentmodule"):
                module = target
                found.add(target)
            else:
                found.add(target if "." in target else f"{module}.{target}")
    return found


@pytest.mark.parametrize(("module", "name"), PUBLIC, ids=[f"{m}.{n}" for m, n in PUBLIC])
def test_public_name_is_in_the_api_reference(module, name):
    obj = getattr(importlib.import_module(module), name)
    names = {f"{module}.{name}"}
    if inspect.ismodule(obj):
        names.add(obj.__name__)
    else:  # a re-export is documented once, under one of the names it is exported as
        names |= {
            f"{m}.{name}" for m in MODULES if getattr(importlib.import_module(m), name, None) is obj
        }
    assert names & _documented(), f"{module}.{name} is missing from docs/api/"


ROOT = DOCS.parent
CITED = ("README.md", "CHANGELOG.md", "docs", "experiments", "liegroup_blr", "tests")


def test_nothing_cites_the_design_notes_outside_the_repository():
    """The design notes are not in the repository: the docs pages hold what is cited."""
    name = "DESIGN" + ".md"  # not spelt out here, or this file would cite it
    files = [ROOT / c for c in CITED if (ROOT / c).is_file()]
    files += [
        p
        for c in CITED
        if (ROOT / c).is_dir()
        for p in (ROOT / c).rglob("*")
        if p.suffix in (".py", ".md", ".toml", ".rst") and "_build" not in p.parts
    ]
    citing = [p.relative_to(ROOT).as_posix() for p in files if name in p.read_text("utf-8")]
    assert len(files) > 50 and not citing, citing


README = ROOT / "README.md"


def _before_first_example(text: str) -> str:
    """The paragraph right before a page's first ```python block."""
    head = text[: text.index("```python")].rstrip()
    return head[head.rfind("\n\n") + 2 :]


@pytest.mark.parametrize("page", [README, DOCS / "index.md"], ids=["README", "index"])
def test_the_first_example_says_which_loop_to_write(page):
    """Right before its first example the page names both loops: a closure, or
    ``between_steps="sample"`` for the plain ``loss.backward(); optimizer.step()``."""
    said = " ".join(_before_first_example(page.read_text(encoding="utf-8")).split())
    assert "step(closure)" in said and 'between_steps="sample"' in said, said
    assert "loss.backward();" in said and "drop-in" not in page.read_text(encoding="utf-8")


def test_the_plain_loop_needs_between_steps_sample():
    """What the README and the index say: ``loss.backward(); opt.step()`` stops by default
    with a message naming the option, and trains with it."""
    torch.manual_seed(0)
    x, y = torch.randn(64, 4), torch.randint(0, 3, (64,))
    model = torch.nn.Linear(4, 3)
    opt = liegroup_blr.AffineBLR(model.parameters(), lr=0.5, scale_lr=0.05, data_size=64)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match="between_steps='sample'"):
        opt.step()
    opt = liegroup_blr.AffineBLR(
        model.parameters(), lr=0.5, scale_lr=0.05, data_size=64, between_steps="sample"
    )
    losses = []
    for _ in range(20):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0]


def test_the_readme_says_what_it_is_then_gives_its_two_commands():
    """Two lines of what the library is, then the main job's command and, after "Run the
    tests:" and a blank line (what .ci/run reads), the test command."""
    lines = README.read_text(encoding="utf-8").splitlines()
    assert lines[0] == "# liegroup_blr" and lines[1] == lines[4] == ""
    assert "PyTorch optimizers" in lines[2] and "](docs/index.md)" in lines[3]
    commands = [line.strip() for line in lines if line.startswith("    python3 -m venv")]
    assert commands[0].endswith("-m experiments.runs.compare experiments/configs/cpu_default.toml")
    at = lines.index("Run the tests:")
    assert lines[at + 1] == "" and lines[at + 2].strip() == commands[1]
    assert commands[1].endswith(".venv/bin/python -m pytest -n 2")


def test_the_readme_links_the_pages_it_mentions_and_times_the_job_once():
    """Above its Benchmarks: no page named by title alone ("the documentation's ..."), every
    relative link to an existing page, and one time for the main job."""
    top = README.read_text(encoding="utf-8").split("## Benchmarks")[0]
    assert "documentation's" not in top
    links = re.findall(r"\]\((docs/[\w/]+\.md)\)", top)
    assert len(links) >= 8 and all((ROOT / link).is_file() for link in links), links
    assert len(re.findall(r"\b\d+\s+min(?:utes)?\b", top)) == 1
