r"""Code-health figures of the package: lines of code, import cycles, private cross-module imports.

Reads the sources only (``ast``; nothing is imported or run), so it is fast and safe on any
checkout::

    python benchmarks/code_health.py              # the table, for captum_normattr/ next to this folder
    python benchmarks/code_health.py --json       # the same as one JSON object
    python benchmarks/code_health.py --package path/to/captum_normattr

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

:func:`analyse` returns the figures as plain data; ``tests/test_code_health.py`` uses it.
"""
from __future__ import annotations

import argparse
import ast
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Set, Tuple

__all__ = ["ModuleInfo", "Health", "analyse", "import_cycles", "main"]


@dataclass
class ModuleInfo:
    r"""What one module of the package imports."""

    name: str
    path: str
    loc: int
    imports: Set[str] = field(default_factory=set)
    private: List[Tuple[str, str, int]] = field(default_factory=list)  # (imported module, name, line)


@dataclass
class Health:
    r"""The figures of one package."""

    package: str
    loc_total: int
    loc: Dict[str, int]
    edges: Dict[str, List[str]]
    cycles: List[List[str]]
    private_imports: List[Dict[str, object]]


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
                    if a.asname:
                        aliases[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(name, is_package, node.level, node.module)
            for a in node.names:
                sub = f"{base}.{a.name}"
                if sub in known:  # `from package import submodule`
                    info.imports.add(sub)
                    aliases[a.asname or a.name] = sub
                elif base in known:
                    info.imports.add(base)
                    if a.name.startswith("_") and not a.name.startswith("__") and base != name:
                        info.private.append((base, a.name, node.lineno))
    for node in _walk_runtime(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and node.attr.startswith("_") and not node.attr.startswith("__")
                and aliases[node.value.id] != name):
            info.private.append((aliases[node.value.id], node.attr, node.lineno))
    info.imports.discard(name)
    return info


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
        Health: lines of code, the import graph, its cycles and the private cross-module imports.
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
                  edges=edges, cycles=import_cycles(edges), private_imports=private)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package", type=Path, default=Path(__file__).resolve().parents[1] / "captum_normattr",
                        help="the package folder (default: captum_normattr/ next to benchmarks/)")
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
