"""Turn the planner's ranked candidates into a `Plan`: layer assignments, alternatives, and why.

The winner's per-layer choices become `LayerAssignment`s; each runner-up becomes a complete
configuration dict (mesh, ZeRO, SP, schedule, per-layer chunk and recomputation) with its
prediction and a short `why_not` naming what limits it against the winner: memory, the
pipeline bubble, communication, recomputation or compute. The winner and every runner-up are
marked with the executor's rule (`costing.executable.why_not_executable`): `Plan.executable` /
`not_executable_reason`, and each alternative's `executable` (with `not_executable_reason` when
false).
"""
from __future__ import annotations

from pathlib import Path

from meshplan.planner.contracts.config import DEFAULT_CP_METHOD, RECOMPUTE
from meshplan.planner.contracts.plan import LayerAssignment, ModelRef, Plan, cp_method_json, mesh_json
from meshplan.planner.costing.executable import dispatcher_problem, model_facts, mtp_problem, why_not_executable

GIB = 2.0 ** 30
# Solver fields that measure wall-clock time: they differ between identical runs.
WALL_CLOCK_KEYS = ("ilp_solve_time_s", "search_time_s")
CAUSES = {
    "bubble": "the pipeline bubble",
    "dp_comm": "data-parallel communication",
    "tp_comm": "tensor-parallel communication",
    "ep_comm": "expert-parallel all-to-alls",
    "pp_comm": "pipeline transfers",
    "recompute": "recomputation",
    "compute": "slower compute (smaller GEMMs)",
    "optimizer": "the optimizer step",
}


def absolute_spec(spec: str) -> str:
    """File specs (`path/model.py:fn`, `hf:path/config.json`) with their paths made absolute; a hub
    repository id (`hf:owner/name`) stays as written (each machine resolves it through its cache)."""
    if spec.startswith("hf:"):
        from meshplan.planner.models.hf_hub import is_local_path

        return "hf:" + str(Path(spec[3:]).resolve()) if is_local_path(spec[3:]) else spec
    path, sep, fn = spec.rpartition(":")
    if sep and path.endswith(".py"):
        return f"{Path(path).resolve()}:{fn}"
    return spec


def layer_assignments(graph, ranked) -> tuple[LayerAssignment, ...]:
    table, solution, pp = ranked.table, ranked.solution, ranked.config.pp
    out = []
    for index, (layer, chunk) in enumerate(zip(graph.layers, solution.chunk_of_layer)):
        option = table.option(index, solution.option_of_layer[index])
        out.append(LayerAssignment(
            name=layer.name, stage=ranked.config.rank_of_chunk(chunk), virtual_stage=chunk // pp, tp=option.tp, dp=option.dp,
            recompute=option.recompute, fwd_time_s=option.fwd_s, bwd_time_s=option.bwd_s,
            comm_time_s=option.comm_s, mem_bytes=option.static_bytes + option.act_bytes))
    return tuple(out)


def configuration(ranked) -> dict:
    """A runnable configuration: everything `meshplan train` needs besides model and cluster."""
    cfg, solution = ranked.config, ranked.solution
    per_chunk = [0] * cfg.num_model_chunks
    for chunk in solution.chunk_of_layer:
        per_chunk[chunk] += 1
    return {
        "label": ranked.candidate.label(),
        "mesh": mesh_json(cfg), **cp_method_json(cfg),
        "zero": cfg.zero, "sp": cfg.sp, "precision": cfg.precision,
        **({"shard_group": cfg.shard_group} if cfg.shard_group else {}),
        **({"offload": cfg.offload} if cfg.offload != "none" else {}),
        "schedule": {"name": cfg.schedule, "microbatches": cfg.num_microbatches,
                     "microbatch_size": cfg.microbatch_size, "virtual_stages": cfg.virtual_stages},
        "recompute": cfg.recompute,
        "recompute_summary": {r: ranked.recompute_of_layer.count(r) for r in RECOMPUTE},
        "layers_per_chunk": per_chunk,
        "chunk_of_layer": list(solution.chunk_of_layer),
        "recompute_of_layer": list(ranked.recompute_of_layer),
        "ilp_objective_s": solution.objective_s,
    }


