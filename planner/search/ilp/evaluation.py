"""Closed-form evaluation of a stage assignment and a heuristic starting point for the ILP.

`evaluate_assignment` computes the objective and per-rank memory that `planner.search.ilp.formulation`'s ILP
models, directly from an assignment (the ILP's answer is re-scored with it, and tests compare the
two). `pipeline_factor` plays a schedule with unit costs in the simulator to check the textbook
bubble. `heuristic_start` builds a feasible compact assignment for the MIP to start from.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: planner.search.ilp.formulation imports this module
    from meshplan.planner.costing.tables import CostTable
    from meshplan.planner.search.ilp.formulation import PipelineShape, StageProblem

def live_vectors(shape: PipelineShape, rank: int) -> list[tuple[int, ...]]:
    """Per-virtual-stage live micro-batch counts at each memory peak of `rank` (dominated removed)."""
    from meshplan.planner.simulation.schedules import rank_actions

    actions = rank_actions(shape.schedule, shape.num_stages, shape.num_microbatches, shape.virtual_stages, rank)
    live = [0] * shape.virtual_stages
    peaks: set[tuple[int, ...]] = set()
    for index, action in enumerate(actions):
        local = action.chunk // shape.num_stages
        live[local] += 1 if action.kind == "F" else -1
        nxt = actions[index + 1] if index + 1 < len(actions) else None
        if action.kind == "F" and (nxt is None or nxt.kind == "B"):
            peaks.add(tuple(live))
    return sorted(v for v in peaks
                  if not any(w != v and all(a >= b for a, b in zip(w, v)) for w in peaks))


def evaluate_assignment(problem: StageProblem, chunk_of_layer, option_of_layer, peaks=None):
    """(objective_s, chunk_time_s, rank_mem_bytes) of one assignment, by the formulas above.

    `peaks`: `live_vectors` of every rank, if already computed."""
    table, shape = problem.table, problem.shape
    pp, num_chunks, v, m = shape.num_stages, shape.num_chunks, shape.virtual_stages, shape.num_microbatches
    chunk_time = [table.p2p_s * ((c > 0) + (c < num_chunks - 1)) for c in range(num_chunks)]
    chunk_act = [0.0] * num_chunks
    static, buffer, grad_comm, bwd, tail = ([0.0] * pp for _ in range(5))
    for layer, (chunk, index) in enumerate(zip(chunk_of_layer, option_of_layer)):
        option = table.option(layer, index)
        rank = chunk % pp
        chunk_time[chunk] += option.time_s + _reshard(table, layer, chunk_of_layer, option_of_layer)
        chunk_act[chunk] += option.act_bytes
        static[rank] += option.static_bytes
        buffer[rank] = max(buffer[rank], option.buffer_bytes)
        grad_comm[rank] += option.dp_comm_s
        bwd[rank] += option.bwd_s
        tail[rank] += option.param_gather_s + option.optimizer_s
    rank_time = [sum(chunk_time[c] for c in range(r, num_chunks, pp)) for r in range(pp)]
    first = [chunk_of_layer.index(r) for r in range(pp)]  # a rank's first layer: its last gradients
    never_hidden = [table.option(first[r], option_of_layer[first[r]]).dp_comm_s for r in range(pp)]
    exposed = [max(never_hidden[r], grad_comm[r] - (bwd[r] if problem.overlap_dp else 0.0)) + tail[r]
               for r in range(pp)]
    slowest_weight, sum_weight = shape.weights
    slowest = max(max(rank_time), v * max(chunk_time))
    objective = slowest_weight * slowest + sum_weight * sum(rank_time) + max(exposed)
    rank_mem = []
    for r in range(pp):
        rank_peaks = peaks[r] if peaks is not None else live_vectors(shape, r)
        act = max(sum(live[j] * chunk_act[j * pp + r] for j in range(v)) for live in rank_peaks)
        rank_mem.append(static[r] + act + buffer[r])
    return objective, tuple(chunk_time), tuple(rank_mem)


def _reshard(table: CostTable, layer: int, chunk_of_layer, option_of_layer) -> float:
    """Resharding before `layer` when its (tp, dp) differs from the previous layer's in its chunk."""
    if layer == 0 or chunk_of_layer[layer - 1] != chunk_of_layer[layer] or not table.reshard_s:
        return 0.0
    here, before = table.option(layer, option_of_layer[layer]), table.option(layer - 1, option_of_layer[layer - 1])
    return 2 * table.reshard_s if (here.tp, here.dp) != (before.tp, before.dp) else 0.0


