r"""Code-health figures of the package: lines of code, import cycles, private cross-module imports, floors.

Reads the sources only (``ast``; nothing is imported or run), so it is fast and safe on any
checkout::

    python tests/health/code_health.py              # the table, for the captum_normattr/ of this checkout
    python tests/health/code_health.py --json       # the same as one JSON object
    python tests/health/code_health.py --package path/to/captum_normattr

What is counted:

* **lines of code**: non-blank lines that are not only a comment, per module and in total
  (docstrings count: they are part of what a maintainer reads);
* **import graph**: one edge ``a -> b`` for every ``import b`` / ``from b import x`` /
  ``from package import b`` in module ``a``, at any depth (function-level, "lazy" imports count:
  they are dependencies all the same, and a cycle through them is still a cycle). Importing a
  submodule does not add an edge to the parent packages' ``__init__`` (Python runs it, but that
  is not a design dependency). Imports under ``if TYPE_CHECKING:`` are left out;
* **import cycles**: the strongly connected components of that graph with more than one module;
* **private cross-module imports**: ``from m import _x`` where ``m`` is another module of the
  package and ``_x`` is not a dunder, and ``alias._x`` where ``alias`` names another module of the
  package imported in this one.

:func:`analyse` returns the figures as plain data; ``tests/health/test_code_health.py`` uses it.

And the house rules it checks:

* **floors**: every module has a floor (:data:`FLOORS`, by its first name under the package),
  and no module imports one of a higher floor (:func:`floor_violations`). Low to high:
  ``options``, ``progress``, ``tokens``, ``arguments`` (stand-alone utilities that import nothing of the package: floor 0,
  any module may use them), ``arch`` (what the models look like, as data), ``decompose`` (the
  arithmetic), ``models`` (reading a Hugging Face model), ``attr`` with ``result`` and
  ``aggregation`` (the Captum methods and what they return: a result groups its scores into
  words, so they share the methods' floor), ``evaluation`` and ``present`` (side by side; neither
  is below the other), ``cli``, then the package's front doors ``quickstart``, ``__main__`` and
  ``__init__``. Modules on one floor may import each other;
* **``__all__``**: every public module (one whose own name does not start with ``_``; a package
  is public when its name is) assigns ``__all__`` (:func:`missing_all`);
* **size**: no module over :data:`MAX_LINES` lines (physical lines) unless its docstring says
  why, in a sentence containing ``"lines"`` and ``"because"`` (:func:`oversized`).
"""
from __future__ import annotations

import argparse
import ast
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Set, Tuple

__all__ = ["FLOORS", "MAX_LINES", "ModuleInfo", "Health", "analyse", "import_cycles", "floor_of", "floor_violations",
           "missing_all", "oversized", "benchmark_imports", "main"]

#: The floor of every first name under the package (see the module docstring); higher may import lower.
FLOORS: Dict[str, int] = {
    "options": 0, "progress": 0, "tokens": 0, "arguments": 0,
    "arch": 1,
    "decompose": 2,
    "models": 3,
    "attr": 4, "result": 4, "aggregation": 4,
    "evaluation": 5, "present": 5,
    "cli": 6,
    "quickstart": 7, "__main__": 7, "": 7,  # "": the package's own __init__
}

#: Physical lines above which a module's docstring must say why it is long.
MAX_LINES = 700


@dataclass
class ModuleInfo:
    r"""What one module of the package imports."""

    name: str
    path: str
    loc: int
    imports: Set[str] = field(default_factory=set)
    private: List[Tuple[str, str, int]] = field(default_factory=list)  # (imported module, name, line)
    lines: int = 0
    has_all: bool = False
    says_why_long: bool = False
    import_lines: Dict[str, int] = field(default_factory=dict)  # imported module -> first line


@dataclass
class Health:
    r"""The figures of one package."""

    package: str
    loc_total: int
    loc: Dict[str, int]
    edges: Dict[str, List[str]]
    cycles: List[List[str]]
    private_imports: List[Dict[str, object]]
    floor_violations: List[Dict[str, object]] = field(default_factory=list)
    missing_all: List[str] = field(default_factory=list)
    oversized: List[Dict[str, object]] = field(default_factory=list)


def _loc(source: str) -> int:
    return sum(1 for line in source.splitlines() if line.strip() and not line.strip().startswith("#"))


