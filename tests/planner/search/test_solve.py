"""The stage-assignment ILP against brute force, and the planner's behaviour on real cost tables.

Brute force enumerates every contiguous cut of the layers into chunks and every option of every
layer, and scores each with the objective and memory written out here from the maths (memory
peaks found by replaying the schedule's actions), independently of `planner.search.ilp.formulation`.
"""
from __future__ import annotations

import itertools
import math
import random
from dataclasses import replace

import pytest

from meshplan.planner.costing.tables import CostTable, LayerType, OptionCost
from meshplan.planner.search.bounds import bound_structure, compute_bound_s, memory_bound_s
from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.simulation.schedules import rank_actions
from meshplan.planner.search.ilp.formulation import PipelineShape, StageProblem, evaluate_assignment, solve_stages

# HiGHS solves to a relative gap of 1e-6 and its feasibility tolerance is 1e-7 on GiB-scaled
# rows; the brute force is exact, so objectives must agree to 1e-6 relative.
REL_TOL = 1e-6


def random_table(rng: random.Random, num_blocks: int, p2p_s: float = 0.0) -> CostTable:
    """Embedding + identical blocks (three recompute options) + head, with random costs."""
    grad_s = {}  # gradient reduction depends on the parameters, not on recomputation

    def option(recompute, time_s, act, static, buffer=0.0):
        return OptionCost(recompute=recompute, fwd_s=time_s / 3, bwd_s=2 * time_s / 3, static_bytes=static,
                          act_bytes=act, buffer_bytes=buffer, dp_comm_s=grad_s.setdefault(static, rng.uniform(0, 1.5)),
                          param_gather_s=rng.uniform(0, 0.05), optimizer_s=rng.uniform(0, 0.05))
    base_s, act = rng.uniform(0.5, 1.5), rng.uniform(1, 3) * 2**30
    static = rng.uniform(0.5, 2) * 2**30
    block = LayerType("block", (option("none", base_s, act, static),
                                option("selective", base_s * 1.1, act * 0.6, static),
                                option("full", base_s * 1.33, act * 0.1, static, buffer=act)))
    embed = LayerType("embed", (option("none", rng.uniform(0.1, 0.5), act * 0.2, 2 * static),))
    head = LayerType("head", (option("none", rng.uniform(0.5, 2), act, 2 * static),
                              option("full", rng.uniform(2, 3), act * 0.1, 2 * static, buffer=act)))
    names = ("embed",) + tuple(f"blocks.{i}" for i in range(num_blocks)) + ("head",)
    return CostTable(layer_names=names, layer_type=(0,) + (1,) * num_blocks + (2,), types=(embed, block, head),
                     p2p_s=p2p_s)


def brute_force_cost(problem: StageProblem, chunks, options, actions=None):
    """(objective, peak memory per rank) of one assignment, from the model's definition."""
    table, shape = problem.table, problem.shape
    actions = actions or schedule_actions(shape)
    pp, v, m, num_chunks = shape.num_stages, shape.virtual_stages, shape.num_microbatches, shape.num_chunks
    layer_opts = [table.option(i, o) for i, o in enumerate(options)]
    chunk_time = [sum(op.fwd_s + op.bwd_s for op, c in zip(layer_opts, chunks) if c == j) for j in range(num_chunks)]
    rank_time = [sum(chunk_time[j] for j in range(num_chunks) if j % pp == r) for r in range(pp)]
    tails = []
    for r in range(pp):
        mine = [op for op, c in zip(layer_opts, chunks) if c % pp == r]
        first = layer_opts[list(chunks).index(r)]  # its gradients come last: never hidden
        exposed = max(first.dp_comm_s, sum(op.dp_comm_s for op in mine) - sum(op.bwd_s for op in mine))
        tails.append(exposed + sum(op.param_gather_s + op.optimizer_s for op in mine))
    # Interleaved: chunks of T_max / v at most, not counting the first and last layer's time.
    even = list(chunk_time)
    even[0] -= layer_opts[0].fwd_s + layer_opts[0].bwd_s
    even[-1] -= layer_opts[-1].fwd_s + layer_opts[-1].bwd_s
    slowest = max(max(rank_time), v * max(even))
    if shape.schedule == "1f1b" and pp > 1 and m > 1 and table.p2p_s:  # 2P per micro-batch but on the bottleneck
        bottleneck = rank_time.index(max(rank_time))
        slowest = max([slowest] + [t + 2 * table.p2p_s for r, t in enumerate(rank_time) if r != bottleneck])
    # Transfers wait once each way per boundary in fill and drain.
    objective = (m - 1 / v) * slowest + sum(rank_time) / v + 2 * (num_chunks - 1) * table.p2p_s * (pp > 1) + max(tails)
    peaks = []
    for r in range(pp):
        mine = [(op, c) for op, c in zip(layer_opts, chunks) if c % pp == r]
        static = sum(op.static_bytes for op, _ in mine)
        buffer = max([op.buffer_bytes for op, _ in mine], default=0.0)
        act_of_chunk = {c: sum(op.act_bytes for op, cc in mine if cc == c) for _, c in mine}
        live, peak = 0.0, 0.0
        for action in actions[r]:
            live += act_of_chunk.get(action.chunk, 0.0) * (1 if action.kind == "F" else -1)
            peak = max(peak, live)
        peaks.append(static + peak + buffer)
    return objective, peaks