def why_not(alt, winner, limit_bytes: float) -> str:
    """What limits a runner-up against the winner, in a short phrase."""
    pa, pw = alt.prediction, winner.prediction
    if not pa.fits and pa.peak_memory_bytes <= limit_bytes:  # on the GPUs, but not in host memory
        return f"does not fit: {pa.host_state_bytes_per_node / GIB:.1f} GiB offloaded on a node's host"
    if not pa.fits:
        return (f"does not fit: peak {pa.peak_memory_bytes / GIB:.1f} GiB > {limit_bytes / GIB:.1f} GiB usable")
    slower = pa.step_time_s - pw.step_time_s
    cause, delta = _main_cause(pa.breakdown, pw.breakdown)
    text = f"{_pct(slower, pw.step_time_s)} slower"
    if cause:
        text += f", mostly {CAUSES.get(cause, cause)} (+{delta * 1e3:.1f} ms/step)"
    recomputed = sum(r != "none" for r in alt.recompute_of_layer)
    if recomputed and cause in ("recompute", None):
        text += f"; memory forces recomputation of {recomputed} layers"
    full = memory_nearly_full(pa.peak_memory_bytes, limit_bytes)
    return text + (f"; {full}" if full else "")


# a plan whose peak is above this share of the usable memory is flagged, the winner like any other
NEARLY_FULL_FRACTION = 0.95


def memory_nearly_full(peak_bytes: float, limit_bytes: float) -> str:
    """"memory nearly full (a of b GiB)" when the peak is above `NEARLY_FULL_FRACTION` of the
    limit, else ""."""
    if limit_bytes <= 0 or peak_bytes <= NEARLY_FULL_FRACTION * limit_bytes:
        return ""
    return f"memory nearly full ({peak_bytes / GIB:.1f} of {limit_bytes / GIB:.1f} GiB)"


def _main_cause(alt: dict, winner: dict) -> tuple[str | None, float]:
    deltas = {key: alt.get(key, 0.0) - winner.get(key, 0.0) for key in CAUSES}
    key = max(sorted(deltas), key=lambda k: deltas[k])
    return (key, deltas[key]) if deltas[key] > 0 else (None, 0.0)


def _pct(delta: float, base: float) -> str:
    return f"{100 * delta / base:.1f}%" if base > 0 else f"{delta * 1e3:.1f} ms"


def explain(plan_json: dict) -> str:
    """One paragraph: why the winner wins and what limits the runner-up."""
    pred, solver = plan_json["prediction"], plan_json.get("solver", {})
    mesh, sched = plan_json["mesh"], plan_json["schedule"]
    limit = solver.get("usable_memory_bytes", 0.0)
    recomputed = sum(layer["recompute"] != "none" for layer in plan_json["layers"])
    cp = f" cp={mesh['cp']}" if mesh.get("cp", 1) > 1 else ""
    cp += f" {plan_json['cp_method']}" if plan_json.get("cp_method", DEFAULT_CP_METHOD) != DEFAULT_CP_METHOD else ""
    cp += f" ep={mesh['ep']}" if mesh.get("ep", 1) > 1 else ""
    cp += f" etp={mesh['etp']}" if mesh.get("etp") is not None else ""
    text = (f"meshplan picks pp={mesh['pp']} dp={mesh['dp']}{cp} tp={mesh['tp']}{' with SP' if plan_json['sp'] else ''}, "
            f"{sched['name']}{' x' + str(sched['virtual_stages']) if sched['virtual_stages'] > 1 else ''} with "
            f"{sched['microbatches']} micro-batch{'es' if sched['microbatches'] != 1 else ''} of "
            f"{sched['microbatch_size']}, ZeRO-{plan_json['zero']}"
            + (f" HSDP (shard over {plan_json['shard_group']}, replicate across {mesh['dp'] // plan_json['shard_group']})"
               if plan_json.get("shard_group") else "")
            + (f", {plan_json['offload']} offloaded to host memory" if plan_json.get("offload") else "")
            + (f", recomputing {recomputed} layer{'s' if recomputed != 1 else ''}" if recomputed
               else ", no recomputation") + ": "
            f"{pred['step_time_s']:.3f} s per step, MFU {100 * pred['mfu']:.1f}%, bubble "
            f"{100 * pred['bubble_fraction']:.1f}%, peak memory {pred['peak_memory_bytes'] / GIB:.1f} of "
            f"{limit / GIB:.1f} GiB"
            + (f" ({memory_nearly_full(pred['peak_memory_bytes'], limit)})"
               if memory_nearly_full(pred['peak_memory_bytes'], limit) else "") + ".")
    if solver.get("offload"):  # `search.offloading`: nothing fitted without it
        text += f" {solver['offload'][0].upper()}{solver['offload'][1:]}."
    if solver.get("ep_rival"):
        text += " " + _why_ep(plan_json, solver["ep_rival"])
    alternatives = plan_json.get("alternatives") or []
    if alternatives:
        alt = alternatives[0]
        text += f" The runner-up ({alt['label']}) is {alt['why_not']}."
    text += (f" Of {solver.get('num_candidates', 0)} candidates, {solver.get('num_solved', 0)} were solved by "
             f"the ILP, {solver.get('num_pruned_bound', 0)} pruned by the compute bound, "
             f"{solver.get('num_pruned_memory_bound', 0)} by the memory-aware bound (time once memory forces "
             f"recomputation) and {solver.get('num_pruned_memory', 0)} because no assignment fits in memory "
             f"(every bound is below the ILP's optimum, so none of them could have been re-ranked)"
             + (f", and {solver['num_pruned_expert_degree']} by the rule that solves only the most promising "
                f"expert-parallel degrees of a configuration (not a bound)" if solver.get("num_pruned_expert_degree")
                else "")
             + (f", and {solver['num_pruned_host_memory']} because their offloaded states cannot fit in host "
                f"memory" if solver.get("num_pruned_host_memory") else "")
             + "; the winner's ILP status"
             + (" (solved on the envelope of its periodic blocks, each priced at its kinds' largest costs, and "
                "scored on the real blocks)" if solver.get("formulation") == "envelope" else "")
             + f" is {solver.get('status', '?')} with gap {100 * solver.get('gap', 0.0):.2g}%.")
    if solver.get("num_executor_limited"):
        text += (f" {solver['num_executor_limited']} more layouts were left out because meshplan's executor does not "
                 "train them (`train` runs the plan); `--engine megatron`, `torchtitan` or `deepspeed` searches them "
                 "too for export.")
    return text


