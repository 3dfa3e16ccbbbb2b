"""`meshplan plan` extras: `--like FILE` (pins from an engine config) and `--train-tokens N`
with `--deadline-days D` / `--usd-per-gpu-hour P` (time, GPU-hours, cost; GPU count for a deadline)."""
from __future__ import annotations

import sys

from meshplan.commands.common import finite_float
from meshplan.planner.contracts.axes import AXIS_NAMES

PIN_NAMES = (*AXIS_NAMES, "cp_method", "zero", "shard_group", "recompute", "sp", "schedule", "vpp", "mbs", "offload")


def add_arguments(parser) -> None:
    parser.add_argument("--deadline-days", type=finite_float, default=None,
                        help="with --train-tokens: plan node multiples up to --gpus and keep the cheapest that "
                             "trains within this many days")
    parser.add_argument("--usd-per-gpu-hour", type=finite_float, default=None,
                        help="with --train-tokens: price of one GPU-hour, to print the cost")
    parser.add_argument("--like", default=None, metavar="FILE",
                        help="pin what an engine config fixes (torchtitan TOML, Megatron-LM arguments, DeepSpeed "
                             "JSON); command-line pins win")


def pins_from(args) -> dict:
    """The command line's pins, completed by `--like FILE` where the command line leaves one open."""
    pins = {name: getattr(args, name) for name in PIN_NAMES if hasattr(args, name)}
    if not args.like:
        return pins
    from meshplan.planner.contracts.errors import MeshplanError
    from meshplan.planner.engines.bridge import job_pins, read_engine_file

    job = read_engine_file(args.like)
    if job is None:
        raise MeshplanError(f"--like {args.like} is a meshplan plan, not an engine config; pin its degrees with "
                            "--tp/--pp/--dp/... or pass the engine config it was exported to")
    for note in job.notes:
        print(f"meshplan plan: --like: not mapped: {note}", file=sys.stderr)
    for name, value in job_pins(job).items():
        if pins.get(name) is None:
            pins[name] = value
    if getattr(args, "moe_dispatcher", None) is None and job.moe_dispatcher != "alltoall":
        args.moe_dispatcher = job.moe_dispatcher  # not a pin: the config's token dispatcher prices every candidate
    return pins


def write_plan_json(data: dict, path) -> None:
    """The plan JSON with its `sizing` key (loaders ignore the key)."""
    import json

    from meshplan.planner.contracts.atomicfile import write_text_atomic

    write_text_atomic(path, json.dumps(data, indent=2) + "\n", "plan")


def check(args) -> None:
    from meshplan.planner.contracts.errors import MeshplanError

    for flag, value in (("--deadline-days", args.deadline_days), ("--usd-per-gpu-hour", args.usd_per_gpu_hour)):
        if value is not None and args.train_tokens is None:
            raise MeshplanError(f"{flag} needs --train-tokens N (the tokens to train on)")
        if value is not None and not value > 0:
            raise MeshplanError(f"{flag} must be positive, got {value}")


def size(args, result, plan_at):
    """(plan to keep, Sizing or None, lines to print). `plan_at(gpus)` searches at another size."""
    from meshplan.planner.costing.error_bands import prediction_band
    from meshplan.planner.engines.sizing import Sizing, size_cluster, sweep_counts, training_cost

    plans = {result.config.gpus: result}

    def cost_at(gpus: int):
        if gpus not in plans:
            plans[gpus] = plan_at(gpus)
        found = plans[gpus]
        pred = found.prediction
        band = prediction_band(found.config, found.model.spec, found.model.seq, found.cluster)
        return training_cost(gpus, args.train_tokens, pred["tokens_per_s"], pred["step_time_s"],
                             args.usd_per_gpu_hour, found.config.label(),
                             (band.error_low, band.error_high) if band else None)

    if args.deadline_days is None:
        sizing = Sizing(rows=(cost_at(result.config.gpus),))
        return result, sizing, _lines(sizing, args)
    counts = sweep_counts(result.cluster.gpus_per_node, args.gpus)
    sizing = size_cluster(counts, cost_at, args.deadline_days, _ceiling(result), args.train_tokens)
    chosen = plans[sizing.chosen.gpus] if sizing.chosen else result
    return chosen, sizing, _lines(sizing, args)


def _ceiling(plan):
    """tokens/s no plan of this model can beat on a given GPU count (`sizing.ceiling_tokens_per_s`)."""
    from meshplan.planner.costing.flops import executed_flops_per_step
    from meshplan.planner.costing.precision import COMPUTE_DTYPE
    from meshplan.planner.engines.sizing import ceiling_tokens_per_s
    from meshplan.planner.profiling.profiler import profile

    device, precision = plan.cluster.device, plan.config.precision
    graph = profile(plan.model.spec, plan.model.seq, dtype=plan.model.dtype, engine=plan.config.engine)
    per_token = executed_flops_per_step(graph, 1, ["none"] * len(graph.layers)) / graph.seq
    # fp8 GEMMs may run above the bf16 ceiling: bound them by the fp8 peak itself
    peak = device.peak_flops("fp8") if precision == "fp8" else (
        device.peak_flops(COMPUTE_DTYPE[precision]) * device.matmul_efficiency)
    return lambda gpus: ceiling_tokens_per_s(gpus, per_token, peak)


def _lines(sizing, args) -> list[str]:
    usd = args.usd_per_gpu_hour
    lines = ["", f"training on {args.train_tokens:.3g} tokens"
             + (f", deadline {sizing.deadline_days:g} days" if sizing.deadline_days else "")
             + (f", ${usd:g} per GPU-hour" if usd else "")]
    lines.append(f"  {'GPUs':>6} {'tokens/s':>14} {'days':>9} {'GPU-hours':>14}" + (f" {'cost USD':>16}" if usd else "")
                 + "  configuration")
    for row in sizing.rows:
        mark = " <" if sizing.chosen is not None and row.gpus == sizing.chosen.gpus else ""
        lines.append(f"  {row.gpus:>6} {row.tokens_per_s:>14,.0f} {row.days:>9.2f} {row.gpu_hours:>14,.0f}"
                     + (f" {row.usd:>16,.0f}" if usd else "") + f"  {row.label}{mark}")
    shown = sizing.chosen or (sizing.rows[0] if len(sizing.rows) == 1 else None)
    if shown is not None and shown.step_error_band is not None:
        days, cost = shown.likely(shown.days), shown.likely(shown.usd) if usd else None
        lines.append(f"  likely {days[0]:.2f}-{days[1]:.2f} days"
                     + (f", ${cost[0]:,.0f}-${cost[1]:,.0f}" if cost else "")
                     + f" at {shown.gpus} GPUs (the held-out step error of such runs: "
                     f"{shown.step_error_band[0]:+.0%} to {shown.step_error_band[1]:+.0%})")
    lines += [f"  skipped {reason}" for reason in sizing.skipped]
    if sizing.deadline_days is not None:
        if sizing.chosen is None:
            lines.append(f"no size up to {args.gpus} GPUs meets {sizing.deadline_days:g} days; raise --gpus")
        else:
            row = sizing.chosen
            lines.append(f"chosen: {row.gpus} GPUs, {row.days:.2f} days, {row.gpu_hours:,.0f} GPU-hours"
                         + (f", ${row.usd:,.0f}" if usd else "") + " (the plan shown and written is this size's)")
    return lines
