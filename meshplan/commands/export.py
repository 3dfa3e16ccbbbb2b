"""`meshplan export`: write a plan as a torchtitan TOML, Megatron-LM arguments or a DeepSpeed JSON;
and `meshplan estimate --from FILE`, the way back: predict an engine's config."""
from __future__ import annotations

import json
import sys

ENGINES = ("torchtitan", "megatron", "deepspeed")


def add_arguments(parser) -> None:
    parser.add_argument("--plan", required=True, help="plan JSON written by `meshplan plan --out`")
    parser.add_argument("--to", required=True, choices=ENGINES, help="engine to write the plan for")
    parser.add_argument("-o", "--out", default=None,
                        help="file to write (default: standard output); approximations go to standard error")
    parser.add_argument("--format", default=None, choices=("toml", "python"),
                        help="torchtitan only: 0.2's job TOML, or torchtitan 0.3's Python config function "
                             "(default: python when --out ends in .py, else toml)")


def run(args) -> int:
    from meshplan.planner.contracts.atomicfile import refuse_output_over_input
    from meshplan.planner.contracts.atomicfile import write_text_atomic
    from meshplan.planner.contracts.plan import load_plan
    from meshplan.planner.engines.bridge import export_plan

    refuse_output_over_input("--out", args.out, [("--plan", args.plan)])
    form = args.format or ("python" if args.to == "torchtitan" and str(args.out or "").endswith(".py") else None)
    exported = export_plan(load_plan(args.plan), args.to, form)
    for note in exported.notes:
        print(f"meshplan export: approximated: {note}", file=sys.stderr)
    for warning in exported.warnings:
        print(f"meshplan export: warning: {warning}", file=sys.stderr)
    if args.out:
        write_text_atomic(args.out, exported.text, "--out")
        print(f"{args.to} config written to {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(exported.text)
    return 0


def estimate_from(args) -> int:
    """`meshplan estimate --from FILE`: price an engine config, notes on stderr, printed as
    `estimate` prints its own (`printed.format_prediction`)."""
    from dataclasses import replace

    from meshplan.commands.common import on_off
    from meshplan.planner.contracts.errors import MeshplanError
    from meshplan.planner.engines.bridge import predict_job, read_engine_file

    if args.engine == "generic":
        raise MeshplanError(f"--from {args.from_file}: engine generic has no config file of its own; name the "
                            "file's engine (torchtitan, megatron or deepspeed) or leave --engine out")
    job = read_engine_file(args.from_file, None if args.engine == "meshplan" else args.engine)
    if job is None:  # a meshplan plan.json: predicted as `simulate` does
        return _estimate_plan(args)
    if args.engine == "meshplan":
        raise MeshplanError(f"--from {args.from_file} reads an engine's config: --engine names its engine "
                            "(torchtitan, megatron or deepspeed), or leave it out to guess from the file")
    overrides = {axis: getattr(args, axis) for axis in ("cp", "ep") if (getattr(args, axis, 1) or 1) > 1}
    if getattr(args, "moe_dispatcher", None):  # the command line's over the config's
        overrides["moe_dispatcher"] = args.moe_dispatcher
    if getattr(args, "mtp_num_layers", 0):  # likewise
        overrides["mtp_num_layers"] = args.mtp_num_layers
    for flag in ("tp_comm_overlap", "recompute_early_stop", "compile_loss"):  # likewise
        if getattr(args, flag, None):
            overrides[flag] = on_off(getattr(args, flag))
    if getattr(args, "torch_compile", False):  # likewise
        overrides["torch_compile"] = True
    job = replace(job, **overrides)  # what a config cannot say (DeepSpeed's EP lives in the model code)
    result = predict_job(job, args.model, args.cluster, gpus=args.gpus, global_batch=args.gbs, seq=args.seq,
                         attention=args.attention)
    for note in result.notes:
        print(f"meshplan estimate: not mapped: {note}", file=sys.stderr)
    from meshplan.planner.costing.hardware import load_cluster

    from meshplan.commands.bands import band_line, with_band

    cluster = load_cluster(args.cluster)
    if args.json:
        data = with_band(result.prediction.to_json(), result.prediction.step_time_s, result.config, result.spec,
                         result.seq, cluster)
        from meshplan.commands.printed import with_overlap

        print(json.dumps(with_overlap(data, result.config)))
        return 0
    from meshplan.commands.common import does_not_fit
    from meshplan.commands.printed import Heading, format_prediction

    heading = Heading(spec=result.spec, cluster=args.cluster, config=result.config, recompute=_recompute_text(result),
                      seq=args.seq)
    print(f"{job.engine} config {args.from_file} (memory as {job.engine} allocates it)")
    usable = cluster.device.usable_memory_bytes
    print(format_prediction(result.prediction, heading, usable, cluster))
    print(band_line(result.prediction.step_time_s, result.config, result.spec, result.seq, cluster))
    return does_not_fit("estimate", result.prediction, usable, config=result.config, cluster=cluster)


def _estimate_plan(args) -> int:
    """`estimate --from plan.json`: the plan's own prediction (the simulator, as `simulate`)."""
    from meshplan.planner.contracts.plan import load_plan
    from meshplan.planner.simulation.simulator import simulate

    from meshplan.commands.common import does_not_fit, prediction_json
    from meshplan.commands.printed import Heading, format_prediction

    plan = load_plan(args.from_file)
    prediction = simulate(plan, timeline=False)
    from meshplan.commands.bands import band_line, with_band

    if args.json:
        data = with_band(prediction_json(prediction, plan.model.spec, plan.model.seq), prediction.step_time_s,
                         plan.config, plan.model.spec, plan.model.seq, plan.cluster)
        print(json.dumps(data))
        return 0
    heading = Heading(spec=plan.model.spec, cluster=plan.cluster.name, config=plan.config,
                      recompute=plan.config.recompute, seq=plan.model.seq)
    print(f"meshplan plan {args.from_file}")
    print(format_prediction(prediction, heading, plan.cluster.device.usable_memory_bytes, plan.cluster))
    print(band_line(prediction.step_time_s, plan.config, plan.model.spec, plan.model.seq, plan.cluster))
    return does_not_fit("estimate", prediction, plan.cluster.device.usable_memory_bytes, config=plan.config,
                        cluster=plan.cluster)


def _recompute_text(result) -> str:
    modes = [mode for mode, layer_is_block in zip(result.recompute_of_layer, _blocks(result)) if layer_is_block]
    kinds = sorted(set(modes))
    if len(kinds) == 1:
        return kinds[0]
    return "/".join(f"{kind} {modes.count(kind)}" for kind in ("none", "selective", "full") if modes.count(kind))


def _blocks(result) -> list[bool]:
    count = len(result.recompute_of_layer)
    return [0 < index < count - 1 for index in range(count)]
