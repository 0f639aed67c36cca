"""The release files: the version written once, the license, the changelog, the citation file.

The built sdist and wheel themselves are checked in CI by ``.ci/check_release`` (built,
installed into a fresh environment and used from outside the checkout); CITATION.cff is
also validated there against the CFF 1.2.0 schema by ``cffconvert --validate``.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
from pathlib import Path

import yaml

import liegroup_blr

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
CITATION = yaml.safe_load((ROOT / "CITATION.cff").read_text(encoding="utf-8"))


def test_the_version_is_written_once_and_the_metadata_reads_it():
    project = PYPROJECT["project"]
    assert "version" not in project and "version" in project["dynamic"]
    dynamic = PYPROJECT["tool"]["setuptools"]["dynamic"]["version"]
    assert dynamic == {"attr": "liegroup_blr.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", liegroup_blr.__version__)
    # The installed distribution's metadata (editable here) carries the same version.
    assert importlib.metadata.version("liegroup_blr") == liegroup_blr.__version__


def test_license_and_type_marker_ship():
    assert PYPROJECT["project"]["license"] == "MIT"
    assert PYPROJECT["project"]["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert text.startswith("MIT License") and "The liegroup_blr developers" in text
    assert (Path(liegroup_blr.__file__).parent / "py.typed").is_file()
    assert PYPROJECT["tool"]["setuptools"]["package-data"]["liegroup_blr"] == ["py.typed"]
    assert "Typing :: Typed" in PYPROJECT["project"]["classifiers"]


def test_changelog_has_unreleased_and_the_current_version():
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    headings = re.findall(r"^## (.+)$", text, re.M)
    assert headings[0] == "[Unreleased]"
    version = re.escape(liegroup_blr.__version__)
    assert any(re.fullmatch(rf"\[{version}\] - \d{{4}}-\d{{2}}-\d{{2}}", h) for h in headings)


def test_citation_file_has_the_required_keys_and_cites_the_paper():
    for key in ("cff-version", "message", "title", "authors"):  # required by CFF 1.2.0
        assert CITATION[key], key
    assert CITATION["cff-version"] == "1.2.0"
    assert CITATION["type"] == "software"
    assert CITATION["version"] == liegroup_blr.__version__
    assert CITATION["license"] == PYPROJECT["project"]["license"]
    paper = CITATION["preferred-citation"]
    assert paper["type"] == "conference-paper"
    assert paper["title"] == "The Lie-Group Bayesian Learning Rule"
    assert [a["family-names"] for a in paper["authors"]] == ["Kıral", "Möllenhoff", "Khan"]
    assert paper["year"] == 2023
    assert "AISTATS 2023" in paper["conference"]["name"]
    assert {i["value"] for i in paper["identifiers"]} == {
        "arXiv:2303.04397",
        "10.48550/arXiv.2303.04397",
    }
