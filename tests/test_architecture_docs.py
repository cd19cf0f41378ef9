r"""docs/architectures.md's tables are the registry's (no hand-kept list of families)."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from captum_normattr.arch import architecture_table_markdown
from captum_normattr.arch.registry import refused_table_markdown

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "architectures.md"


@pytest.mark.parametrize("name,render", [("architecture", architecture_table_markdown), ("refused", refused_table_markdown)])
def test_architecture_docs_tables_are_the_generated_ones(name, render):
    text = DOC.read_text(encoding="utf-8")
    found = re.search(rf"<!-- {name} table:[^\n]*-->\n(.*?)\n<!-- end of {name} table -->", text, re.S)
    assert found, f"docs/architectures.md lost its {name}-table markers"
    expected = render()
    if os.environ.get("UPDATE_DOCS") == "1":  # UPDATE_DOCS=1 python -m pytest tests/test_architecture_docs.py
        DOC.write_text(text[:found.start(1)] + expected + text[found.end(1):], encoding="utf-8")
        return
    assert found.group(1) == expected, (
        f"docs/architectures.md's {name} table differs from the registry's; regenerate it with: "
        "UPDATE_DOCS=1 python -m pytest tests/test_architecture_docs.py")


def test_readme_points_to_the_table():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    top = readme.split("## ", 1)[0]
    assert "docs/architectures.md" in top
