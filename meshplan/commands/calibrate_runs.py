"""`meshplan calibrate --from-runs`: a cluster profile fitted to the user's own measured runs.

Each run is `CONFIG,MEASURED`: the engine config (torchtitan, Megatron-LM, DeepSpeed) or the
meshplan plan.json that ran, and what was measured: a measured.json (`meshplan train` or
`meshplan measured`) or the engine's training log itself."""
from __future__ import annotations

from pathlib import Path


def run_from_runs(args) -> int:
    from meshplan.planner.calibration.user_runs import fit_user_runs
    from meshplan.planner.contracts.atomicfile import write_text_atomic
    from meshplan.planner.contracts.cluster import dump_cluster_toml
    from meshplan.planner.contracts.errors import MeshplanError
    from meshplan.planner.costing.hardware import load_cluster

    if not args.cluster:
        raise MeshplanError("--from-runs fits a profile you name: pass --cluster PROFILE (the GPUs the runs used)")
    base = load_cluster(args.cluster)
    runs = [user_run(item, base, args.model, args.seq) for item in args.from_runs]
    out = Path(args.out)
    fit = fit_user_runs(runs, base, args.name or out.stem)
    header = ["# Written by meshplan calibrate --from-runs: the efficiency fields below fitted to these runs",
              *(f"#   {item}" for item in args.from_runs),
              "# leave-one-out (each run predicted by a profile fitted to the others):"]
    header += [f"#   {r.name}: measured {r.measured_s:.4g} s, {r.error_before:+.1%} -> {r.error_after:+.1%}"
               for r in fit.left_out]
    write_text_atomic(out, "\n".join(header) + "\n" + dump_cluster_toml(fit.profile), "--out")
    load_cluster(out)  # what we wrote must load
    print(f"wrote {out}: {', '.join(f'{k} {v:.4g}' for k, v in fit.values.items())} (from {base.name}: "
          + ", ".join(f"{k} {getattr(base.device, k):.4g}" for k in fit.values) + ")")
    print(f"  leave-one-out, {len(runs)} runs: mean |step error| {fit.mean_abs_error(False):.1%} with {base.name}, "
          f"{fit.mean_abs_error(True):.1%} fitted without the run")
    for r in fit.left_out:
        print(f"  {r.name:<40} measured {r.measured_s * 1e3:10.1f} ms  {r.error_before:+7.1%} -> {r.error_after:+7.1%}")
    return 0


def user_run(item: str, base, model: str | None, seq: int | None):
    """The UserRun of one `CONFIG,MEASURED` argument."""
    from meshplan.planner.calibration.user_runs import UserRun
    from meshplan.planner.contracts.errors import MeshplanError

    config, sep, measured = item.rpartition(",")
    if not sep or not config or not measured:
        raise MeshplanError(f"--from-runs {item!r}: give each run as CONFIG,MEASURED (an engine config or plan.json, "
                            "then its measured.json or training log)")
    predict_s, engine, facts, regime = _predictor(config, base, model, seq)
    return UserRun(Path(config).name, _measured_step_s(measured, engine, facts), predict_s, regime)


def _predictor(config: str, base, model: str | None, seq: int | None):
    """(profile -> predicted step seconds, the engine, the run's facts for reading its log, the
    error band's regime of its prediction)."""
    from dataclasses import replace

    from meshplan.planner.costing.error_bands import is_moe_model, regime_of
    from meshplan.planner.engines.bridge import predict_job, read_engine_file
    from meshplan.planner.engines.logs import RunFacts

    job = read_engine_file(config)
    if job is None:  # a meshplan plan
        from meshplan.planner.contracts.plan import load_plan
        from meshplan.planner.simulation.simulator import simulate

        plan = load_plan(config)
        facts = RunFacts(gpus=plan.config.gpus, seq=plan.model.seq, global_batch=plan.config.global_batch)
        regime = regime_of(plan.config, is_moe_model(plan.model.spec, plan.model.seq)) or ""
        return (lambda cluster: simulate(replace(plan, cluster=cluster), timeline=False).step_time_s), None, facts, \
            regime
    first = predict_job(job, model, base, seq=seq)  # checks the config once, with its errors
    facts = RunFacts(gpus=first.config.gpus, seq=first.seq, global_batch=first.config.global_batch)
    regime = regime_of(first.config, is_moe_model(first.spec, first.seq)) or ""
    return (lambda cluster: predict_job(job, model, cluster, seq=seq).prediction.step_time_s), job.engine, facts, regime


def _measured_step_s(path: str, engine: str | None, facts) -> float:
    """The median timed step of a measured.json, or of an engine's log read with the config's engine."""
    from meshplan.planner.contracts.jsonfile import read_input_text
    from meshplan.planner.contracts.measurement import load_measurement
    from meshplan.planner.engines.logs import measurement_from_log

    text = read_input_text(Path(path), "measured run", "give a measured.json or the engine's training log")
    if text.lstrip().startswith("{"):
        return load_measurement(path).median_step_time_s
    return measurement_from_log(text, engine or "megatron", facts, source=path).median_step_time_s
