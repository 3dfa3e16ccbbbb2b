"""`meshplan simulate --plan plan.json [--json] [--trace trace.json]`: play one step of a plan."""
from __future__ import annotations

import json
from pathlib import Path

from meshplan.planner.contracts.config import ENGINES, EXECUTOR_MEMORY_ENGINES, TP_OVERLAP_ENGINES
from meshplan.planner.contracts.fp8_choice import FP8_FILTER_ENGINES
from meshplan.planner.contracts.engine_rules import (A2A_OVERLAP_ENGINES, COMPILE_ENGINES, ce_fusion_under,
                                                     early_stop_under)

GIB, MIB = 2**30, 2**20
MEMORY_KINDS = ("params", "grads", "optimizer", "activations", "buffers", "total")


def add_arguments(parser):
    parser.add_argument("--plan", required=True, help="plan JSON written by `meshplan plan --out`")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (the keys of `estimate --json`) and nothing else")
    parser.add_argument("--trace", metavar="FILE",
                        help="write the step's timeline as Chrome trace-event JSON (open in Perfetto)")
    parser.add_argument("--engine", default=None, choices=ENGINES,
                        help="price memory with this engine's recipe (default: the plan's `engine`)")
    from meshplan.commands.common import add_fp8_recipe_argument

    add_fp8_recipe_argument(parser, "the plan's `fp8_recipe`, else the engine's")


def run(args) -> int:
    from meshplan.planner.contracts.atomicfile import refuse_output_over_input
    from meshplan.planner.contracts.atomicfile import write_text_atomic
    from meshplan.planner.contracts.errors import MeshplanError
    from meshplan.planner.contracts.plan import load_plan
    from meshplan.planner.simulation.simulator import chrome_trace, simulate

    refuse_output_over_input("--trace", args.trace, [("--plan", args.plan)])
    plan = load_plan(args.plan)
    plan = _with_overrides(plan, args.engine, args.fp8_recipe)
    if args.trace and Path(args.trace).is_dir():
        raise MeshplanError(f"--trace {args.trace} is a directory; give a file name such as trace.json")
    prediction = simulate(plan, timeline=bool(args.trace))
    if args.trace:
        write_text_atomic(args.trace, json.dumps(chrome_trace(prediction)), "--trace")
    from meshplan.commands.bands import band_line, with_band

    if args.json:
        from meshplan.commands.common import prediction_json

        data = with_band(prediction_json(prediction, plan.model.spec, plan.model.seq), prediction.step_time_s,
                         plan.config, plan.model.spec, plan.model.seq, plan.cluster)
        print(json.dumps(data))
    else:
        print(summary(plan, prediction))
        print(band_line(prediction.step_time_s, plan.config, plan.model.spec, plan.model.seq, plan.cluster))
        if args.trace:
            print(f"timeline written to {args.trace} (open it in https://ui.perfetto.dev)")
    return 0


def _with_overrides(plan, engine: str | None, fp8_recipe: str | None):
    """The plan under --engine and --fp8-recipe when given, its fp8 recipe checked against its
    cluster (MXFP8 needs Blackwell)."""
    from dataclasses import replace

    from meshplan.planner.costing.fp8 import check_fp8_supported

    config = plan.config
    if engine and engine != config.engine:  # a TP or EP overlap the plan sets travels where the engine runs one
        kept = config.tp_comm_overlap if engine in TP_OVERLAP_ENGINES else None
        config = replace(config, engine=engine, tp_comm_overlap=kept,
                         moe_a2a_overlap=config.moe_a2a_overlap and engine in A2A_OVERLAP_ENGINES,
                         cross_entropy_fusion=ce_fusion_under(engine, config.cross_entropy_fusion),
                         recompute_early_stop=early_stop_under(engine, config.recompute_early_stop),
                         torch_compile=config.torch_compile and engine in COMPILE_ENGINES,
                         compile_loss=config.compile_loss if engine in COMPILE_ENGINES else None,
                         # Transformer Engine's engines convert every Linear: the plan's filter does not travel
                         fp8_filter=config.fp8_filter if engine in FP8_FILTER_ENGINES else ())
    if fp8_recipe:
        check_fp8_supported(plan.cluster, config.precision, fp8_recipe)
        config = replace(config, fp8_recipe=fp8_recipe)
    check_fp8_supported(plan.cluster, config.precision, config.fp8_recipe)
    return plan if config == plan.config else replace(plan, config=config)


