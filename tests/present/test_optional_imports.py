r"""Heavy optional packages (matplotlib, captum's visualisation) are imported inside the functions that draw,
never when a command-line or presentation module is imported; ``python -m captum_normattr.cli`` runs the CLI."""
import ast
import os
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "captum_normattr"
HEAVY = ("matplotlib", "captum.attr._utils.visualization", "IPython")


def _module_level_imports(path: Path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in tree.body:  # module level only: a function's own imports run when it is called
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module


def test_no_heavy_import_at_module_level():
    found = []
    for sub in ("cli", "present"):
        for path in sorted((PACKAGE / sub).rglob("*.py")):
            found += [(str(path.relative_to(PACKAGE)), name) for name in _module_level_imports(path)
                      if name.startswith(HEAVY)]
    assert found == [], found


def test_python_m_captum_normattr_cli_runs_the_command_line():
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(PACKAGE.parent), os.environ.get("PYTHONPATH", "")]))
    for module in ("captum_normattr.cli", "captum_normattr"):
        out = subprocess.run([sys.executable, "-m", module, "--list-methods"], capture_output=True, text=True,
                             env=env, timeout=300)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split()[0] == "globenc" and "alti-plus" in out.stdout
