# Sphinx configuration of the captum_normattr docs (built by tests/test_docs.py with -W).
import os
import sys

sys.path.insert(0, os.path.abspath(".."))

project = "captum_normattr"
author = "captum_normattr contributors"
copyright = "captum_normattr contributors"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build"]

myst_enable_extensions = ["dollarmath"]
myst_heading_anchors = 3
suppress_warnings = ["myst.xref_missing", "myst.header"]

napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
autodoc_typehints = "none"
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": False}
autodoc_mock_imports = ["matplotlib"]

html_theme = "alabaster"
html_title = "captum_normattr"

napoleon_use_ivar = True  # dataclass "Attributes:" as fields, not duplicate object descriptions


def _escape_bars(app, what, name, obj, options, lines):
    r"""Docstrings write absolute values and norms as |x|, which reST reads as substitutions."""
    for k, line in enumerate(lines):
        if "|" in line and not line.lstrip().startswith(("|", "+")):
            lines[k] = line.replace("\\|", "|").replace("|", "\\|")


def setup(app):
    app.connect("autodoc-process-docstring", _escape_bars)