def schedule_actions(shape: PipelineShape):
    return [rank_actions(shape.schedule, shape.num_stages, shape.num_microbatches, shape.virtual_stages, r)
            for r in range(shape.num_stages)]


def all_assignments(problem: StageProblem, pinned_last: range = range(0)):
    """(objective, peak memory) of every contiguous assignment with every option choice (those
    with every layer of `pinned_last` in the last chunk)."""
    table, num_chunks = problem.table, problem.shape.num_chunks
    actions = schedule_actions(problem.shape)
    num_layers = table.num_layers
    option_ranges = [range(len(table.types[t].options)) for t in table.layer_type]
    out = []
    for cuts in itertools.combinations(range(1, num_layers), num_chunks - 1):
        bounds = (0,) + cuts + (num_layers,)
        chunks = [c for c in range(num_chunks) for _ in range(bounds[c], bounds[c + 1])]
        if any(chunks[layer] != num_chunks - 1 for layer in pinned_last):
            continue
        for options in itertools.product(*option_ranges):
            objective, peaks = brute_force_cost(problem, chunks, options, actions)
            out.append((objective, max(peaks)))
    return out


def brute_force(everything, mem_limit_bytes):
    return min((obj for obj, peak in everything if mem_limit_bytes is None or peak <= mem_limit_bytes),
               default=math.inf)


SHAPES = [PipelineShape(1, 4), PipelineShape(2, 4), PipelineShape(2, 3, schedule="gpipe"),
          PipelineShape(4, 4), PipelineShape(2, 4, 2, "interleaved"), PipelineShape(3, 3)]


@pytest.mark.parametrize("formulation", ["compact", "per-layer"])
@pytest.mark.parametrize("case", range(len(SHAPES)))
def test_ilp_matches_brute_force(case, formulation):
    rng = random.Random(100 + case)
    shape = SHAPES[case]
    table = random_table(rng, num_blocks=5, p2p_s=rng.choice([0.0, 0.05]))
    loose = StageProblem(table, shape, mem_limit_bytes=None, formulation=formulation, mip_rel_gap=1e-9)
    # A limit between the leanest and the fastest assignment makes memory bind.
    fastest = solve_stages(loose)
    lean = solve_stages(replace(loose, objective="memory"))
    limit = (max(fastest.rank_mem_bytes) + lean.objective_s) / 2
    everything = all_assignments(loose)
    for mem_limit in (None, limit):
        problem = replace(loose, mem_limit_bytes=mem_limit)
        solution = solve_stages(problem)
        expected = brute_force(everything, mem_limit)
        assert solution.status == "optimal" and solution.gap <= 1e-6
        assert solution.objective_s == pytest.approx(expected, rel=REL_TOL)
        # The linearisation is exact: the ILP's own objective equals the closed form of its choice.
        assert solution.model_objective == pytest.approx(solution.objective_s, rel=REL_TOL)
        objective, peaks = brute_force_cost(problem, solution.chunk_of_layer, solution.option_of_layer)
        assert objective == pytest.approx(solution.objective_s, rel=REL_TOL)
        if mem_limit is not None:
            assert max(peaks) <= mem_limit * (1 + 1e-6)
    assert solve_stages(replace(loose, mem_limit_bytes=limit)).objective_s > fastest.objective_s * (1 - 1e-9)


