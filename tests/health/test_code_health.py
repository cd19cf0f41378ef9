r"""Code health of the package, from its sources (``benchmarks/code_health.py``, ``ast`` only, no imports run).

The whole package must stay free of import cycles (lazy, function-level imports included) and
must not import private names (``_x``) of its other modules: what one module needs of another is
public there. :data:`CLEANED` names modules that must exist (the checks would pass vacuously on
a renamed package).
"""
from __future__ import annotations

import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import code_health  # noqa: E402

PACKAGE = Path(__file__).resolve().parents[2] / "captum_normattr"

CLEANED = {f"captum_normattr.{m}" for m in (
    "cli.main", "cli.common", "cli.seq2seq", "cli.generate", "cli.images", "cli.dataset.run", "cli.dataset.launch",
    "result", "aggregation", "present.report", "present.visualization", "present.visualization_seq2seq",
    "present.figures", "present.vision", "present.tokens", "present.interactive", "progress", "attr.methods", "options",
    "quickstart", "evaluation", "evaluation.alignment", "evaluation.baselines", "evaluation.classifier",
    "evaluation.harness", "evaluation.metrics", "attr.base", "attr.images", "attr.inputs", "attr.prepared",
    "models.capture.recorder", "decompose.kinds.registry", "decompose.kinds.base",
)}


def test_the_cleaned_modules_exist():
    health = code_health.analyse(PACKAGE)
    assert CLEANED <= set(health.loc), sorted(CLEANED - set(health.loc))


def test_no_import_cycle_in_the_package():
    health = code_health.analyse(PACKAGE)
    assert health.cycles == [], health.cycles


def test_no_private_name_imported_across_modules():
    health = code_health.analyse(PACKAGE)
    found = sorted((p["module"], p["imports_from"], p["name"]) for p in health.private_imports)
    assert found == [], found


def test_one_progress_bar():
    r"""tqdm is created in :mod:`captum_normattr.progress` only; every other module goes through it."""
    users = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                   if p.name != "progress.py" and ("import tqdm" in (t := p.read_text(encoding="utf-8"))
                                                   or "from tqdm" in t or "tqdm(" in t))
    assert users == [], users


def test_the_checks_find_cycles_and_private_imports(tmp_path):
    r"""The analysis itself: a made-up package with a lazy-import cycle and private imports of both kinds."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "def f():\n    from pkg.b import g\n    return g\n",
        "b.py": "from pkg import a as _a\n\ndef g():\n    return _a._hidden\n",
        "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import f\nfrom .sub.d import _x, __version__\n",
        "sub/__init__.py": "",
        "sub/d.py": "_x = 1\n__version__ = '1'\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(textwrap.dedent(text))
    h = code_health.analyse(pkg)
    assert h.cycles == [["pkg.a", "pkg.b"]]  # the lazy import counts; c's TYPE_CHECKING import does not
    assert "pkg.a" not in h.edges["pkg.c"] and "pkg.sub.d" in h.edges["pkg.c"]
    assert sorted((p["module"], p["imports_from"], p["name"]) for p in h.private_imports) == [
        ("pkg.b", "pkg.a", "_hidden"), ("pkg.c", "pkg.sub.d", "_x")]
    assert h.loc["pkg.a"] == 3 and h.loc_total == sum(h.loc.values())


def test_the_script_prints_its_figures(capsys):
    assert code_health.main([]) == 0
    out = capsys.readouterr().out
    assert "lines of code" in out and "import cycles:" in out and "private cross-module imports:" in out
