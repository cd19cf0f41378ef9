r"""The command line answers at once: ``--help``, ``generate --help`` and usage errors import no torch.

Each check runs a fresh interpreter (the package of this checkout first on the path) and reads
``sys.modules`` at its end: torch, transformers, Captum and matplotlib must be absent. Also:
the subcommand table (``captum_normattr.cli.entry.SUBCOMMANDS``) is what the top-level help
lists, a subcommand's module is imported only when it runs, the parsers' light view of the
methods (``captum_normattr.cli.registry_view.SNAPSHOT``) equals the registry, and the
package's lazy ``__init__`` gives every exported name.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "captum", "matplotlib")

_PROBE = """
import json, sys
from captum_normattr.cli.entry import main
argv = json.loads(sys.argv[1])
try:
    code = main(argv)
except SystemExit as exc:
    code = exc.code
heavy = sorted(m for m in {heavy!r} if m in sys.modules)
cli = sorted(m for m in sys.modules if m.startswith("captum_normattr"))
print("PROBE " + json.dumps({{"code": code, "heavy": heavy, "modules": cli}}))
"""


def _env():
    return dict(os.environ, HF_HUB_OFFLINE="1",
                PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))


def _probe(argv, tmp_path):
    r"""Run the entry point on ``argv`` in a fresh interpreter: (exit code, heavy modules, package modules, stdout, stderr)."""
    done = subprocess.run([sys.executable, "-c", _PROBE.format(heavy=HEAVY), json.dumps(argv)], capture_output=True,
                          text=True, env=_env(), cwd=tmp_path, timeout=300)
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("PROBE ")]
    assert line, done.stderr[-3000:]
    rec = json.loads(line[-1][len("PROBE "):])
    return rec["code"], rec["heavy"], rec["modules"], done.stdout, done.stderr


@pytest.mark.parametrize("argv,code,message", [
    (["--help"], 0, "subcommands"),
    (["explain", "--help"], 0, "--method"),
    (["generate", "--help"], 0, "--max-new-tokens"),
    (["-m", "globnc", "a text"], 2, "unknown method 'globnc' (did you mean 'globenc'?)"),
    (["--map", "BAD", "a text"], 2, "invalid choice: 'BAD'"),
    (["--model", "./no-such-folder", "a text"], 2, "model folder not found"),
    (["--html-maps", "a text"], 2, "--html-maps needs --format html"),
    (["--batch-size", "0", "a text"], 2, "must be a positive integer"),
    (["generate"], 2, "the following arguments are required: prompt, --model"),
    (["generate", "--model", "m", "-m", "no-such-method", "p"], 2, "invalid choice: 'no-such-method'"),
])
def test_help_and_usage_errors_import_nothing_heavy(tmp_path, argv, code, message):
    got, heavy, modules, out, err = _probe(argv, tmp_path)
    assert got == code, err[-2000:]
    assert message in out + err
    assert heavy == [], f"{argv} imported {heavy}"
    assert "captum_normattr.attr.methods" not in modules and "captum_normattr.attr" not in modules


def test_evaluate_help_is_light_or_says_it_is_missing(tmp_path):
    r"""``evaluate`` lives in its own module (another branch may not have it yet): either its help, light,
    or one line saying the subcommand is not installed; never torch."""
    got, heavy, _, out, err = _probe(["evaluate", "--help"], tmp_path)
    assert heavy == []
    if (REPO / "captum_normattr" / "cli" / "evaluate.py").exists():
        assert got == 0 and "usage:" in out
    else:
        assert got == 2 and "'evaluate' subcommand" in err and "Traceback" not in err


def test_subcommand_modules_are_imported_only_when_they_run(tmp_path):
    _, _, modules, _, _ = _probe(["--help"], tmp_path)
    assert "captum_normattr.cli.generate" not in modules and "captum_normattr.cli.evaluate" not in modules
    _, _, modules, _, _ = _probe(["generate", "--help"], tmp_path)
    assert "captum_normattr.cli.generate" in modules and "captum_normattr.cli.main" not in modules


def test_top_level_help_lists_every_subcommand_once():
    from captum_normattr.cli.entry import SUBCOMMANDS, subcommand_lines
    from captum_normattr.cli.main import build_parser

    assert {k: (v.module, v.function) for k, v in SUBCOMMANDS.items()} == {
        "explain": ("captum_normattr.cli.main", "explain_main"),
        "generate": ("captum_normattr.cli.generate", "generate_main"),
        "evaluate": ("captum_normattr.cli.evaluate", "evaluate_main"),
    }
    text = build_parser().format_help()
    assert subcommand_lines() in text
    for name, sub in SUBCOMMANDS.items():
        lines = [ln for ln in text.splitlines() if ln.startswith(f"  {name} ")]
        assert len(lines) == 1 and sub.summary in lines[0], name


def test_dispatch_through_the_table(monkeypatch, capsys):
    r"""The first argument picks the table's entry; anything else is ``explain``; ``explain`` itself is dropped once."""
    from captum_normattr.cli import entry

    calls = []
    fake = type(sys)("fake_subcommand")
    fake.run = lambda argv: calls.append(argv) or 7
    monkeypatch.setitem(sys.modules, "fake_subcommand", fake)
    monkeypatch.setitem(entry.SUBCOMMANDS, "explain", entry.Subcommand("fake_subcommand", "run", "x"))
    monkeypatch.setitem(entry.SUBCOMMANDS, "fake", entry.Subcommand("fake_subcommand", "run", "y"))
    assert entry.main(["fake", "--a", "b"]) == 7
    assert entry.main(["a text", "-m", "alti"]) == 7
    assert entry.main(["explain", "explain"]) == 7  # the word 'explain' explained
    assert calls == [["--a", "b"], ["a text", "-m", "alti"], ["explain"]]
    monkeypatch.setitem(entry.SUBCOMMANDS, "gone", entry.Subcommand("captum_normattr.cli.no_such_module", "f", "z"))
    assert entry.main(["gone"]) == 2
    assert "'gone' subcommand" in capsys.readouterr().err