def pipeline_factor(schedule: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> float:
    """Step time of balanced stages in units of one rank's per-micro-batch time, as simulated.

    The textbook interleaved bubble (p - 1) / v assumes Megatron-LM's schedule with many
    micro-batches; torch's interleaved 1F1B with m close to p runs most forwards before any
    backward and idles far longer. Playing the real schedule once with unit costs (forward 1,
    backward 2 per chunk, nothing else) gives the factor F, and the ILP uses
    (F - p/v) T_max + sum_r T_r / v, which is exact for balanced stages and reduces to the
    textbook form where the schedule achieves it.
    """
    from meshplan.planner.contracts.config import ParallelConfig
    from meshplan.planner.costing.layer_costs import LayerCost
    from meshplan.planner.simulation.engine import StepCosts, simulate_step

    config = ParallelConfig(gpus=num_stages, global_batch=num_microbatches, pp=num_stages, schedule=schedule,
                            virtual_stages=virtual_stages)
    unit = LayerCost(fwd_compute_s=1.0, bwd_compute_s=2.0, recompute_s=0.0, tp_fwd_comm_s=0.0, tp_bwd_comm_s=0.0,
                     zero3_gather_s=0.0, dp_grad_comm_s=0.0, dp_param_gather_s=0.0, optimizer_step_s=0.0,
                     param_bytes=0.0, grad_bytes=0.0, optimizer_bytes=0.0, activation_bytes=0.0, buffer_bytes=0.0,
                     output_bytes=0.0)
    num_chunks = num_stages * virtual_stages
    costs = StepCosts(config=config, layer_costs=(unit,) * num_chunks, chunk_of_layer=tuple(range(num_chunks)))
    return simulate_step(costs).step_time_s / (3.0 * virtual_stages)


def heuristic_start(problem: StageProblem, structure: tuple[int, int, int]):
    """A feasible compact assignment to start the MIP from, or None: run layers spread so chunk
    times are even (fastest option), then, rank by rank while over the memory limit, the layer
    in the chunk with the most live micro-batches switched to the leanest option."""
    table, shape = problem.table, problem.shape
    first, count, type_index = structure
    options = table.types[type_index].options
    fast = min(range(len(options)), key=lambda o: (options[o].time_s, o))
    lean = min(range(len(options)), key=lambda o: (options[o].act_bytes, options[o].time_s, o))
    num_chunks, pp = shape.num_chunks, shape.num_stages
    const = [table.p2p_s * ((c > 0) + (c < num_chunks - 1)) for c in range(num_chunks)]
    if first == 1:
        const[0] += table.types[table.layer_type[0]].min_time_s()
    if first + count < table.num_layers:
        const[-1] += table.types[table.layer_type[-1]].min_time_s()
    pinned = {0} if first == 1 else set()
    pinned |= {num_chunks - 1} if first + count < table.num_layers else set()
    peaks = [live_vectors(shape, r) for r in range(pp)]
    weight = [max(live[c // pp] for live in peaks[c % pp]) for c in range(num_chunks)]
    counts = [[0] * len(options) for _ in range(num_chunks)]
    for c in range(num_chunks):
        if c not in pinned:
            counts[c][fast] = 1
    if sum(map(sum, counts)) > count:
        return None

    def chunk_s(c):
        return const[c] + sum(n * options[o].time_s for o, n in enumerate(counts[c]))
    for _ in range(count - sum(map(sum, counts))):  # extra layers where they hold fewest micro-batches
        c = min(range(num_chunks), key=lambda c: (chunk_s(c) + options[fast].time_s, weight[c], c))
        counts[c][fast] += 1
    pinned_options = {layer: min(range(len(table.types[table.layer_type[layer]].options)),
                                 key=lambda o: table.types[table.layer_type[layer]].options[o].act_bytes)
                      for layer in range(table.num_layers) if not first <= layer < first + count}
    for _ in range(count + 1):
        chunks, chosen = _expand(counts, first, table.num_layers, num_chunks, pinned_options)
        _, _, memory = evaluate_assignment(problem, chunks, chosen, peaks)
        over = [r for r in range(pp) if problem.mem_limit_bytes is not None and memory[r] > problem.mem_limit_bytes]
        if not over:
            return counts, pinned_options
        movable = [c for c in range(over[0], num_chunks, pp) if any(counts[c][o] for o in range(len(options)) if o != lean)]
        if not movable:
            return None
        slowest = max(chunk_s(c) for c in range(num_chunks))
        extra = options[lean].time_s - options[fast].time_s
        # Prefer chunks with room below the slowest, then the most live micro-batches.
        c = min(movable, key=lambda c: (chunk_s(c) + extra > slowest, -weight[c], c))
        o = next(o for o in range(len(options)) if o != lean and counts[c][o])
        counts[c][o] -= 1
        counts[c][lean] += 1
    return None


def _expand(counts, first: int, num_layers: int, num_chunks: int, pinned_options: dict[int, int]):
    chunks, chosen = [0] * num_layers, [0] * num_layers
    for layer, option in pinned_options.items():
        chunks[layer], chosen[layer] = (0 if layer < first else num_chunks - 1), option
    layer = first
    for c, row in enumerate(counts):
        for o, n in enumerate(row):
            for _ in range(n):
                chunks[layer], chosen[layer] = c, o
                layer += 1
    return chunks, chosen