def with_mtp_depths(table: CostTable, depths: int, rng: random.Random) -> CostTable:
    """`table` with `depths` multi-token-prediction layers before its head (a block with more
    cost: Megatron-Core's MTP depth is a transformer layer plus its projection and norms)."""
    block = table.types[1]
    scale = rng.uniform(1.1, 1.5)
    mtp = LayerType("mtp", tuple(replace(o, fwd_s=o.fwd_s * scale, bwd_s=o.bwd_s * scale,
                                         static_bytes=o.static_bytes * scale, act_bytes=o.act_bytes * scale)
                                 for o in block.options))
    names = table.layer_names[:-1] + tuple(f"mtp.{i}" for i in range(depths)) + table.layer_names[-1:]
    layer_type = table.layer_type[:-1] + (3,) * depths + table.layer_type[-1:]
    return replace(table, layer_names=names, layer_type=layer_type, types=table.types + (mtp,))


@pytest.mark.parametrize("formulation", ["compact", "per-layer"])
@pytest.mark.parametrize("case", [1, 3, 4, 5])
def test_mtp_depths_stay_with_the_head_and_the_ilp_matches_brute_force(case, formulation):
    """Multi-token-prediction depths before the head (`CostTable.last_chunk_layers`) go to the
    last chunk in every assignment, as Megatron-Core builds them: the ILP's optimum equals the best
    of every contiguous assignment that keeps them there, with and without a binding memory limit."""
    rng = random.Random(300 + case)
    shape = SHAPES[case]
    table = with_mtp_depths(random_table(rng, num_blocks=5, p2p_s=rng.choice([0.0, 0.05])), 1 + case % 2, rng)
    assert table.last_chunk_layers == 2 + case % 2
    loose = StageProblem(table, shape, mem_limit_bytes=None, formulation=formulation, mip_rel_gap=1e-9)
    last = shape.num_chunks - 1
    pinned = range(table.num_layers - table.last_chunk_layers, table.num_layers)
    everything = all_assignments(loose, pinned)
    fastest = solve_stages(loose)
    limit = (max(fastest.rank_mem_bytes) + min(peak for _, peak in everything)) / 2
    for mem_limit in (None, limit):
        solution = solve_stages(replace(loose, mem_limit_bytes=mem_limit))
        expected = brute_force(everything, mem_limit)
        assert solution.status == "optimal" and solution.formulation == formulation
        assert all(solution.chunk_of_layer[layer] == last for layer in pinned)
        assert solution.objective_s == pytest.approx(expected, rel=REL_TOL)
        # the search's bounds, with the depths pinned as edge layers, stay below the optimum
        assert memory_bound_s(table, shape, mem_limit, bound_structure(table)) <= expected * (1 + REL_TOL)
        assert compute_bound_s(table, shape) <= expected * (1 + REL_TOL)


@pytest.mark.parametrize("case", [1, 3, 5])
def test_the_last_rank_s_pinned_depths_bound_the_slowest_rank(case):
    """Heavy multi-token-prediction depths pinned with the head: the last rank runs them whatever
    else it holds, so T_max is at least their time, which the bounds charge at the pipeline's
    weight; both stay below the brute-force optimum, and the compute bound now sits above what
    S / p alone gave."""
    rng = random.Random(500 + case)
    shape = SHAPES[case]
    table = with_mtp_depths(random_table(rng, num_blocks=5, p2p_s=0.0), 2, rng)
    mtp = table.types[3]
    heavy = LayerType("mtp", tuple(replace(o, fwd_s=o.fwd_s * 6, bwd_s=o.bwd_s * 6) for o in mtp.options))
    table = replace(table, types=table.types[:3] + (heavy,))
    loose = StageProblem(table, shape, mem_limit_bytes=None, formulation="per-layer", mip_rel_gap=1e-9)
    pinned = range(table.num_layers - table.last_chunk_layers, table.num_layers)
    expected = brute_force(all_assignments(loose, pinned), None)
    pinned_s = sum(table.types[table.layer_type[layer]].min_time_s() for layer in pinned)
    slowest_weight, sum_weight = shape.weights
    total = table.fastest_sum_s + table.chunk_overhead_s * shape.num_chunks
    assert pinned_s > total / shape.num_stages  # the depths alone outweigh an even share
    bound = compute_bound_s(table, shape)
    assert bound >= slowest_weight * pinned_s + sum_weight * total - 1e-12
    assert bound <= expected * (1 + REL_TOL)
    assert memory_bound_s(table, shape, None, bound_structure(table)) <= expected * (1 + REL_TOL)


