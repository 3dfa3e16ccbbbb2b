"""meshplan's import graph, read from the source with ast (nothing is imported).

A node is a module (`meshplan.planner.costing.layer_cost`); a package is the module its
`__init__.py` defines (`meshplan.planner.costing`). An edge `a -> b` means that running a's
imports runs b:

- a's source imports b, at module level or inside a function (a lazy import is still a
  dependency: it runs when the function does). Imports under `if TYPE_CHECKING:` are left out:
  they never run. `from pkg import name` points at `pkg.name` when that is a module, else at
  `pkg`.
- `__init__` edges: importing `x.y.z` runs `x/__init__.py` and `x/y/__init__.py` first, so an
  import of `x.y.z` by `a` is also an edge `a -> x` and `a -> x.y`, for each of those packages
  that does not contain `a`. (Python loads a module's own packages before the module itself
  runs, so importing a sibling never runs its own package's `__init__` again.) The package's
  node carries every import its `__init__.py` makes, lazy ones included, as any module's does.

So a package `__init__` that imports, even lazily, a module that imports anything under that
package from outside it, closes a cycle the plain import edges do not show.
"""
from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[2]
# The import namespace over the repository folders (pyproject's package-dir).
PACKAGE_DIRS = {"meshplan": "meshplan", "meshplan.planner": "planner", "meshplan.executor": "executor",
                "meshplan.reports": "reports", "meshplan.profiles": "profiles"}


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the installed namespace, by dotted name."""
    modules = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root / folder).with_suffix("").parts
            if rel[-1] == "__init__":
                rel = rel[:-1]
            if folder == "meshplan" and rel and rel[0] in ("planner", "executor", "reports", "profiles"):
                continue
            modules[".".join((package, *rel))] = path
    return modules


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, module: str, is_package: bool):
    """(imported name, names imported from it) for every import that can run."""
    stack = [tree]
    while stack:
        node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                stack.extend(child.orelse)
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield alias.name, ()
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = module.split(".")
                    anchor = parts if is_package else parts[:-1]
                    anchor = anchor[: len(anchor) - (child.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                yield base, tuple(alias.name for alias in child.names)
            else:
                stack.append(child)


def packages_run_first(target: str, importer: str) -> list[str]:
    """The packages whose `__init__` importing `target` runs before it, as seen from `importer`:
    every package on `target`'s dotted path that does not contain `importer`."""
    parts = target.split(".")
    ancestors = (".".join(parts[:k]) for k in range(1, len(parts)))
    return [p for p in ancestors if not (importer == p or importer.startswith(p + "."))]


def import_graph(root: Path = ROOT, init_edges: bool = True) -> nx.DiGraph:
    """The graph of the module docstring: plain import edges and (`init_edges`) `__init__` edges."""
    files = module_files(root)
    graph = nx.DiGraph()
    graph.add_nodes_from(files)
    for module, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for base, names in _imports(tree, module, path.name == "__init__.py"):
            targets = [f"{base}.{name}" for name in names if f"{base}.{name}" in files] or [base]
            for target in targets:
                run_first = packages_run_first(target, module) if init_edges else []
                for node in (*run_first, target):
                    if node in files and node != module:
                        graph.add_edge(module, node)
    return graph
