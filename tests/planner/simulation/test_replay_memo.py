"""Schedule replays memoised by shape (`simulation.replay_memo`), and handed from the search's
process to a solving worker forked before it replayed them: the worker then reads them instead of
replaying, and its ILP solution equals the parent's."""
from __future__ import annotations

from meshplan.planner.search.ilp.evaluation import live_vectors
from meshplan.planner.search.ilp.formulation import PipelineShape
from meshplan.planner.simulation import replay_memo
from meshplan.planner.simulation.factors import reduction_windows
from meshplan.planner.simulation.schedules import backwards_before_last_forward


def test_entries_are_the_shapes_results_and_load_serves_them():
    shape = ("zb-interleaved", 4, 8, 2)
    replay_memo.clear()
    expected = [live_vectors(PipelineShape(4, 8, 2, "zb-interleaved"), rank) for rank in range(4)]
    windows = reduction_windows(*shape)
    done = backwards_before_last_forward(*shape, None)
    found = replay_memo.entries(shape)
    assert {len(items) for items in found.values()} == {4, 1}  # a live-vector entry per rank; one each else
    assert all(args[:4] == shape for items in found.values() for args in items)
    # a fresh memo (as a worker forked before the replays has) serves what it was handed
    replay_memo.clear()
    assert replay_memo.entries(shape) == {}
    replay_memo.load(found)
    assert [live_vectors(PipelineShape(4, 8, 2, "zb-interleaved"), rank) for rank in range(4)] == expected
    assert reduction_windows(*shape) == windows and backwards_before_last_forward(*shape, None) == done


def test_a_loaded_result_is_read_not_recomputed():
    calls = []

    @replay_memo.memoised
    def replayed(schedule, pp, m, v):
        calls.append((schedule, pp, m, v))
        return pp * m * v

    replay_memo.load({f"{replayed.__module__}.{replayed.__qualname__}": {("1f1b", 2, 4, 1): -1}})
    assert replayed("1f1b", 2, 4, 1) == -1 and calls == []
    assert replayed("1f1b", 2, 8, 1) == 16 and replayed("1f1b", 2, 8, 1) == 16 and len(calls) == 1


def test_a_problem_solved_in_a_worker_with_the_shipped_replays_equals_the_parents():
    from meshplan.planner.costing.hardware import load_cluster
    from meshplan.planner.costing.tables import build_cost_table
    from meshplan.planner.profiling.profiler import profile
    from meshplan.planner.contracts.config import ParallelConfig
    from meshplan.planner.search.ilp.formulation import StageProblem, solve_stages
    from meshplan.planner.search.pool import worker_pool
    from meshplan.planner.search.solving import _solve_shipped, pipeline_shape

    graph = profile("gpt:layers=8,hidden=256,heads=4,vocab=4096", 512, dtype="bf16")
    config = ParallelConfig(gpus=16, global_batch=64, pp=4, dp=4, schedule="interleaved", virtual_stages=2)
    table = build_cost_table(graph, load_cluster("h100-sxm"), config)
    with worker_pool(2) as pool:  # forked before the parent replays the schedule below
        problem = StageProblem(table, pipeline_shape(config))
        here = solve_stages(problem)
        there = list(pool.map(_solve_shipped, [(problem, replay_memo.entries(problem.shape.replay_key))]))[0]
    assert there.feasible and there.objective_s == here.objective_s
    assert there.chunk_of_layer == here.chunk_of_layer
