"""Shared test helpers: run the CLI in-process and capture its exit code and output."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def run_cli(capsys):
    """run_cli(*argv) -> (exit_code, stdout, stderr), through the CLI's entry function."""
    from planner.cli import main

    def _run(*argv: str):
        code = main([str(a) for a in argv])
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return _run
