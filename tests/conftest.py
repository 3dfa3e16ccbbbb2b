"""Shared test helpers: run the CLI in-process and capture its exit code and output."""
from __future__ import annotations

import os
import tempfile

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Profiles are cached on disk; tests use a cache of their own so they never read a stale user
# cache nor write into the user's home.
os.environ["MESHPLAN_CACHE_DIR"] = tempfile.mkdtemp(prefix="meshplan-test-cache-")


@pytest.fixture
def run_cli(capsys):
    """run_cli(*argv) -> (exit_code, stdout, stderr), through the CLI's entry function."""
    from meshplan.cli import main

    def _run(*argv: str):
        code = main([str(a) for a in argv])
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return _run


@pytest.fixture
def no_launch(monkeypatch):
    """Replace the torchrun launch by a stub that records the call and stops there (exit 2)."""
    from meshplan.executor import launch
    from meshplan.planner.contracts.errors import MeshplanError

    calls = []

    def stub(jobs, nproc, *args, **kwargs):
        calls.append(nproc)
        raise MeshplanError("stopped at the launch by the test stub")

    monkeypatch.setattr(launch, "launch_jobs", stub)
    return calls



@pytest.fixture
def without_eager_count(monkeypatch):
    """Eager engines' blocks and torch's loss priced by the fused-kernel rule (`costing.eager_kernels`
    and `loss_kernels.TORCH_LOSS_ENGINES` set aside, each tested on its own): for tests of another
    mechanism that compare meshplan's executor with other engines."""
    from meshplan.planner.costing import eager_kernels, loss_kernels

    monkeypatch.setattr(eager_kernels, "counts_eager_kernels", lambda *args, **kwargs: False)
    monkeypatch.setattr(loss_kernels, "TORCH_LOSS_ENGINES", ())
