"""What `meshplan plan` shows beside its winner: structurally different runners-up, the layout an
expert would try first, and every candidate the search evaluated (`plan --candidates-csv`).

Runners-up that differ only in ZeRO stage or micro-batch size teach a reader nothing, so the
alternatives are the best plan of each structure: mesh shape (pp, dp, cp, tp, ep) and schedule
family (`structure`; with pp = 1 the schedule plays no part, and ZeRO never does). Among the ILP's
solutions, the best of each structure not yet simulated is simulated too.

The conventional layout is Megatron-LM's rule of thumb as Narayanan et al. 2021 (Table 1) apply
it: tensor parallelism grows with the model until at most `PARAMS_PER_TP_RANK` parameters sit on
a rank (1.7B: tp 1, 3.6B: 2, 7.5B: 4, 18B: 8) and stays inside a node; pipeline stages are added
only as memory needs them; the rest is data parallelism with the distributed optimizer (ZeRO-1),
1F1B, micro-batch 1, sequence parallelism with tp > 1, and the least recomputation that fits.
It is predicted by the same simulator on its uniform plan (`simulator.simulate_config`).
"""
from __future__ import annotations

from dataclasses import dataclass

from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.contracts.errors import MeshplanError

PARAMS_PER_TP_RANK = 2.5e9  # Narayanan et al. 2021 Table 1: TP-only rows hold 1.7-2.25B per rank
TP_DEGREES = (1, 2, 4, 8)
CONVENTIONAL_SOURCE = "Megatron-LM's layout rule (Narayanan et al. 2021, Table 1)"


def structure(config: ParallelConfig) -> tuple:
    """Mesh shape and schedule family: what makes two plans structurally different."""
    spec = config.schedule_spec
    family = (spec.multi_chunk, spec.placement, spec.split_backward) if config.pp > 1 else None
    return config.pp, config.dp, config.cp, config.tp, config.ep, family


def best_per_structure(items, config_of) -> list:
    """The first (best) item of each structure, in the given order."""
    seen, out = set(), []
    for item in items:
        key = structure(config_of(item))
        if key not in seen:
            seen.add(key)
            out.append(item)
    return out


@dataclass(frozen=True)
class Conventional:
    """The conventional layout, its uniform plan's chunks and recomputation, and its prediction."""

    config: ParallelConfig
    chunk_of_layer: tuple[int, ...]
    recompute_of_layer: tuple[str, ...]
    prediction: object  # planner.contracts.prediction.Prediction

    def label(self) -> str:
        return f"conventional: {self.config.label()}"


def conventional_layout(graph, cluster, gpus: int, global_batch: int, precision: str,
                        whole_model: bool) -> Conventional | None:
    """The layout an expert would try first for this model size (module docstring), predicted;
    None when no configuration of that shape is valid for the job. `whole_model`: a model the
    executor runs with data parallelism only (pure DP)."""
    from meshplan.planner.costing.uniform import balanced_layer_chunks, default_recompute
    from meshplan.planner.simulation.simulator import simulate_config

    tried = None
    for config in _conventional_configs(graph, cluster, gpus, global_batch, precision, whole_model):
        chunks = balanced_layer_chunks(graph, cluster, config)
        recompute = default_recompute(graph, config)
        prediction = simulate_config(graph, cluster, config, chunk_of_layer=chunks, recompute_of_layer=recompute)
        tried = Conventional(config, tuple(chunks), tuple(recompute), prediction)
        if prediction.fits:
            return tried
    return tried  # the leanest shape tried, shown with its memory verdict


