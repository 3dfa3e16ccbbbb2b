"""The import graph of the installed `meshplan` namespace, read from the source: no cycles (package
`__init__`s included), dependencies only point down the layers of `docs/architecture.md`, no
production module over `MAX_MODULE_LINES`, and the document's package map names exactly the
modules there are."""
from __future__ import annotations

import shutil

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # pragma: no cover
    import tomli as tomllib  # type: ignore[no-redef]

import networkx as nx

from tests.layout.architecture_doc import DOC, production_files, unnamed, unresolved
from tests.layout.import_graph import PACKAGE_DIRS, ROOT, import_graph, module_files

# The layers of docs/architecture.md's dependency rule, bottom first. A module may import
# modules of its own package and of the packages of lower layers; never a package of its own
# layer or of a higher one. A module belongs to the longest package named here that holds it
# (`meshplan.planner` itself: only the planner's `__init__`).
LAYERS = (
    ("meshplan.planner.contracts", "meshplan.planner", "meshplan.profiles"),
    ("meshplan.planner.models",),
    ("meshplan.planner.profiling",),
    ("meshplan.planner.costing",),
    ("meshplan.planner.simulation", "meshplan.planner.calibration"),
    ("meshplan.planner.search", "meshplan.planner.engines"),
    ("meshplan.executor", "meshplan.reports"),
    ("meshplan",),  # the public API, the CLI, the commands and the demo
)
MAX_MODULE_LINES = 500
OUTSIDE_PLANNER = ("meshplan.executor", "meshplan.reports", "meshplan.cli", "meshplan.commands", "meshplan.demo")


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _cycles(graph: nx.DiGraph) -> list[list[str]]:
    return [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    assert graph.number_of_nodes() > 60 and graph.number_of_edges() > 150  # the graph was really read
    # with its __init__ edges: importing a planner module from the reports runs the planner's __init__
    assert graph.has_edge("meshplan.reports.build", "meshplan.planner")
    assert not graph.has_edge("meshplan.reports.build", "meshplan.reports")  # its own package ran first
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


def test_a_cycle_through_a_package_init_is_caught(tmp_path):
    """A contracts `__init__` that imports the search closes a cycle only through the `__init__`
    that importing any `meshplan.planner.contracts.*` module runs: the plain edges miss it."""
    for folder in PACKAGE_DIRS.values():
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    init = tmp_path / "planner" / "contracts" / "__init__.py"
    init.write_text(init.read_text() + "\nfrom meshplan.planner.search import driver  # noqa: E402,F401\n")
    assert _cycles(import_graph(tmp_path, init_edges=False)) == []
    cycles = _cycles(import_graph(tmp_path))
    assert any("meshplan.planner.contracts" in c and "meshplan.planner.search.driver" in c for c in cycles)


def _layer_of(module: str) -> tuple[int, str]:
    """(layer index, package) of the longest `LAYERS` package holding `module`."""
    held = [(len(package), index, package) for index, layer in enumerate(LAYERS) for package in layer
            if _under(module, package)]
    _, index, package = max(held)
    return index, package


def _layering_violations(graph: nx.DiGraph) -> list[tuple[str, str]]:
    bad = []
    for a, b in graph.edges:
        (layer_a, package_a), (layer_b, package_b) = _layer_of(a), _layer_of(b)
        if package_a != package_b and layer_b >= layer_a:
            bad.append((a, b))
    return sorted(bad)


def test_every_import_points_down_the_layers():
    graph = import_graph()
    assert {_layer_of(module)[1] for module in graph} == {p for layer in LAYERS for p in layer}  # no stale name
    assert _layering_violations(graph) == []
    # the rule bites: an import up (costing -> search) or across a layer (simulation -> calibration)
    graph.add_edge("meshplan.planner.costing.tables", "meshplan.planner.search.driver")
    graph.add_edge("meshplan.planner.simulation.simulator", "meshplan.planner.calibration.fits")
    assert _layering_violations(graph) == [("meshplan.planner.costing.tables", "meshplan.planner.search.driver"),
                                           ("meshplan.planner.simulation.simulator", "meshplan.planner.calibration.fits")]


def test_no_production_module_is_over_the_line_limit():
    lengths = {path: len((ROOT / path).read_text(encoding="utf-8").splitlines()) for path in production_files()}
    assert len(lengths) > 100 and max(lengths.values()) > MAX_MODULE_LINES / 2  # the files were really read
    assert {path: n for path, n in lengths.items() if n > MAX_MODULE_LINES} == {}


def test_the_architecture_doc_names_only_modules_that_exist():
    assert unresolved(DOC.read_text(encoding="utf-8")) == ([], [])
    # the check bites: a path, a module and a name that are not there
    assert unresolved("`planner/costing/nope.py` `meshplan.planner.nope` `meshplan.planner.costing.tables.Nope`") \
        == (["planner/costing/nope.py"], ["meshplan.planner.costing.tables.Nope", "meshplan.planner.nope"])


def test_the_architecture_doc_names_every_production_module():
    assert unnamed(DOC.read_text(encoding="utf-8")) == []
    assert "planner/costing/layer_cost.py" in unnamed("`planner/costing/tables.py`")


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