def test_python_dash_m_runs_the_lazy_package_init(tmp_path):
    r"""``python -m captum_normattr`` imports the package's ``__init__`` first; it is lazy, so --help stays light."""
    for module in ("captum_normattr", "captum_normattr.cli"):
        done = subprocess.run([sys.executable, "-X", "importtime", "-m", module, "--help"], capture_output=True,
                              text=True, env=_env(), cwd=tmp_path, timeout=300)
        assert done.returncode == 0 and "subcommands" in done.stdout, done.stderr[-2000:]
        imported = {ln.split("|")[-1].strip() for ln in done.stderr.splitlines() if ln.startswith("import time:")}
        assert "captum_normattr" in imported  # the package __init__ ran
        assert not imported & set(HEAVY), module


def test_import_captum_normattr_is_light_and_every_name_resolves(tmp_path):
    code = ("import sys, captum_normattr as c; heavy = [m for m in %r if m in sys.modules]; "
            "print(heavy); x = c.GlobEncAttribution; print(sorted(m for m in %r if m in sys.modules))") % (HEAVY, HEAVY)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), cwd=tmp_path,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    before, after = done.stdout.splitlines()[-2:]
    assert before == "[]"  # no torch, transformers, captum or matplotlib
    assert "torch" in after  # the first use imports what the class needs

    import captum_normattr
    from captum_normattr.attr.globenc import GlobEncAttribution
    from captum_normattr.decompose.primitives.feed_forward import SCOPES

    for name in captum_normattr.__all__:
        assert getattr(captum_normattr, name) is not None, name
    assert captum_normattr.GlobEncAttribution is GlobEncAttribution and captum_normattr.FF_SCOPES is SCOPES
    assert set(captum_normattr.__all__) <= set(dir(captum_normattr))
    assert captum_normattr.tokens.__name__ == "captum_normattr.tokens"  # a submodule, imported on access
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        captum_normattr.no_such_name


def test_the_light_view_is_the_registry():
    r"""``registry_view.SNAPSHOT`` (what the parsers read before the registry is imported) equals the registry."""
    from captum_normattr.attr.methods import METHODS, parse_position
    from captum_normattr.cli import registry_view

    expected = registry_view.snapshot_from_registry(METHODS)
    assert registry_view.SNAPSHOT == expected, (
        "update captum_normattr/cli/registry_view.py SNAPSHOT to:\n" + repr(expected))
    assert registry_view.methods() is METHODS  # once imported, the live registry (registered methods included)
    for value in ("0", "-3", "last"):
        assert registry_view.parse_position(value) == parse_position(value)
    with pytest.raises(Exception, match="must be an integer or 'last'"):
        registry_view.parse_position("first")


def test_the_snapshot_parser_equals_the_registry_parser(monkeypatch):
    r"""The parser built from the snapshot and the one built from the live registry have the same options."""
    from captum_normattr.cli import registry_view
    from captum_normattr.cli.main import build_parser

    def options(parser):
        return sorted((a.dest, tuple(a.option_strings), repr(a.default), repr(a.choices), a.help, repr(a.metavar))
                      for a in parser._actions)

    live = options(build_parser())
    monkeypatch.setattr(registry_view, "REGISTRY_MODULE", "captum_normattr.no_such_module")
    assert registry_view.methods() is registry_view.SNAPSHOT
    assert options(build_parser()) == live


def test_docs_document_every_subcommand_and_every_generate_option():
    from captum_normattr.cli.entry import SUBCOMMANDS
    from captum_normattr.cli.generate import build_parser

    doc = (REPO / "docs" / "cli.md").read_text(encoding="utf-8")
    table = doc[doc.index("## Subcommands"):]
    for name in SUBCOMMANDS:
        assert f"| `{name}` |" in table, name
    section = doc[doc.index("## Generated tokens of a causal LM (`generate`)"):doc.index("## Start-up time")]
    for action in build_parser()._actions:
        if action.dest == "help":
            continue
        flag = action.option_strings[-1] if action.option_strings else f"`{action.dest}`"
        assert flag in section, f"docs/cli.md does not document generate's {flag}"


def test_the_console_script_is_the_light_entry_point():
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg", encoding="utf-8")
    scripts = cfg["options.entry_points"]["console_scripts"]
    assert "captum-normattr = captum_normattr.cli.entry:main" in scripts
