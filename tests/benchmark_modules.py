"""The benchmarks' modules (published runs, fits, checks), importable by the tests: `benchmarks/`
is on the import path while one is imported, so its sibling imports resolve, and off it after."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def benchmark_module(name: str):
    """`benchmarks/<name>.py`, imported (once; later calls return the same module)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))