def summary(plan, prediction) -> str:
    """Human-readable report of one simulated step."""
    from meshplan.commands.common import throughput_line
    from meshplan.planner.models.plan_check import is_sequence_model

    cfg = plan.config
    schedule = cfg.schedule + (f" x{cfg.virtual_stages} virtual stages" if cfg.schedule_spec.free_chunks else "")
    lines = [
        f"{plan.model.spec}{f' (seq {plan.model.seq})' if is_sequence_model(plan.model.spec) else ''} on "
        f"{cfg.gpus} x {plan.cluster.name}: "
        f"pp={cfg.pp} dp={cfg.dp} tp={cfg.tp}, zero {cfg.zero}{f' (HSDP shard {cfg.shard_group})' if cfg.shard_group else ''}{', sp' if cfg.sp else ''}, {cfg.precision}{f' ({cfg.fp8_recipe})' if cfg.fp8_recipe else ''}"
        + (f", fp8 filter {','.join(cfg.fp8_filter)}" if cfg.fp8_filter else "")
        + (f", memory as {cfg.engine} allocates it" if cfg.engine not in EXECUTOR_MEMORY_ENGINES else "")
        + (f", {cfg.offload} offloaded to host memory" if cfg.offload != "none" else ""),
        f"schedule {schedule}, {cfg.num_microbatches} micro-batches of {cfg.microbatch_size}, "
        f"global batch {cfg.global_batch}",
        "",
        f"step time        {prediction.step_time_s * 1e3:,.1f} ms",
        f"bubble           {prediction.bubble_fraction * 100:.1f} %",
        throughput_line(plan.model.spec, prediction.tokens_per_s, plan.model.seq),
        f"TFLOP/s per GPU  {prediction.model_tflops_per_gpu:.4g} model, {prediction.hw_tflops_per_gpu:.4g} hardware",
        f"MFU              {prediction.mfu * 100:.1f} %",
        "",
        "busiest rank's step (exposed ms): " + ", ".join(
            f"{name} {seconds * 1e3:,.1f}" for name, seconds in prediction.breakdown.items()),
        "",
    ]
    # GiB for real models; MiB keeps the small models of a CPU run readable.
    unit, scale = ("GiB", GIB) if prediction.peak_memory_bytes >= GIB else ("MiB", MIB)
    lines.append(f"memory per pipeline rank ({unit}):")
    lines.append("rank " + "".join(f"{kind:>12}" for kind in MEMORY_KINDS))
    for rank, memory in enumerate(prediction.memory):
        values = memory.to_json()
        lines.append(f"{rank:>4} " + "".join(f"{values[kind] / scale:>12.2f}" for kind in MEMORY_KINDS))
    usable_gib = plan.cluster.device.usable_memory_bytes / GIB
    verdict = "yes" if prediction.fits else "NO"
    lines.append(f"fits: {verdict} (peak {prediction.peak_memory_bytes / scale:.2f} {unit} of {usable_gib:.2f} GiB "
                 f"usable per {plan.cluster.device.name})")
    if prediction.host_state_bytes_per_node:  # offloading: the states a node's host holds
        from meshplan.planner.costing.offload import usable_host_memory_bytes

        lines.append(f"host memory: {prediction.host_state_bytes_per_node / GIB:.2f} GiB of offloaded states on the "
                     f"busiest node, {usable_host_memory_bytes(plan.cluster) / GIB:.2f} GiB usable")
    return "\n".join(lines)