def _conventional_configs(graph, cluster, gpus, global_batch, precision, whole_model):
    """Valid configurations of the conventional shape, leanest in parallelism first."""
    from meshplan.planner.search.candidates import divisors
    from meshplan.planner.simulation.estimator import check_model_fit, parallel_config

    tp = 1 if whole_model else _conventional_tp(graph, cluster, gpus)
    pps = [1] if whole_model else [pp for pp in divisors(gpus // tp) if pp <= len(graph.layers)]
    for pp in pps:
        dp = gpus // (tp * pp)
        for recompute in ("none", "selective", "full"):
            try:
                config = parallel_config(cluster, gpus=gpus, global_batch=global_batch, tp=tp, pp=pp, mbs=1,
                                         zero=1 if dp > 1 else 0, recompute=recompute, sp=tp > 1,
                                         schedule="1f1b", precision=precision)
                check_model_fit(graph, config)
            except (MeshplanError, ValueError):
                break  # this pp is not valid for the job (batch, stages, heads): the next one
            yield config


def _conventional_tp(graph, cluster, gpus: int) -> int:
    """The smallest of 1, 2, 4, 8 leaving at most PARAMS_PER_TP_RANK parameters on a rank, among
    the degrees valid here (a node's GPUs, the job's GPUs, the model's heads); else the largest."""
    from meshplan.planner.simulation.estimator import check_tp_splits

    valid = []
    for tp in TP_DEGREES:
        if tp > cluster.gpus_per_node or cluster.gpus_per_node % tp or gpus % tp:
            continue
        try:
            check_tp_splits(graph, tp)
        except (MeshplanError, ValueError):
            continue
        valid.append(tp)
    if not valid:
        return 1
    return next((tp for tp in valid if graph.total_params / tp <= PARAMS_PER_TP_RANK), valid[-1])


CSV_FIELDS = ("label", "pp", "dp", "cp", "tp", "ep", "zero", "shard_group", "sp", "schedule", "virtual_stages",
              "microbatch_size", "num_microbatches", "lower_bound_s", "outcome", "ilp_status", "ilp_objective_s",
              "simulated_step_time_s", "peak_memory_bytes", "fits")
OUTCOMES = {
    "": "solved",
    "bound": "pruned: its compute lower bound cannot beat the best objectives found",
    "memory_bound": "pruned: its memory-aware lower bound cannot beat the best objectives found",
    "memory": "pruned: no assignment fits in memory",
    "host_memory": "pruned: its offloaded states cannot fit in its nodes' host memory",
    "expert_degree": "pruned: not among the most promising expert-parallel degrees of its configuration",
}


def candidate_rows(candidates, solved, simulated: dict, winner, alternatives) -> list[dict]:
    """One row per enumerated candidate: its configuration, how it left the search, and (when
    simulated) its step and memory. `simulated`: candidate -> Prediction; `winner`/`alternatives`:
    the candidates in the plan."""
    by_candidate = {s.candidate: s for s in solved}
    shown = set(alternatives)
    rows = []
    for candidate in candidates:
        item = by_candidate.get(candidate)
        outcome = "not reached" if item is None else OUTCOMES.get(item.pruned, item.pruned)
        solution = item.solution if item is not None else None
        if solution is not None and solution.status == "cutoff":
            outcome = "pruned: its ILP stopped at the cutoff (it cannot beat the best objectives found)"
        elif solution is not None and not solution.feasible:
            outcome = f"solved: {solution.status}, no assignment fits"
        elif solution is not None:
            outcome = "solved: its ILP objective is behind the re-ranked ones"
        prediction = simulated.get(candidate)
        if candidate == winner:
            outcome = "winner"
        elif candidate in shown:
            outcome = "alternative"
        elif prediction is not None:
            outcome = "simulated: " + ("slower than the plan's" if prediction.fits else "does not fit when simulated")
        rows.append({
            "label": candidate.label(), "pp": candidate.pp, "dp": candidate.dp, "cp": candidate.cp,
            "tp": candidate.tp, "ep": candidate.ep, "zero": candidate.zero, "shard_group": candidate.shard_group or "",
            "sp": candidate.sp, "schedule": candidate.schedule, "virtual_stages": candidate.virtual_stages,
            "microbatch_size": candidate.microbatch_size, "num_microbatches": candidate.num_microbatches,
            "lower_bound_s": item.lower_bound_s if item is not None else "", "outcome": outcome,
            "ilp_status": solution.status if solution is not None else "",
            "ilp_objective_s": solution.objective_s if solution is not None and solution.feasible else "",
            "simulated_step_time_s": prediction.step_time_s if prediction is not None else "",
            "peak_memory_bytes": prediction.peak_memory_bytes if prediction is not None else "",
            "fits": prediction.fits if prediction is not None else ""})
    return rows
