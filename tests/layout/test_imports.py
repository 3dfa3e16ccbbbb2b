"""The import graph of the installed `meshplan` namespace, read from the source: no cycles, and
dependencies only point down the pipeline (contracts <- planner <- executor, reports <- CLI)."""
from __future__ import annotations

import shutil

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # pragma: no cover
    import tomli as tomllib  # type: ignore[no-redef]

import networkx as nx

from tests.layout.import_graph import PACKAGE_DIRS, ROOT, import_graph, module_files

OUTSIDE_PLANNER = ("meshplan.executor", "meshplan.reports", "meshplan.cli", "meshplan.commands", "meshplan.demo")


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _cycles(graph: nx.DiGraph) -> list[list[str]]:
    return [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    assert graph.number_of_nodes() > 60 and graph.number_of_edges() > 150  # the graph was really read
    assert _cycles(graph) == []


def test_a_reintroduced_cycle_is_caught(tmp_path):
    """Copy the tree, make the contracts import the search back, and the check must fail."""
    for folder in PACKAGE_DIRS.values():
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    config = tmp_path / "planner" / "contracts" / "config.py"
    config.write_text(config.read_text() + "\n\ndef _late():\n    from meshplan.planner.search import driver\n")
    cycles = _cycles(import_graph(tmp_path))
    assert cycles and any("meshplan.planner.contracts.config" in c and "meshplan.planner.search.driver" in c
                          for c in cycles)


def test_the_planner_imports_nothing_of_executor_reports_or_cli():
    graph = import_graph()
    bad = [(a, b) for a, b in graph.edges if _under(a, "meshplan.planner")
           and any(_under(b, outside) for outside in OUTSIDE_PLANNER)]
    assert bad == []


def test_contracts_are_a_leaf():
    graph = import_graph()
    bad = [(a, b) for a, b in graph.edges if _under(a, "meshplan.planner.contracts")
           and not _under(b, "meshplan.planner.contracts")]
    assert bad == []


def test_executor_and_reports_do_not_import_each_other_or_the_cli():
    graph = import_graph()
    pairs = (("meshplan.executor", "meshplan.reports"), ("meshplan.reports", "meshplan.executor"))
    bad = [(a, b) for a, b in graph.edges for src, dst in pairs if _under(a, src) and _under(b, dst)]
    bad += [(a, b) for a, b in graph.edges if (_under(a, "meshplan.executor") or _under(a, "meshplan.reports"))
            and any(_under(b, cli) for cli in ("meshplan.cli", "meshplan.commands", "meshplan.demo"))]
    assert bad == []


def test_no_module_imports_the_old_top_level_packages():
    """Everything imports `meshplan.*`: a bare `planner`/`executor` import would load a second copy
    of the classes (or a user's own package of that name)."""
    graph = import_graph()
    files = module_files()
    stray = []
    for module, path in files.items():
        text = path.read_text(encoding="utf-8")
        for name in ("planner", "executor", "reports", "profiles"):
            if f"\nfrom {name}." in text or f"\nimport {name}." in text or f"\nfrom {name} import" in text:
                stray.append((module, name))
    assert stray == [] and graph.number_of_nodes() == len(files)


def test_pyproject_lists_every_package_folder():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(data["tool"]["setuptools"]["packages"])
    assert data["tool"]["setuptools"]["package-dir"] == PACKAGE_DIRS
    found = set()
    for package, folder in PACKAGE_DIRS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            if folder == "meshplan" and rel and rel[0] in ("planner", "executor", "reports", "profiles"):
                continue
            found.add(".".join((package, *rel)))
    assert found == listed
