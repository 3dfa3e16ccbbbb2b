"""Shared fixtures of the cost-model tests: the H100 SXM profile and a Llama 3 8B block."""
from __future__ import annotations

import pytest

from meshplan.planner.costing.hardware import load_cluster
from meshplan.planner.profiling.profiler import profile

LLAMA_SEQ = 8192


@pytest.fixture(scope="session")
def h100():
    return load_cluster("h100-sxm")


@pytest.fixture(scope="session")
def llama():
    """Llama 3 8B's first transformer block at 8,192 tokens, and its model info."""
    graph = profile("llama3-8b", LLAMA_SEQ)
    return next(layer for layer in graph.layers if layer.kind == "block"), graph.info
