r"""docs/architectures.md's tables are the registry's (no hand-kept list of families)."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from captum_normattr.arch.registry import refused_table_markdown
from captum_normattr.models.adapters import architecture_table_markdown, encoder_decoder_table_markdown

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "architectures.md"


@pytest.mark.parametrize("name,render,doc", [
    ("architecture", architecture_table_markdown, DOC),
    ("refused", refused_table_markdown, DOC),
    ("encoder-decoder", encoder_decoder_table_markdown, DOC),
    ("architecture", architecture_table_markdown, REPO / "README.md"),
], ids=["docs-architecture", "docs-refused", "docs-encoder-decoder", "readme-architecture"])
def test_architecture_docs_tables_are_the_generated_ones(name, render, doc):
    text = doc.read_text(encoding="utf-8")
    found = re.search(rf"<!-- {name} table:[^\n]*-->\n(.*?)\n?<!-- end of {name} table -->", text, re.S)
    assert found, f"{doc.name} lost its {name}-table markers"
    expected = render()
    if os.environ.get("UPDATE_DOCS") == "1":  # UPDATE_DOCS=1 python -m pytest tests/health/test_architecture_docs.py
        doc.write_text(text[:found.start(1)] + expected + "\n" * (not text[found.end(1):].startswith("\n")) + text[found.end(1):], encoding="utf-8")
        return
    assert found.group(1) == expected, (
        f"{doc.name}'s {name} table differs from the registry's; regenerate it with: "
        "UPDATE_DOCS=1 python -m pytest tests/health/test_architecture_docs.py")


def test_readme_points_to_the_table():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    top = readme.split("## ", 1)[0]
    assert "docs/architectures.md" in top
