"""The documented Python API: planner.<function>(...) works however the submodules were imported."""
import subprocess
import sys

import pytest


@pytest.mark.timeout(120)
def test_public_functions_callable_before_and_after_submodule_import():
    # A fresh interpreter: the behaviour depends on import order, which this test controls.
    code = """
import meshplan.planner
cluster = planner.load_cluster("cpu")
graph = planner.profiling.profiler("gpt:layers=2,hidden=64,heads=4,vocab=128", 32)
import planner.profiling.profiler, planner.simulation.simulator, planner.simulation.estimator, planner.contracts.plan
graph2 = planner.profiling.profiler("gpt:layers=2,hidden=64,heads=4,vocab=128", 32)
assert graph2.total_params == graph.total_params > 0
from meshplan.planner.contracts.config import ParallelConfig
pred = planner.simulation.simulator.simulate_config(graph, cluster, ParallelConfig(gpus=1, global_batch=2, precision="fp32"))
assert pred.step_time_s > 0
assert planner.contracts.plan.Plan is not None and callable(planner.contracts.plan) and callable(planner.simulation.estimator)
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=110)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("ok")
