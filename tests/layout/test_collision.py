"""A user project with its own `executor/`, `reports/` and `planner/` packages in the working
directory: `meshplan train` (whose workers start with `python -m meshplan.executor.worker` from
that directory) and `meshplan report` must still use meshplan's own code."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshplan.executor.plans import uniform_plan
from meshplan.planner.contracts.plan import save_plan
from meshplan.planner.costing.hardware import load_cluster

SPEC = "gpt:layers=2,hidden=32,heads=2,vocab=64"


def _meshplan(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    command = [str(Path(sys.executable).with_name("meshplan")), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_train_and_report_ignore_same_named_packages_in_the_working_directory(tmp_path):
    project = tmp_path / "project"
    for name in ("executor", "reports", "planner", "profiles"):
        (project / name).mkdir(parents=True)
        (project / name / "__init__.py").write_text(f"raise ImportError('the user project\\'s own {name} was imported')\n")
    plan = uniform_plan(SPEC, 16, 4, load_cluster("cpu"), dp=2, microbatch_size=1, seed=3)
    save_plan(plan, project / "plan.json")

    trained = _meshplan("train", "--plan", "plan.json", "--steps", "3", "--out", "measured.json", cwd=project)
    assert trained.returncode == 0, trained.stderr[-3000:]
    measured = json.loads((project / "measured.json").read_text())
    assert measured["world_size"] == 2 and len(measured["losses"]) == 3

    reported = _meshplan("report", "--plan", "plan.json", "--measured", "measured.json", "--out", "report.html",
                         cwd=project)
    assert reported.returncode == 0, reported.stderr[-3000:]
    assert "<html" in (project / "report.html").read_text()[:2000].lower()
