r"""The Sphinx docs build with warnings as errors; the README's method table is the registry's."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TABLE = re.compile(r"<!-- method table:[^\n]*-->\n(.*?)\n<!-- end of method table -->", re.S)


def test_readme_method_table_is_the_registry_table():
    from captum_normattr.attr.methods import method_table_markdown

    readme = (REPO / "README.md").read_text(encoding="utf-8")
    found = TABLE.search(readme)
    assert found, "README.md lost its method-table markers"
    expected = method_table_markdown()
    if os.environ.get("UPDATE_README") == "1":  # UPDATE_README=1 python -m pytest tests/health/test_docs.py
        (REPO / "README.md").write_text(readme[:found.start(1)] + expected + readme[found.end(1):], encoding="utf-8")
        return
    assert found.group(1) == expected, (
        "README.md's method table differs from captum_normattr.attr.methods.method_table_markdown(); "
        "regenerate it with: UPDATE_README=1 python -m pytest tests/health/test_docs.py")


def test_ci_runs_the_readme_commands_as_written():
    r""".ci/run reads README command 1 and 2 from the README's first bash block and runs them as written."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    assert "readme_command 1" in ci and "readme_command 2" in ci and 'bash -c "set -e; $CMD1"' in ci
    func = ci[ci.index("readme_command() {"):ci.index("\n}\n", ci.index("readme_command() {")) + 3]
    script = func + "\nreadme_command 1; echo '---'; readme_command 2\n"
    out = subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True, check=True).stdout
    cmd1, cmd2 = [c.strip() for c in out.split("---")]
    assert "captum_normattr.quickstart" in cmd1 and "pip install" in cmd1 and cmd1 in readme
    assert "python -m pytest -q" in cmd2 and cmd2 in readme
    assert "## Memory (streaming engine)" in readme and "## Speed" in readme


def test_no_machine_paths_in_readme_docs_and_benchmarks():
    pattern = re.compile(r"(?<![\w.])/(?:work|root|home|tmp)/")
    files = [REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "benchmarks").rglob("*.py"),
             REPO / "benchmarks" / "RESULTS.md", *(REPO / "benchmarks" / "results").glob("*.json")]
    bad = [f"{f.relative_to(REPO)}: {m.group()}" for f in files if f.is_file()
           for m in pattern.finditer(f.read_text(encoding="utf-8"))]
    assert not bad, bad


def test_sphinx_docs_build_without_warnings(tmp_path):
    pytest.importorskip("sphinx")
    pytest.importorskip("myst_parser")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", MPLBACKEND="Agg")
    proc = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(REPO / "docs"), str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    built = {p.stem for p in tmp_path.glob("*.html")}
    for page in (REPO / "docs").glob("*.md"):  # every page joins the site (the toctree globs docs/*.md)
        assert page.stem in built, page.name
    assert "aggregate_to_words" in (tmp_path / "api.html").read_text(encoding="utf-8")