def _rival_basis(rival: dict) -> str:
    if rival.get("basis") == "same layout":
        return f"the winner's stages and recomputation: {rival['label']}"
    return f"best: {rival['label']}"


def _why_ep(plan_json: dict, rival: dict) -> str:
    """Why this expert-parallel degree: expert states per rank and all-to-all time against the best
    plan with another degree."""
    pred, ep = plan_json["prediction"], plan_json["mesh"].get("ep", 1)
    experts = max((m.get("experts", 0.0) for m in pred["memory_bytes"]), default=0.0)
    a2a, compute = pred["breakdown"].get("ep_comm", 0.0), pred["breakdown"].get("compute", 0.0)
    return (f"Expert parallelism {ep}: {experts / GIB:.1f} GiB of expert states and {a2a:.3f} s of all-to-all "
            f"per rank and step, compute {compute:.3f} s; with ep={rival['ep']} ({_rival_basis(rival)}) "
            f"{rival['expert_bytes'] / GIB:.1f} GiB of expert states, {rival['ep_comm_s']:.3f} s of all-to-all, "
            f"compute {rival['compute_s']:.3f} s: {_pct(rival['step_time_s'] - pred['step_time_s'], pred['step_time_s'])} "
            f"slower per step.")


def build_plan(graph, cluster, ranked: list, stats: dict, *, seed: int, layerwise: bool,
               limit_bytes: float, conventional=None) -> Plan:
    """The Plan of the winner (ranked[0]) with the others as alternatives, each marked with
    whether the executor runs it (only `layerwise` plans can give layers their own degrees);
    `conventional` (`search.alternatives.Conventional`), when given, is the last alternative."""
    winner, facts = ranked[0], model_facts(graph)
    layers = layer_assignments(graph, winner)
    dispatcher = graph.info.moe_dispatcher
    mtp = mtp_problem(graph.info.mtp_num_layers)
    reason = (why_not_executable(winner.config, facts, _degrees(layers) if layerwise else ())
              or dispatcher_problem(winner.config, dispatcher) or mtp)
    alternatives = []
    for alt in ranked[1:]:
        entry = configuration(alt)
        alt_reason = (why_not_executable(alt.config, facts, _degrees(layer_assignments(graph, alt)) if layerwise else ())
                      or dispatcher_problem(alt.config, dispatcher) or mtp)
        entry["executable"] = alt_reason is None
        if alt_reason:
            entry["not_executable_reason"] = alt_reason
        entry["prediction"] = alt.prediction.to_json()
        entry["why_not"] = why_not(alt, winner, limit_bytes)
        alternatives.append(entry)
    if conventional is not None:
        alternatives.append(conventional_entry(conventional, winner, facts, limit_bytes))
    solution = winner.solution
    solver = {"backend": solution.backend, "status": solution.status, "gap": solution.gap,
              "formulation": solution.formulation, "ilp_objective_s": solution.objective_s,
              "usable_memory_bytes": limit_bytes, "ilp_solve_time_s": solution.solve_time_s, **stats}
    from meshplan.planner.models.plan_check import model_digest

    model = ModelRef(spec=absolute_spec(graph.spec), seq=graph.seq, dtype=graph.dtype, attention=graph.attention,
                     digest=model_digest(graph.spec),
                     moe_capacity_factor=float(getattr(graph.info, "moe_capacity_factor", 0.0) or 0.0),
                     moe_pad_to_capacity=bool(getattr(graph.info, "moe_pad_to_capacity", False)),
                     moe_dispatcher=getattr(graph.info, "moe_dispatcher", "alltoall"),
                     mtp_num_layers=graph.info.mtp_num_layers)
    prediction = winner.prediction.to_json()
    return Plan(model=model, cluster=cluster, config=winner.config, layers=layers, prediction=prediction,
                alternatives=tuple(alternatives), seed=seed, executable=reason is None,
                not_executable_reason=reason or "", solver=solver)


