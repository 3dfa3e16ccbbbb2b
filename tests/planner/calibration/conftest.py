"""The benchmarks' published runs and efficiency fit, importable by the tests here."""
import pytest

from tests.benchmark_modules import benchmark_module


@pytest.fixture(scope="module")
def modules():
    """(published_runs, fit_efficiency), from benchmarks/ (`tests.benchmark_modules`)."""
    return benchmark_module("published_runs"), benchmark_module("fit_efficiency")
