"""Running one candidate's ILP: HiGHS in process (with a heuristic start), CBC as the fallback,
and the real status, gap and backend of the run."""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: planner.search.ilp.formulation imports this module
    from meshplan.planner.search.ilp.formulation import StageProblem


def start_values(lp, start) -> dict[str, float]:
    """Variable name -> value of a heuristic start (integer decisions only; HiGHS completes it)."""
    counts, pinned_options = start
    values = {f"n_{c}_{o}": float(n) for c, row in enumerate(counts) for o, n in enumerate(row)}
    for layer, option in pinned_options.items():
        names = [name for name in lp.variablesDict() if name.startswith(f"w_{layer}_")]
        values.update({name: float(name == f"w_{layer}_{option}") for name in names})
    return values


@contextlib.contextmanager
def _quiet_stdout():
    """Point file descriptor 1 at /dev/null (C-level prints included), then restore it."""
    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def import_pulp():
    """`import pulp` with Ctrl-C held back until it is done: pulp probes its solvers under bare
    `except:` clauses, which would swallow a KeyboardInterrupt and let the command run on."""
    import signal

    if "pulp" in sys.modules:
        return sys.modules["pulp"]
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        import pulp
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)  # a Ctrl-C that waited is raised here
    return pulp


def run_solver(lp, problem: StageProblem, start: dict[str, float] | None = None) -> tuple[str, float, str]:
    """Solve with HiGHS (highspy, in process) or CBC; return (real status, relative gap, backend).

    `start`: values of some integer variables by name, handed to HiGHS as a partial solution."""
    pulp = import_pulp()

    class _HighsWithStart(pulp.HiGHS):
        def callSolver(self, lp_):
            if start:
                import numpy as np

                index = {var.name: var.index for var in lp_.variables()}
                names = [name for name in start if name in index]
                lp_.solverModel.setSolution(len(names), np.array([index[n] for n in names], dtype=np.int32),
                                            np.array([start[n] for n in names], dtype=np.float64))
            super().callSolver(lp_)

    options = {} if problem.cutoff_s is None else {"objective_bound": float(problem.cutoff_s)}
    highs = _HighsWithStart(msg=False, timeLimit=problem.time_limit_s, threads=1, gapRel=problem.mip_rel_gap,
                            **options)
    if problem.backend == "highs" and highs.available():
        with _quiet_stdout():  # HiGHS prints its banner on stdout once per process, despite msg=False
            lp.solve(highs)
        info = lp.solverModel.getInfo()
        model_status = lp.solverModel.getModelStatus()
        import highspy

        if model_status == highspy.HighsModelStatus.kOptimal:
            return "optimal", max(0.0, float(info.mip_gap)) if info.mip_gap < 1e30 else 0.0, "highs"
        if model_status in (highspy.HighsModelStatus.kInfeasible, highspy.HighsModelStatus.kUnboundedOrInfeasible,
                            highspy.HighsModelStatus.kObjectiveBound):
            # With a cutoff, "infeasible" means nothing beats the cutoff.
            return ("infeasible" if problem.cutoff_s is None else "cutoff"), 0.0, "highs"
        if lp.sol_status == pulp.LpSolutionIntegerFeasible:
            return "time_limit", float(info.mip_gap), "highs"
        return "no_solution", 0.0, "highs"
    with tempfile.TemporaryDirectory(prefix="meshplan-ilp-") as tmp:
        cbc = pulp.PULP_CBC_CMD(msg=False, timeLimit=problem.time_limit_s, gapRel=problem.mip_rel_gap, keepFiles=False)
        cbc.tmpDir = tmp
        lp.solve(cbc)
    if lp.sol_status == pulp.LpSolutionOptimal:
        return "optimal", 0.0, "cbc"
    if lp.sol_status == pulp.LpSolutionIntegerFeasible:
        return "time_limit", float("nan"), "cbc"  # CBC through pulp does not report its bound
    if lp.status == pulp.LpStatusInfeasible or lp.sol_status == pulp.LpSolutionInfeasible:
        return "infeasible", 0.0, "cbc"
    return "no_solution", 0.0, "cbc"
