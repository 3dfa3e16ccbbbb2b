"""`pip install .` gives one import namespace: `meshplan.*` works from anywhere, `planner` does not
exist, the built-in profiles ship as package data, and the console entry point answers --help."""
from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile

import pytest

from tests.layout.import_graph import PACKAGE_DIRS, ROOT

# `python -S`: no site-packages, so neither this checkout's editable install nor its dependencies
# are visible; only the installed wheel (on sys.path by hand) and the standard library.
PROBE = """
import sys
sys.path.insert(0, {target!r})
import meshplan
assert callable(meshplan.plan) and type(meshplan.plan).__name__ == "function", meshplan.plan
assert meshplan.__file__.startswith({target!r}), meshplan.__file__
for name in ("planner", "executor", "reports", "profiles"):
    try:
        __import__(name)
    except ModuleNotFoundError:
        pass
    else:
        raise SystemExit(f"import {{name}} worked after installing meshplan")
print(meshplan.load_cluster("h100-sxm").device.name)
from meshplan.cli import main
try:
    main(["--help"])
except SystemExit as exc:
    assert exc.code == 0, exc.code
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The wheel `pip install .` would install, unpacked into a target folder."""
    # Built from a copy: setuptools keeps a build/ folder beside the sources, and one left in the
    # checkout could ship modules that no longer exist.
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    for folder in PACKAGE_DIRS.values():
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("wheel")
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(out), str(source)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-2000:]
    wheel = next(out.glob("meshplan-*.whl"))
    target = tmp_path_factory.mktemp("site")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(target)
    return target


@pytest.mark.timeout(400)
def test_wheel_installs_one_meshplan_namespace(installed):
    top = sorted(p.name for p in installed.iterdir() if not p.name.endswith(".dist-info"))
    assert top == ["meshplan"]
    for package in ("planner", "executor", "reports", "profiles", "commands"):
        assert (installed / "meshplan" / package / "__init__.py").is_file(), package
    assert sorted(p.name for p in (installed / "meshplan" / "profiles").glob("*.toml")) == \
        sorted(p.name for p in (ROOT / "profiles").glob("*.toml"))
    # the published configs the deepseek-v3 / gpt-oss-* presets name
    assert sorted(p.name for p in (installed / "meshplan" / "planner" / "models" / "published").glob("*.json")) == \
        sorted(p.name for p in (ROOT / "planner" / "models" / "published").glob("*.json"))


@pytest.mark.timeout(400)
def test_installed_package_imports_and_answers_help_from_an_empty_directory(installed, tmp_path):
    result = subprocess.run([sys.executable, "-S", "-c", PROBE.format(target=str(installed))], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("H100 SXM5 80GB\n") and "usage: meshplan" in result.stdout
