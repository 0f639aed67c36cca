"""Sphinx configuration for the liegroup_blr documentation.

Build (warnings fail, as in CI)::

    sphinx-build -W --keep-going -q -b html docs docs/_build/html
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout, also when the package is not installed

import liegroup_blr  # noqa: E402

project = "liegroup_blr"
author = "The liegroup_blr developers"
copyright = "2026, The liegroup_blr developers"
release = liegroup_blr.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx-mathjax-offline",  # MathJax 3 from the package into _static/mathjax: no CDN
    "myst_parser",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
templates_path: list[str] = []

# --- Markdown (MyST): $...$ / $$...$$ math, \begin{align} blocks, heading anchors.
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist"]
myst_heading_anchors = 3
myst_dmath_double_inline = True

# --- autodoc + napoleon: Google-style "Args:" sections, reST math in docstrings.
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented_params"
autodoc_preserve_defaults = True
autodoc_inherit_docstrings = False
autodoc_type_aliases = {
    "Shape": "liegroup_blr.groups.base.Shape",
    "Preconditioner": "liegroup_blr.optim.generic.Preconditioner",
}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

# --- Every cross-reference must resolve (nitpicky), except types of libraries that the site
# does not document itself: intersphinx needs the network, which CI does not have.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|geoopt|numpy|np|abc|typing|collections|contextlib)(\..*)?"),
    (r"py:.*", r"(lightning|transformers|accelerate)(\..*)?"),  # the integrations' extras
    (r"py:.*", r"(Tensor|Distribution|Optimizer|Generator|Module|Iterable|Iterator|Callable)"),
    (r"py:.*", r"(Sequence|Any|AbstractContextManager|Constraint)"),
    (r"py:.*", r"(liegroup_blr\.groups\.base\.)?Shape"),  # type aliases of signatures
    (r"py:.*", r"(liegroup_blr\.optim\.generic\.)?Preconditioner"),
    (r"py:.*", r"liegroup_blr\.posterior_io\.E"),  # a type variable of a signature
    (r"py:.*", r"(liegroup_blr\.optim\.base\.)?Loss"),  # step()'s type variable
    (r"py:.*", r"(liegroup_blr\.optim\.writes\.)?Method"),  # adopts_writes' type variable
    (r"py:.*", r"(liegroup_blr\.optim\.(engine|holding)\.)?(Stepped|Holding)"),  # protocols
    (r"py:(class|exc|obj|data)", r"(int|float|str|bool|bytes|dict|list|tuple|object|None)"),
    (r"py:(class|exc|obj)", r"(ValueError|RuntimeError|RuntimeWarning|NotImplementedError)"),
]

# --- HTML (furo).
html_theme = "furo"
html_title = f"liegroup_blr {release}"
html_theme_options = {"navigation_with_keys": True}