def conventional_entry(conventional, winner, facts, limit_bytes: float) -> dict:
    """The conventional layout as an alternative: its uniform plan (balanced chunks, one
    recomputation for the blocks), predicted by the simulator; no ILP solved it
    (`ilp_objective_s` null), `conventional` names the rule."""
    from meshplan.planner.search.alternatives import CONVENTIONAL_SOURCE

    cfg = conventional.config
    per_chunk = [0] * cfg.num_model_chunks
    for chunk in conventional.chunk_of_layer:
        per_chunk[chunk] += 1
    reason = why_not_executable(cfg, facts, ())
    entry = {
        "label": conventional.label(), "conventional": CONVENTIONAL_SOURCE, "mesh": mesh_json(cfg),
        **cp_method_json(cfg),
        "zero": cfg.zero, "sp": cfg.sp, "precision": cfg.precision,
        "schedule": {"name": cfg.schedule, "microbatches": cfg.num_microbatches,
                     "microbatch_size": cfg.microbatch_size, "virtual_stages": cfg.virtual_stages},
        "recompute": cfg.recompute,
        "recompute_summary": {r: conventional.recompute_of_layer.count(r) for r in RECOMPUTE},
        "layers_per_chunk": per_chunk, "chunk_of_layer": list(conventional.chunk_of_layer),
        "recompute_of_layer": list(conventional.recompute_of_layer), "ilp_objective_s": None,
        "executable": reason is None, **({"not_executable_reason": reason} if reason else {}),
        "prediction": conventional.prediction.to_json(),
    }
    pa, pw = conventional.prediction, winner.prediction
    if not pa.fits or pa.step_time_s > pw.step_time_s:
        entry["why_not"] = why_not(conventional, winner, limit_bytes)
    elif pa.step_time_s == pw.step_time_s:
        entry["why_not"] = "as fast as the winner"
    else:  # the search's candidates or pruning missed it: say so rather than hide it
        entry["why_not"] = (f"{_pct(pw.step_time_s - pa.step_time_s, pw.step_time_s)} faster than the winner: "
                            "the search did not reach this layout")
    return entry


def _degrees(layers) -> list[tuple[int, int]]:
    return [(layer.tp, layer.dp) for layer in layers]


def configuration_rows(plan_json: dict) -> list[dict]:
    """The winner (from the plan's own fields) followed by the alternatives, in one shape."""
    recomputes = [layer["recompute"] for layer in plan_json["layers"]]
    winner = {
        "mesh": plan_json["mesh"], "zero": plan_json["zero"], "sp": plan_json["sp"],
        **({"cp_method": plan_json["cp_method"]} if "cp_method" in plan_json else {}),
        **({"shard_group": plan_json["shard_group"]} if plan_json.get("shard_group") else {}),
        "schedule": plan_json["schedule"], "prediction": plan_json["prediction"],
        "recompute_summary": {r: recomputes.count(r) for r in RECOMPUTE},
        "ilp_objective_s": plan_json.get("solver", {}).get("ilp_objective_s", float("nan")),
    }
    return [winner] + list(plan_json.get("alternatives") or [])