def test_memory_objective_matches_brute_force():
    rng = random.Random(7)
    table = random_table(rng, num_blocks=5)
    problem = StageProblem(table, PipelineShape(2, 4, 2, "interleaved"), objective="memory", formulation="compact",
                           mip_rel_gap=1e-9)
    solution = solve_stages(problem)
    best = min(peak for _, peak in all_assignments(problem))
    assert solution.objective_s == pytest.approx(best, rel=REL_TOL)


def test_infeasible_memory_is_reported_with_binding_rows():
    table = random_table(random.Random(3), num_blocks=4)
    problem = StageProblem(table, PipelineShape(2, 4), mem_limit_bytes=1.0)
    assert solve_stages(problem).status == "infeasible"
    lean = solve_stages(replace(problem, objective="memory", mem_limit_bytes=None))
    at_limit = solve_stages(replace(problem, mem_limit_bytes=lean.objective_s * (1 + 1e-9)))
    assert at_limit.feasible and any(name.startswith("mem_") for name in at_limit.binding)


def test_compact_and_per_layer_agree_on_larger_model():
    """16 blocks on 4 stages: too many assignments for brute force, so the formulations check each other."""
    table = random_table(random.Random(11), num_blocks=14)
    compact = StageProblem(table, PipelineShape(4, 8), formulation="compact", mip_rel_gap=1e-9)
    lean = solve_stages(replace(compact, objective="memory")).objective_s
    fastest = max(solve_stages(compact).rank_mem_bytes)
    compact = replace(compact, mem_limit_bytes=(lean + fastest) / 2)
    a = solve_stages(compact)
    b = solve_stages(replace(compact, formulation="per-layer"))
    assert a.formulation == "compact" and b.formulation == "per-layer"
    assert a.objective_s == pytest.approx(b.objective_s, rel=REL_TOL)


def test_evaluate_assignment_closed_form_on_uniform_pipeline():
    """Balanced 1F1B stages of time T: (m + p - 1) T, plus the slowest rank's optimizer tail."""
    option = OptionCost(recompute="none", fwd_s=1.0, bwd_s=2.0, static_bytes=0, act_bytes=1.0, optimizer_s=0.5)
    table = CostTable(layer_names=tuple("abcd"), layer_type=(0, 0, 0, 0), types=(LayerType("t", (option,)),))
    problem = StageProblem(table, PipelineShape(4, 8))
    objective, _, memory = evaluate_assignment(problem, (0, 1, 2, 3), (0, 0, 0, 0))
    assert objective == pytest.approx((8 + 4 - 1) * 3.0 + 0.5)
    assert memory == (4.0, 3.0, 2.0, 1.0)  # 1F1B: rank k holds min(m, p - k) micro-batches


def test_compact_formulation_plans_80_blocks_quickly():
    """The note in the requirement: per-layer binaries do not scale; counts per stage do."""
    table = random_table(random.Random(5), num_blocks=80)
    problem = StageProblem(table, PipelineShape(8, 64), formulation="compact")
    lean = solve_stages(replace(problem, objective="memory")).objective_s
    solution = solve_stages(replace(problem, mem_limit_bytes=lean * 1.5))
    assert solution.status == "optimal" and solution.formulation == "compact"
    assert solution.gap <= problem.mip_rel_gap + 1e-12
    assert solution.solve_time_s < 10.0  # measured ~2 s; generous for a shared 2-core machine
    assert sorted(set(solution.chunk_of_layer)) == list(range(8))
    assert max(solution.rank_mem_bytes) <= lean * 1.5 * (1 + 1e-6)


def test_pins_and_bad_input_raise_meshplan_errors():
    from meshplan.planner.search.candidates import Pins

    with pytest.raises(MeshplanError, match="--zero"):
        Pins(zero=5)
    with pytest.raises(MeshplanError, match="--tp"):
        Pins(tp=0)
    with pytest.raises(ValueError, match="chunks"):
        StageProblem(random_table(random.Random(1), 2), PipelineShape(4, 4, 2, "interleaved"))


# --------------------------------------------------------------------------------------------
# The whole planner on a small GPT, real cost model and simulator

SPEC = "gpt:layers=8,hidden=1024,heads=16,vocab=32000"
SEQ = 1024


