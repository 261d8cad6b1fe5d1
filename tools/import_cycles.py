#!/usr/bin/env python3
"""List import cycles among the project's Python modules (no import is executed: ``ast`` only).

    python3 tools/import_cycles.py [--root DIR]      exit 0: no cycle, 1: cycles listed

Sources: ``python/`` (packages ``mori_core`` and ``mori``) and ``integrations/`` (installed as
``mori_integrations``). An edge A -> B is any ``import B`` / ``from B import x`` in A that names a
project module (``from pkg import sub`` names the submodule ``pkg.sub`` when that file exists;
relative imports are resolved). Edges are kept apart by where the import stands: at module level
(runs when A is imported) or inside a function/method (runs when it is called). A cycle is a set
of modules that reach each other; it is reported if any of its edges is function-level too,
because "A imports B, which imports A back" is a circle either way (imports under
``if TYPE_CHECKING:`` never run and are not edges). Edges from a package's
``__init__`` to its own submodules are counted; the implicit import of a parent package before
its submodule is not (every package would otherwise be one cycle with its children).
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
from dataclasses import dataclass, field
from typing import Iterator, Optional

# source folder (relative to the repository root) -> package name it is installed as
SOURCES = {"python/mori_core": "mori_core", "python/mori": "mori", "integrations": "mori_integrations"}


@dataclass
class Graph:
    """Module -> {imported module: kind}; kind is "module" or "function" (module wins)."""

    edges: dict[str, dict[str, str]] = field(default_factory=dict)

    def add(self, src: str, dst: str, kind: str) -> None:
        out = self.edges.setdefault(src, {})
        if out.get(dst) != "module":
            out[dst] = kind


def find_modules(root: str) -> dict[str, str]:
    """Module name -> file path of every project module."""
    modules: dict[str, str] = {}
    for folder, package in SOURCES.items():
        base = os.path.join(root, folder)
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            rel = os.path.relpath(dirpath, base)
            parts = [package] + ([] if rel == "." else rel.split(os.sep))
            for name in filenames:
                if not name.endswith(".py"):
                    continue
                mod = parts if name == "__init__.py" else parts + [name[:-3]]
                modules[".".join(mod)] = os.path.join(dirpath, name)
    return modules


def _is_type_checking(node: ast.AST) -> bool:
    """``if TYPE_CHECKING:`` / ``if typing.TYPE_CHECKING:`` (its body never runs)."""
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> Iterator[tuple[ast.AST, str]]:
    """Every import statement that can run, with "module" or "function" (inside a def at any
    depth); imports under ``if TYPE_CHECKING:`` are for type checkers only and are skipped."""

    def walk(node: ast.AST, in_function: bool) -> Iterator[tuple[ast.AST, str]]:
        for child in ast.iter_child_nodes(node):
            if _is_type_checking(child):
                for other in child.orelse:
                    yield from walk(ast.Module(body=[other], type_ignores=[]), in_function)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, "function" if in_function else "module"
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            yield from walk(child, nested)

    yield from walk(tree, False)


def _resolve_from(module: str, is_package: bool, node: ast.ImportFrom) -> Optional[str]:
    """Absolute module name of ``from X import ...`` (relative levels resolved)."""
    if node.level == 0:
        return node.module
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def build_graph(root: str) -> tuple[Graph, dict[str, str]]:
    """The import graph of the project's modules."""
    modules = find_modules(root)
    graph = Graph()
    for mod, path in modules.items():
        is_package = path.endswith("__init__.py")
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
        graph.edges.setdefault(mod, {})
        for node, kind in _imports(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = _resolve_from(mod, is_package, node)
                if base is None:
                    continue
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in modules else base)
            for target in targets:
                # `import a.b.c` names a.b.c; keep the longest prefix that is a project module
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != mod:
                    graph.add(mod, target, kind)
    return graph, modules


def cycles(graph: Graph) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.edges.get(v, {}):
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

    for v in sorted(graph.edges):
        if v not in index:
            visit(v)
    return sorted(out)


def describe(graph: Graph, comp: list[str]) -> list[str]:
    """The edges inside one cycle, one line each: ``a -> b (module|function)``."""
    members = set(comp)
    return [
        f"  {src} -> {dst} ({kind}-level)"
        for src in comp
        for dst, kind in sorted(graph.edges.get(src, {}).items())
        if dst in members
    ]


def main(argv: Optional[list[str]] = None) -> int:
    """Print the cycles (module-level and function-level edges apart); exit 1 if any."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    args = parser.parse_args(argv)
    graph, modules = build_graph(args.root)
    n_module = sum(1 for e in graph.edges.values() for k in e.values() if k == "module")
    n_function = sum(1 for e in graph.edges.values() for k in e.values() if k == "function")
    found = cycles(graph)
    print(f"{len(modules)} modules, {n_module} module-level and {n_function} function-level project imports")
    module_only = Graph({s: {d: k for d, k in e.items() if k == "module"} for s, e in graph.edges.items()})
    print(f"cycles through module-level imports only: {len(cycles(module_only))}")
    print(f"cycles through any imports (module- or function-level): {len(found)}")
    for comp in found:
        print(f"cycle of {len(comp)} modules:")
        print("\n".join(describe(graph, comp)))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
