"""The built sdist and wheel hold what a user needs, and the wheel nothing else.

    python .ci/check_dists.py DIST_DIR      (from the checkout's root)

The wheel holds the package exactly as it is in the checkout (every file of liegroup_blr/,
``py.typed`` among them), the license, and metadata of the checkout's version; nothing from
tests/ or experiments/; its classifiers are current PyPI classifiers. The sdist holds the same
package files, the license, the README, pyproject.toml, the changelog and the citation file.
"""

from __future__ import annotations

import ast
import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

from trove_classifiers import classifiers as known_classifiers
from trove_classifiers import deprecated_classifiers

PACKAGE = Path("liegroup_blr")


def fail(message: str) -> None:
    sys.exit(f"check_dists: {message}")


def checkout_version() -> str:
    """``__version__`` as written in liegroup_blr/__init__.py (the one place it is written)."""
    for node in ast.parse((PACKAGE / "__init__.py").read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets
        ):
            return str(ast.literal_eval(node.value))
    fail("liegroup_blr/__init__.py does not set __version__")
    raise AssertionError  # unreachable: fail exits


def package_files() -> set[str]:
    """Every file of the package in the checkout (bytecode caches aside)."""
    files = {
        p.as_posix()
        for p in PACKAGE.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    }
    if f"{PACKAGE}/py.typed" not in files:
        fail("liegroup_blr/py.typed is missing from the checkout")
    return files


def only(paths: list[Path], pattern: str) -> Path:
    if len(paths) != 1:
        fail(f"expected one {pattern} in the dist folder, found {[p.name for p in paths]}")
    return paths[0]


def check_wheel(wheel: Path, version: str, package: set[str]) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        dist_info = f"liegroup_blr-{version}.dist-info"
        metadata = Parser().parsestr(archive.read(f"{dist_info}/METADATA").decode())
    stray = sorted(n for n in names if n.split("/")[0] in ("tests", "experiments", "docs"))
    if stray:
        fail(f"{wheel.name} holds files from outside the library: {stray}")
    library = {n for n in names if not n.startswith(f"{dist_info}/")}
    if library != package:
        fail(
            f"{wheel.name}: the package differs from the checkout's liegroup_blr/: "
            f"missing {sorted(package - library)}, extra {sorted(library - package)}"
        )
    if f"{dist_info}/licenses/LICENSE" not in names:
        fail(f"{wheel.name} has no {dist_info}/licenses/LICENSE")
    expected = {"Name": "liegroup_blr", "Version": version, "License-Expression": "MIT"}
    for field, value in expected.items():
        if metadata[field] != value:
            fail(f"{wheel.name}: METADATA {field} is {metadata[field]!r}, expected {value!r}")
    classifiers = metadata.get_all("Classifier", [])
    unknown = [c for c in classifiers if c not in known_classifiers or c in deprecated_classifiers]
    if unknown:
        fail(f"{wheel.name}: unknown or deprecated classifiers {unknown}")
    if "Typing :: Typed" not in classifiers:
        fail(f"{wheel.name}: METADATA lacks the classifier 'Typing :: Typed'")


def check_sdist(sdist: Path, version: str, package: set[str]) -> None:
    root = f"liegroup_blr-{version}"
    with tarfile.open(sdist) as archive:
        names = {n.removeprefix(f"{root}/") for n in archive.getnames()}
    needed = package | {"LICENSE", "README.md", "pyproject.toml", "CHANGELOG.md", "CITATION.cff"}
    missing = sorted(needed - names)
    if missing:
        fail(f"{sdist.name} lacks {missing}")


def main() -> None:
    dist = Path(sys.argv[1])
    version = checkout_version()
    package = package_files()
    wheel = only(sorted(dist.glob("*.whl")), "wheel")
    sdist = only(sorted(dist.glob("*.tar.gz")), "sdist")
    for built in (wheel, sdist):
        if not built.name.startswith(f"liegroup_blr-{version}"):
            fail(f"{built.name} is not version {version} (liegroup_blr.__version__)")
    check_wheel(wheel, version, package)
    check_sdist(sdist, version, package)
    print(f"check_dists: {wheel.name} and {sdist.name} hold what they should")


if __name__ == "__main__":
    main()
