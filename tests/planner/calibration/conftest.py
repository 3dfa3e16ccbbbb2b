"""The benchmarks' published runs and efficiency fit, importable by the tests here."""
import importlib
import sys
from pathlib import Path

import pytest

BENCHMARKS_DIR = Path(__file__).resolve().parents[3] / "benchmarks"


@pytest.fixture(scope="module")
def modules():
    """(published_runs, fit_efficiency), with benchmarks/ on the import path while a module runs."""
    sys.path.insert(0, str(BENCHMARKS_DIR))
    try:
        yield importlib.import_module("published_runs"), importlib.import_module("fit_efficiency")
    finally:
        sys.path.remove(str(BENCHMARKS_DIR))