@pytest.fixture(scope="module")
def small_graph():
    from meshplan.planner.profiling.profiler import profile

    return profile(SPEC, SEQ, batch=1, dtype="bf16", attention="flash")


def cluster_with_memory(mem_bytes: float | None = None, name: str = "a100-80g"):
    from meshplan.planner.costing.hardware import load_cluster

    cluster = load_cluster(name)
    if mem_bytes is None:
        return cluster
    device = replace(cluster.device, memory_bytes=mem_bytes + cluster.device.reserved_memory_bytes)
    return replace(cluster, device=device, name=f"{name}-{mem_bytes / 2**30:.2f}GiB")


def run_plan(graph, cluster, gpus=8, gbs=32, **kwargs):
    from meshplan import plan

    kwargs.setdefault("workers", 1)
    return plan(SPEC, cluster, gpus, gbs, SEQ, graph=graph, **kwargs)


def test_winner_is_the_best_simulated_of_the_top_k(small_graph):
    result = run_plan(small_graph, cluster_with_memory(), top_k=4)
    assert result.prediction["fits"]
    # the top-k's runners-up, each of its own structure (those of the winner's shape fold into it:
    # here every simulated one is pp=1 dp=8), then the conventional layout
    assert 1 <= len(result.alternatives) <= 4 and result.alternatives[-1]["conventional"]
    shapes = [(a["mesh"]["pp"], a["mesh"]["dp"], a["mesh"]["tp"], a["schedule"]["name"] if a["mesh"]["pp"] > 1 else "")
              for a in [result.to_json(), *result.alternatives[:-1]]]
    assert len(set(shapes)) == len(shapes)  # mesh shape or schedule differ (1f1b and gpipe are one family)
    for alt in result.alternatives:
        assert alt["why_not"]
        assert result.prediction["step_time_s"] <= alt["prediction"]["step_time_s"] or not alt["prediction"]["fits"]
    # The recorded prediction is what simulating the written plan gives.
    from meshplan.planner.simulation.simulator import simulate

    again = simulate(result, graph=small_graph, timeline=False)
    assert again.step_time_s == pytest.approx(result.prediction["step_time_s"], rel=1e-9)


def test_tight_memory_needs_zero_recompute_or_pipeline_loose_memory_plain_dp(small_graph):
    loose = run_plan(small_graph, cluster_with_memory(1e15), top_k=2)
    cfg = loose.config
    assert (cfg.pp, cfg.tp, cfg.dp) == (1, 1, 8)  # plain data parallelism
    assert all(layer.recompute == "none" for layer in loose.layers)
    # Half of what the loose winner needs: it no longer fits, so the planner must trade time for memory.
    tight_bytes = 0.5 * loose.prediction["peak_memory_bytes"]
    tight = run_plan(small_graph, cluster_with_memory(tight_bytes), top_k=2)
    t = tight.config
    assert tight.prediction["fits"] and tight.prediction["peak_memory_bytes"] <= tight_bytes
    recomputed = sum(layer.recompute != "none" for layer in tight.layers)
    assert t.zero > cfg.zero or recomputed or t.pp > 1 or t.tp > 1 or t.microbatch_size < cfg.microbatch_size
    assert tight.prediction["step_time_s"] >= loose.prediction["step_time_s"] * (1 - 1e-9)


def test_pins_are_respected(small_graph):
    pins = dict(tp=2, pp=2, zero=1, schedule="interleaved", vpp=2, mbs=2, recompute="selective")
    result = run_plan(small_graph, cluster_with_memory(), top_k=3, **pins)
    for entry in [result.to_json()] + list(result.alternatives):
        assert entry["mesh"]["tp"] == 2 and entry["mesh"]["pp"] == 2 and entry["zero"] == 1
        assert entry["schedule"]["name"] == "interleaved" and entry["schedule"]["virtual_stages"] == 2
        assert entry["schedule"]["microbatch_size"] == 2
    assert {layer.recompute for layer in result.layers if layer.name.startswith("blocks")} == {"selective"}


def test_same_inputs_same_plan(small_graph):
    from meshplan.planner.search.assembly import WALL_CLOCK_KEYS

    def strip(plan):
        data = plan.to_json()
        data["solver"] = {k: v for k, v in data["solver"].items() if k not in WALL_CLOCK_KEYS}
        return data
    first = run_plan(small_graph, cluster_with_memory(8 * 2**30), workers=1)
    second = run_plan(small_graph, cluster_with_memory(8 * 2**30), workers=2)
    assert strip(first) == strip(second)
    assert first.digest == second.digest