def _module_name(root: Path, path: Path, package: str) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([package] + parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk_runtime(tree: ast.AST) -> Iterable[ast.AST]:
    r"""``ast.walk`` that skips the bodies of ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                stack.extend(child.orelse)
                continue
            stack.append(child)


def _resolve(module: str, is_package: bool, level: int, target: Optional[str]) -> str:
    if level == 0:
        return target or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _scan(name: str, path: Path, known: Set[str]) -> ModuleInfo:
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source, filename=str(path))
    info = ModuleInfo(name=name, path=str(path), loc=_loc(source))
    is_package = path.name == "__init__.py"
    aliases: Dict[str, str] = {}  # local name -> package module it is bound to
    for node in _walk_runtime(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in known:
                    info.imports.add(a.name)
                    info.import_lines.setdefault(a.name, node.lineno)
                    if a.asname:
                        aliases[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(name, is_package, node.level, node.module)
            for a in node.names:
                sub = f"{base}.{a.name}"
                if sub in known:  # `from package import submodule`
                    info.imports.add(sub)
                    info.import_lines.setdefault(sub, node.lineno)
                    aliases[a.asname or a.name] = sub
                elif base in known:
                    info.imports.add(base)
                    info.import_lines.setdefault(base, node.lineno)
                    if a.name.startswith("_") and not a.name.startswith("__") and base != name:
                        info.private.append((base, a.name, node.lineno))
    for node in _walk_runtime(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and node.attr.startswith("_") and not node.attr.startswith("__")
                and aliases[node.value.id] != name):
            info.private.append((aliases[node.value.id], node.attr, node.lineno))
    info.imports.discard(name)
    info.lines = len(source.splitlines())
    info.has_all = any(
        (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets))
        or (isinstance(node, (ast.AnnAssign, ast.AugAssign)) and isinstance(node.target, ast.Name)
            and node.target.id == "__all__")
        for node in tree.body)
    doc = (ast.get_docstring(tree) or "").lower()
    info.says_why_long = any("lines" in s and "because" in s for s in doc.replace("\n", " ").split(". "))
    return info


def floor_of(module: str, package: str) -> int:
    r"""The floor of a module of ``package`` (:data:`FLOORS`, by its first name under the package).

    Args:
        module (str): dotted module name, ``package`` first.
        package (str): the package's name.

    Returns:
        int: its floor; a first name :data:`FLOORS` does not know gets the top floor.
    """
    parts = module.split(".")
    first = parts[1] if len(parts) > 1 and parts[0] == package else ""
    return FLOORS.get(first, max(FLOORS.values()))


def floor_violations(infos: Iterable[ModuleInfo], package: str) -> List[Dict[str, object]]:
    r"""Imports from a lower floor to a higher one.

    Args:
        infos (Iterable[ModuleInfo]): the scanned modules.
        package (str): the package's name.

    Returns:
        List[Dict[str, object]]: ``module``, ``line``, ``imports`` and both floors, one per offending import.
    """
    out = []
    for i in infos:
        low = floor_of(i.name, package)
        for target in sorted(i.imports):
            high = floor_of(target, package)
            if high > low:
                out.append(dict(module=i.name, line=i.import_lines.get(target, 0), imports=target,
                                floor=low, imported_floor=high))
    return out


def missing_all(infos: Iterable[ModuleInfo]) -> List[str]:
    r"""The public modules (own name not starting with ``_``) that do not assign ``__all__``.

    Args:
        infos (Iterable[ModuleInfo]): the scanned modules.

    Returns:
        List[str]: their names, sorted.
    """
    return sorted(i.name for i in infos if not i.name.rsplit(".", 1)[-1].startswith("_") and not i.has_all)


def oversized(infos: Iterable[ModuleInfo], max_lines: int = MAX_LINES) -> List[Dict[str, object]]:
    r"""The modules over ``max_lines`` physical lines whose docstring does not say why.

    Args:
        infos (Iterable[ModuleInfo]): the scanned modules.
        max_lines (int): the limit.

    Returns:
        List[Dict[str, object]]: ``module`` and ``lines``, longest first.
    """
    return sorted((dict(module=i.name, lines=i.lines) for i in infos if i.lines > max_lines and not i.says_why_long),
                  key=lambda d: (-d["lines"], d["module"]))


def import_cycles(edges: Dict[str, Iterable[str]]) -> List[List[str]]:
    r"""Strongly connected components with more than one node (Tarjan), each sorted, the list sorted."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    on_stack: Set[str] = set()
    stack: List[str] = []
    out: List[List[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # recursion depth is bounded by the number of modules (~100)
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out)


def analyse(package_dir: Path) -> Health:
    r"""Scan every ``*.py`` under ``package_dir`` and return the figures.

    Args:
        package_dir (Path): the package folder (the one holding ``__init__.py``).

    Returns:
        Health: lines of code, the import graph, its cycles, the private cross-module imports, the
        imports against the floors, the public modules without ``__all__`` and the long modules
        that do not say why.
    """
    package_dir = Path(package_dir).resolve()
    package = package_dir.name
    paths = sorted(p for p in package_dir.rglob("*.py") if "__pycache__" not in p.parts)
    names = {_module_name(package_dir, p, package): p for p in paths}
    known = set(names)
    infos = [_scan(n, p, known) for n, p in names.items()]
    edges = {i.name: sorted(i.imports) for i in infos}
    private = [dict(module=i.name, imports_from=m, name=x, line=line) for i in infos for (m, x, line) in i.private]
    return Health(package=package, loc_total=sum(i.loc for i in infos), loc={i.name: i.loc for i in infos},
                  edges=edges, cycles=import_cycles(edges), private_imports=private,
                  floor_violations=floor_violations(infos, package), missing_all=missing_all(infos),
                  oversized=oversized(infos))


#: Calls that put a folder on the import path or load a module from a file.
_LOADERS = {"insert", "append", "extend", "syspath_prepend", "spec_from_file_location", "run_path", "import_module",
            "SourceFileLoader", "__import__"}
#: Calls that import a module by its name.
_BY_NAME = {"importorskip", "import_module", "__import__"}


def _mentions(node: ast.AST, word: str, names: Set[str]) -> bool:
    return any((isinstance(n, ast.Constant) and isinstance(n.value, str) and word in n.value)
               or (isinstance(n, ast.Name) and n.id in names) for n in ast.walk(node))


def benchmark_imports(tests_dir: Path, benchmarks_dir: Path) -> List[Dict[str, object]]:
    r"""Where test files import a benchmark script or put the benchmarks folder on the import path.

    A test that needs a benchmark runs it in a subprocess, as a user would; what a test needs to
    import is package API. Flagged: ``import x`` / ``from x import ...`` where ``x`` (its first
    name) is a script of ``benchmarks_dir`` (any depth) or the folder itself, and a call that
    puts a folder on ``sys.path`` or loads a module from a file (``sys.path.insert``,
    ``spec_from_file_location``, ``runpy.run_path``, ...) whose arguments name the folder, directly
    or through a variable assigned from an expression that does, and ``pytest.importorskip`` /
    ``importlib.import_module`` of a script's name.

    Args:
        tests_dir (Path): the tests folder (every ``*.py`` under it is read).
        benchmarks_dir (Path): the benchmarks folder.

    Returns:
        List[Dict[str, object]]: ``file`` (relative to ``tests_dir``), ``line`` and ``what``, sorted.
    """
    tests_dir, benchmarks_dir = Path(tests_dir), Path(benchmarks_dir)
    word = benchmarks_dir.name
    scripts = {p.stem for p in benchmarks_dir.rglob("*.py")} | {word}
    out = []
    for path in sorted(tests_dir.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        rel = str(path.relative_to(tests_dir))
        names: Set[str] = set()
        for _ in range(3):  # variables built from variables that name the folder
            for node in ast.walk(tree):
                if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None and _mentions(node.value, word, names):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found = [a.name for a in node.names if a.name.split(".")[0] in scripts]
            elif isinstance(node, ast.ImportFrom):
                found = [node.module] if node.level == 0 and node.module and node.module.split(".")[0] in scripts else []
            elif isinstance(node, ast.Call):
                fn = node.func
                name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
                args = [*node.args, *(k.value for k in node.keywords)]
                found = [name] if name in _LOADERS and any(_mentions(a, word, names) for a in args) else []
                if name in _BY_NAME and node.args and isinstance(node.args[0], ast.Constant) \
                        and str(node.args[0].value).split(".")[0] in scripts:
                    found.append(f"{name}({node.args[0].value!r})")
            else:
                continue
            out.extend(dict(file=rel, line=node.lineno, what=w) for w in found)
    return sorted(out, key=lambda d: (d["file"], d["line"], d["what"]))


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package", type=Path, default=Path(__file__).resolve().parents[2] / "captum_normattr",
                        help="the package folder (default: this checkout's captum_normattr/)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args(argv)
    h = analyse(args.package)
    if args.json:
        print(json.dumps(asdict(h), indent=1))
        return 0
    print(f"{h.package}: {len(h.loc)} modules, {h.loc_total} lines of code")
    for name, n in sorted(h.loc.items(), key=lambda kv: -kv[1])[:10]:
        print(f"  {n:6d}  {name}")
    print(f"import cycles: {len(h.cycles)}")
    for c in h.cycles:
        print("  " + " <-> ".join(c))
    print(f"private cross-module imports: {len(h.private_imports)}")
    for p in h.private_imports:
        print(f"  {p['module']}:{p['line']}  {p['imports_from']}.{p['name']}")
    print(f"imports from a lower floor to a higher one: {len(h.floor_violations)}")
    for v in h.floor_violations:
        print(f"  {v['module']}:{v['line']} (floor {v['floor']})  imports {v['imports']} (floor {v['imported_floor']})")
    print(f"public modules without __all__: {len(h.missing_all)}")
    for m in h.missing_all:
        print(f"  {m}")
    print(f"modules over {MAX_LINES} lines that do not say why: {len(h.oversized)}")
    for o in h.oversized:
        print(f"  {o['lines']:6d}  {o['module']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
