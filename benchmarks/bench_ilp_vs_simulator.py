"""The ILP against the simulator, candidate by candidate: for sampled candidates of profiled models
(the cases tests/planner/search/test_ilp_vs_simulator.py asserts within 2%, and the known gaps it
does not: interleaved chunks of unequal size, when the layers do not divide evenly over the
chunks), the ILP's objective and per-rank memory for the assignment it chose against the
simulator's step time and memory for that assignment. Prints every candidate and the worst
error per case. Run: `python benchmarks/bench_ilp_vs_simulator.py`.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshplan.planner.search.candidates import Pins  # noqa: E402
from tests.planner.search.test_ilp_vs_simulator import CASES, _solved  # noqa: E402

KNOWN_GAPS = {
    "llama3-70b-interleaved": ("llama3-70b", 8192, "h100-sxm", 512, 512, Pins(tp=8, pp=4, schedule="interleaved"), 6),
    "llama3-405b-interleaved": ("llama3-405b", 8192, "h100-sxm", 2048, 512,
                                Pins(tp=8, pp=16, schedule="interleaved"), 6),
    "small-gpt-interleaved": ("gpt:layers=24,hidden=1024,heads=16,vocab=32000", 1024, "a100-80g", 16, 256,
                              Pins(pp=4, schedule="interleaved"), 8),
}


def main() -> None:
    for title, cases in (("asserted within 2% (time) and 1% (memory)", CASES), ("known gaps", KNOWN_GAPS)):
        print(f"== {title}")
        for name, case in cases.items():
            worst_time = worst_memory = 0.0
            for candidate, solution, predicted in _solved(*case):
                time_error = solution.objective_s / predicted.step_time_s - 1
                memory_error = max(abs(ilp / sim.total - 1) for ilp, sim in zip(solution.rank_mem_bytes,
                                                                                 predicted.memory))
                worst_time, worst_memory = max(worst_time, abs(time_error)), max(worst_memory, memory_error)
                print(f"  {candidate.label():<55} ILP {solution.objective_s:9.3f} s  simulated "
                      f"{predicted.step_time_s:9.3f} s  {time_error:+7.2%}  memory {memory_error:6.2%}")
            print(f"{name}: worst time {worst_time:.2%}, worst memory {worst_memory:.2%}")


if __name__ == "__main__":
    main()
