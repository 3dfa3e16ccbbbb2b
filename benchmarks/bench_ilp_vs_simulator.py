"""The search's objective against the simulator, candidate by candidate: for the sampled candidates
of profiled models that tests/planner/search/test_ilp_vs_simulator.py asserts (every schedule,
unequal interleaved chunks and the V-shaped schedules at m = 2p included), the ILP's own objective
against the simulated step of the assignment it chose, and the refined assignment's objective
(the exact critical path, `planner.search.ilp.refine`) and per-rank memory against the simulated
step and memory of that assignment, with how much faster the refined assignment simulates.
Prints every candidate and the worst errors per case. Run: `python benchmarks/bench_ilp_vs_simulator.py [case ...]`.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshplan.planner.costing.hardware import load_cluster  # noqa: E402
from tests.planner.search.test_ilp_vs_simulator import CASES, ENGINE, PRECISION, _graph, _refined, simulate  # noqa: E402


def main(names: list[str]) -> None:
    print(f"{'case':<26} {'ILP':>7} {'search':>7} {'memory':>7} {'refined':>8}")
    for name in names or CASES:
        spec, seq, cluster_name, *_ = case = CASES[name]
        graph, cluster = _graph(spec, seq), load_cluster(cluster_name)  # the test's graph (its MTP depths)
        worst_ilp = worst_time = worst_memory = best_gain = 0.0
        for candidate, problem, solution, refined, predicted in _refined(*case, PRECISION.get(name, "bf16-mixed"),
                                                                         ENGINE.get(name, "meshplan")):
            ilp_step = simulate(graph, cluster, candidate, problem, solution).step_time_s
            ilp_error = solution.objective_s / ilp_step - 1
            time_error = refined.objective_s / predicted.step_time_s - 1
            memory_error = max(abs(ilp / sim.total - 1) for ilp, sim in zip(refined.rank_mem_bytes, predicted.memory))
            gain = predicted.step_time_s / ilp_step - 1
            worst_ilp = max(worst_ilp, abs(ilp_error))
            worst_time = max(worst_time, abs(time_error))
            worst_memory = max(worst_memory, memory_error)
            best_gain = min(best_gain, gain)
            print(f"  {candidate.label():<58} ILP {ilp_error:+7.2%}  search {time_error:+7.2%}  "
                  f"memory {memory_error:6.2%}  refined plan {gain:+7.2%}", flush=True)
        print(f"{name:<26} {worst_ilp:7.2%} {worst_time:7.2%} {worst_memory:7.2%} {best_gain:+8.2%}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
