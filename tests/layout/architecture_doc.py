"""What `docs/architecture.md` names of the code: module paths (`planner/costing/tables.py`,
`meshplan/commands/*.py`) and dotted names (`meshplan.planner.costing.layer_cost.layer_cost`),
read from its text, so the layout tests can hold the document to the source."""
from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.layout.import_graph import ROOT, module_files

DOC = ROOT / "docs" / "architecture.md"
PRODUCTION_FOLDERS = ("planner", "executor", "reports", "meshplan")
# a repository path of production code, or a glob of them, in backquotes
_PATH = re.compile(r"`((?:%s)/[\w/*]+\.py)`" % "|".join(PRODUCTION_FOLDERS))
# a dotted name under the namespace, in backquotes, up to its call parentheses if any
_DOTTED = re.compile(r"`(meshplan(?:\.\w+)+)")

def named_paths(text: str) -> set[str]:
    return set(_PATH.findall(text))

def named_dotted(text: str) -> set[str]:
    return set(_DOTTED.findall(text))

def production_files(root: Path = ROOT) -> list[str]:
    """Every production source file, as a repository path."""
    return sorted(str(p.relative_to(root)) for folder in PRODUCTION_FOLDERS
                  for p in (root / folder).rglob("*.py") if "__pycache__" not in p.parts)

def holds_code(path: Path) -> bool:
    """Whether a file defines or runs anything beyond its docstring and `from __future__`."""
    body = ast.parse(path.read_text(encoding="utf-8")).body
    return any(not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))
               and not (isinstance(node, ast.ImportFrom) and node.module == "__future__") for node in body)

def top_level_names(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names

def resolves(dotted: str, files: dict[str, Path]) -> bool:
    """A module, or a name defined at the top level of the longest module the name starts with."""
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        module = ".".join(parts[:k])
        if module in files:
            return k == len(parts) or parts[k] in top_level_names(files[module]) or \
                ".".join(parts[:k + 1]) in files
    return False

def unresolved(text: str, root: Path = ROOT) -> tuple[list[str], list[str]]:
    """(paths that match no file, dotted names that match no module or name)."""
    missing_paths = sorted(p for p in named_paths(text) if not list(root.glob(p)))
    files = module_files(root)
    missing_dotted = sorted(d for d in named_dotted(text) if not resolves(d, files))
    return missing_paths, missing_dotted

def unnamed(text: str, root: Path = ROOT) -> list[str]:
    """Production files holding code that no path (or glob) the document names covers."""
    covered = {str(p.relative_to(root)) for pattern in named_paths(text) for p in root.glob(pattern)}
    return [f for f in production_files(root) if f not in covered and holds_code(root / f)]