def test_infeasible_request_says_what_would_work(small_graph):
    from meshplan.planner.search.candidates import Pins, enumerate_candidates
    from meshplan.planner.search.infeasible import min_memory_bytes

    cluster = cluster_with_memory()
    lean_2 = min_memory_bytes(small_graph, cluster, enumerate_candidates(small_graph, cluster, 2, 8), 8,
                              "bf16-mixed", Pins())
    with pytest.raises(MeshplanError) as err:  # on the GPUs alone (unpinned, the search would offload)
        run_plan(small_graph, cluster_with_memory(0.7 * lean_2), gpus=2, gbs=8, offload="none")
    message = str(err.value)
    # Both answers: the memory that would do on 2 GPUs (rounded up to 1/1000 GiB), and a GPU count.
    needed_gib = float(message.split("needs ")[1].split(" GiB")[0])
    assert needed_gib == pytest.approx(lean_2 / 2**30, rel=2e-3)  # the planner's 0.1% margin, rounding
    more_gpus = int(message.split("--gpus ")[1].split(")")[0])
    assert more_gpus in (4, 8)
    # Both really work, with exactly the memory printed.
    assert run_plan(small_graph, cluster_with_memory(needed_gib * 2**30), gpus=2, gbs=8, top_k=1).prediction["fits"]
    assert run_plan(small_graph, cluster_with_memory(0.7 * lean_2), gpus=more_gpus, gbs=8, top_k=1,
                    offload="none").prediction["fits"]


def test_lower_bound_never_exceeds_the_ilp_objective(small_graph):
    from meshplan.planner.search.candidates import Pins, enumerate_candidates
    from meshplan.planner.search.problems import build_problems
    from meshplan.planner.search.solving import lower_bound_s, solve_candidates

    cluster = cluster_with_memory()
    candidates = enumerate_candidates(small_graph, cluster, 8, 32, Pins(zero=1, sp=False))[::5]
    problems, _, _ = build_problems(small_graph, cluster, candidates, 32, "bf16-mixed", Pins(), 1e15, False, 10.0)
    solved = solve_candidates(problems, num_keep=len(problems) + 1, workers=1)
    assert len(solved) == len(problems) > 5
    for item in solved:
        assert item.solution.feasible
        assert item.lower_bound_s <= item.solution.objective_s * (1 + 1e-9)
    del lower_bound_s


def test_layerwise_plan_is_marked_not_executable(small_graph):
    result = run_plan(small_graph, cluster_with_memory(), layerwise=True, top_k=2, pp=1)
    per_stage = result.config.tp * result.config.dp
    assert all(layer.tp * layer.dp == per_stage for layer in result.layers)
    if any((layer.tp, layer.dp) != (result.config.tp, result.config.dp) for layer in result.layers):
        assert not result.executable and "layerwise" in result.not_executable_reason
    else:
        assert result.executable


@pytest.mark.parametrize("schedule,pp,m,vpp", [("1f1b", 4, 8, 1), ("gpipe", 4, 8, 1), ("interleaved", 4, 8, 2),
                                                ("interleaved", 4, 16, 4), ("interleaved", 8, 8, 4)])
def test_objective_bubble_is_what_the_simulator_plays(schedule, pp, m, vpp):
    """For balanced stages the ILP's (m - 1/v) T + p T / v equals the simulated schedule exactly."""
    from meshplan.planner.search.ilp.formulation import pipeline_factor

    assert pipeline_factor(schedule, pp, m, vpp) == pytest.approx(m + (pp - 1) / vpp, rel=1e-12)


def test_cbc_fallback_agrees_with_highs():
    table = random_table(random.Random(21), num_blocks=5)
    problem = StageProblem(table, PipelineShape(2, 4), formulation="per-layer", mip_rel_gap=1e-9)
    limit = solve_stages(replace(problem, objective="memory")).objective_s * 1.3
    highs = solve_stages(replace(problem, mem_limit_bytes=limit))
    cbc = solve_stages(replace(problem, mem_limit_bytes=limit, backend="cbc"))
    assert cbc.backend == "cbc" and cbc.status == "optimal"
    assert cbc.objective_s == pytest.approx(highs.objective_s, rel=REL_TOL)
