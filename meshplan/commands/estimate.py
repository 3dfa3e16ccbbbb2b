"""`meshplan estimate`: predict one hand-written configuration (DP = gpus / (tp * pp))."""
from __future__ import annotations

import json
import sys

from meshplan.planner.contracts.config import DEFAULT_MOE_DISPATCHER, ENGINES, PRECISIONS, RECOMPUTE_MODULES, SCHEDULES
from meshplan.commands.common import (ADVICE_MIN_SAVING, DOES_NOT_FIT_HELP, GIB, add_attention_argument, add_axis_arguments,
                                     add_cross_entropy_fusion_argument, add_grad_reduce_argument, add_fp8_filter_argument,
                                     add_fp8_recipe_argument, add_offload_argument,
                                     add_job_arguments, add_moe_a2a_overlap_argument, add_compile_argument,
                                     add_recompute_early_stop_argument, add_tp_comm_overlap_argument,
                                     announce_model_code, axis_arguments, check_seq, check_sizes, does_not_fit,
                                     job_notes, prediction_json, recompute_early_stop_of, compile_loss_of,
                                     saves_memory, tp_comm_overlap_of)
from meshplan.commands.printed import Heading, format_prediction, with_overlap


def add_arguments(parser) -> None:
    parser.epilog = DOES_NOT_FIT_HELP
    add_job_arguments(parser)
    # --from FILE fills the job from an engine config, so the job arguments are checked in run()
    for action in parser._actions:
        if action.dest in ("model", "cluster", "gpus", "gbs"):
            action.required = False
    parser.add_argument("--from", dest="from_file", default=None, metavar="FILE",
                        help="predict an engine config (torchtitan TOML, Megatron-LM arguments, DeepSpeed JSON)")
    parser.add_argument("--engine", default=None, choices=ENGINES,
                        help="whose memory recipe and communication overlap price the job (default meshplan, "
                             "its own executor; the overlap table: README 'What each engine overlaps'); with "
                             "--from FILE the file's engine (default: guessed from the file)")
    add_axis_arguments(parser, 1, skip=("dp",))  # dp = gpus / (pp * cp * tp)
    parser.add_argument("--mbs", type=int, default=1, help="micro-batch size")
    parser.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3), help="ZeRO stage")
    parser.add_argument("--shard-group", type=int, default=None, metavar="N",
                        help="HSDP: shard ZeRO state over groups of N data-parallel ranks and replicate across "
                             "them (needs --zero 1-3; default: shard over all of dp)")
    parser.add_argument("--recompute", default="none", choices=("none", "selective", "full"),
                        help="activation recomputation of the transformer blocks")
    parser.add_argument("--recompute-modules", nargs="+", default=(), choices=RECOMPUTE_MODULES, metavar="MODULE",
                        help="with --recompute selective and --engine megatron: the submodules rebuilt in backward, "
                             "as Megatron-Core's --recompute-modules (" + ", ".join(RECOMPUTE_MODULES)
                             + "; default core_attn)")
    add_recompute_early_stop_argument(parser)
    add_compile_argument(parser)
    parser.add_argument("--sp", action="store_true", help="sequence parallelism (needs --tp > 1)")
    parser.add_argument("--schedule", default=None, choices=SCHEDULES,
                        help="pipeline schedule (default 1f1b; interleaved with --vpp above 1, as Megatron-LM's "
                             "virtual pipeline size implies)")
    parser.add_argument("--vpp", type=int, default=1, help="virtual stages per pipeline rank (interleaved, zb-interleaved; zbv and dualpipev: 2)")
    parser.add_argument("--microbatch-group-size", type=int, default=None,
                        help="interleaved 1F1B: micro-batches per round of the virtual stages (Megatron-Core's "
                             "--microbatch-group-size-per-virtual-pipeline-stage; default pp; more hold more)")
    add_grad_reduce_argument(parser)
    add_cross_entropy_fusion_argument(parser)
    add_tp_comm_overlap_argument(parser)
    add_moe_a2a_overlap_argument(parser)
    parser.add_argument("--precision", default=None, choices=PRECISIONS,
                        help="precision recipe (default bf16-mixed on GPUs, fp32 on the cpu profile; fp8: FP8 Linears on Hopper and newer, planned not executed)")
    add_fp8_recipe_argument(parser)
    add_fp8_filter_argument(parser)
    add_attention_argument(parser, default=None)
    add_offload_argument(parser, "none")
    parser.add_argument("--memory-headroom", type=float, default=0.0, metavar="GIB",
                        help="GiB each GPU keeps free beyond the profile's reserved_memory_bytes, as for plan "
                             "(default 0; under --engine megatron, torchtitan, deepspeed or llm-foundry the caching allocator's "
                             "fragmentation is counted too, 15%% of activations and buffers, from GMLake, ASPLOS 2024)")
    parser.add_argument("--json", action="store_true", help="print one JSON object (keys: docs/architecture.md)")


def run(args) -> int:
    from meshplan.planner.contracts.errors import MeshplanError

    check_seq(args.seq)
    check_sizes(args)
    announce_model_code("estimate", args.model)
    if args.from_file:
        from meshplan.commands.export import estimate_from

        return estimate_from(args)
    missing = [f"--{name}" for name in ("model", "cluster", "gpus", "gbs") if getattr(args, name) is None]
    if missing:
        raise MeshplanError(f"the following arguments are required: {', '.join(missing)} (or --from FILE)")

    from meshplan.planner.costing.hardware import load_cluster

    cluster = load_cluster(args.cluster)  # loaded once: the kernel note and the band take it
    notes = job_notes(args, cluster)  # every estimate below prices the kernel it settles
    if args.schedule is None:  # virtual stages name the interleaved schedule, as in Megatron-LM
        args.schedule = "interleaved" if args.vpp > 1 else "1f1b"
        if args.vpp > 1:
            notes.append(f"schedule: interleaved, which --vpp {args.vpp} implies (--schedule to change it)")
    prediction = _estimate_at(args, args.zero)
    if notes:
        sys.stderr.write("".join(f"{note}\n" for note in notes))  # one write: a Ctrl-C never splits a line
    from meshplan.planner.simulation.estimator import with_memory_headroom

    from meshplan.commands.bands import band_line, with_band

    cluster = with_memory_headroom(cluster, args.memory_headroom * GIB)
    heading = _heading(args, cluster)
    if args.json:
        from meshplan.commands.printed import _default_seq

        data = with_band(prediction_json(prediction, args.model, args.seq or _default_seq(args.model)),
                         prediction.step_time_s, heading.config, args.model, args.seq, cluster)
        print(json.dumps(with_overlap(data, heading.config)))
        return 0
    print(format_prediction(prediction, heading, cluster.device.usable_memory_bytes, cluster))
    print(band_line(prediction.step_time_s, heading.config, args.model, args.seq, cluster))
    hint = (_zero_hint(args, prediction) or _compile_hint(args, heading.config, prediction)
            or _fp8_filter_hint(args, heading.config, cluster, prediction))
    if hint:
        print(hint)
    return does_not_fit("estimate", prediction, cluster.device.usable_memory_bytes, hint, config=heading.config,
                        cluster=cluster)


_SHARDS = {1: "optimizer states", 2: "gradients too", 3: "parameters too"}


def _heading(args, cluster) -> Heading:
    """The command's configuration (already validated by the estimate itself)."""
    from meshplan.planner.simulation.estimator import default_precision, parallel_config

    config = parallel_config(cluster, gpus=args.gpus, global_batch=args.gbs, **axis_arguments(args, skip=("dp",)),
                             mbs=args.mbs, zero=args.zero, recompute=args.recompute, sp=args.sp,
                             schedule=args.schedule, vpp=args.vpp,
                             precision=args.precision or default_precision(cluster), shard_group=args.shard_group,
                             engine=args.engine or "meshplan", fp8_recipe=args.fp8_recipe,
                             recompute_modules=tuple(args.recompute_modules), offload=args.offload,
                             cp_method=args.cp_method, microbatch_group_size=args.microbatch_group_size,
                             grad_reduce_in_bf16=args.grad_reduce_in_bf16, tp_comm_overlap=tp_comm_overlap_of(args),
                             moe_a2a_overlap=args.moe_a2a_overlap, cross_entropy_fusion=args.cross_entropy_fusion,
                             recompute_early_stop=recompute_early_stop_of(args), torch_compile=args.torch_compile,
                             compile_loss=compile_loss_of(args),
                             fp8_filter=args.fp8_filter)
    modules = f"({','.join(config.recompute_modules)})" if config.recompute_modules else ""
    return Heading(spec=args.model, cluster=args.cluster, config=config, recompute=args.recompute + modules,
                   seq=args.seq)


def _estimate_at(args, zero: int, fp8_filter: tuple[str, ...] | None = None, torch_compile: bool | None = None):
    """The command's job at ZeRO stage `zero` (with `fp8_filter` and `torch_compile` for its own,
    where given)."""
    from meshplan.planner.simulation.estimator import estimate

    return estimate(args.model, args.cluster, gpus=args.gpus, global_batch=args.gbs, seq=args.seq,
                    **axis_arguments(args, skip=("dp",)), mbs=args.mbs, zero=zero, recompute=args.recompute,
                    sp=args.sp, schedule=args.schedule, vpp=args.vpp, precision=args.precision,
                    attention=args.attention, shard_group=args.shard_group,
                    moe_imbalance=args.moe_imbalance, moe_capacity_factor=args.moe_capacity_factor,
                    moe_pad_to_capacity=args.moe_pad_expert_input_to_capacity, engine=args.engine or "meshplan",
                    memory_headroom_bytes=args.memory_headroom * GIB, fp8_recipe=args.fp8_recipe,
                    recompute_modules=tuple(args.recompute_modules), offload=args.offload, cp_method=args.cp_method,
                    moe_dispatcher=args.moe_dispatcher or DEFAULT_MOE_DISPATCHER,
                    microbatch_group_size=args.microbatch_group_size, grad_reduce_in_bf16=args.grad_reduce_in_bf16,
                    tp_comm_overlap=tp_comm_overlap_of(args), mtp_num_layers=args.mtp_num_layers,
                    moe_a2a_overlap=args.moe_a2a_overlap, cross_entropy_fusion=args.cross_entropy_fusion,
                    recompute_early_stop=recompute_early_stop_of(args),
                    torch_compile=args.torch_compile if torch_compile is None else torch_compile,
                    compile_loss=compile_loss_of(args),
                    fp8_filter=args.fp8_filter if fp8_filter is None else fp8_filter)


def _fp8_filter_hint(args, config, cluster, prediction) -> str:
    """Under fp8, the block Linears the cost model finds faster left in bf16
    (`costing.fp8_advice.best_on_path`): the filter on its path whose step is shortest, and that
    step, when it saves any."""
    if config.precision != "fp8" or not prediction.fits:
        return ""
    from meshplan.planner.costing.attention_kernels import engine_attention
    from meshplan.planner.costing.fp8_advice import best_on_path
    from meshplan.planner.profiling.profiler import profile

    from meshplan.commands.printed import _default_seq

    graph = profile(args.model, args.seq or _default_seq(args.model), dtype="bf16",
                    attention=engine_attention(config.engine, args.attention)[0], engine=config.engine)
    best = best_on_path(graph, cluster, config, lambda names: _estimate_at(args, args.zero, names))
    if best is None or best[1] >= prediction.step_time_s:
        return ""
    names, best_s = best
    slower = ", ".join(name for name in names if name not in config.fp8_filter)
    return (f"hint: {slower} run faster in bf16 at these shapes (their casts cost more than fp8 saves): "
            f"--fp8-filter {','.join(names)} gives {best_s * 1e3:.1f} ms per step "
            f"({1 - best_s / prediction.step_time_s:.1%} less)")


def _compile_hint(args, config, prediction) -> str:
    """Under an engine that compiles (torchtitan) run without it: the step with --compile, where it
    fits and saves at least `ADVICE_MIN_SAVING` of the step, or memory at the peak (`saves_memory`:
    its loss compiled with it, `engine_rules.compiles_loss`), or fits where this does not.
    torch.compile fuses the blocks' elementwise kernels (`costing.eager_kernels`), under fp8 makes
    one cast of each shared input (`costing.fp8_eager`), and its compiled loss keeps the logits in
    bf16 (`costing.engine_memory`)."""
    from dataclasses import replace

    from meshplan.planner.contracts.engine_rules import compiles_loss, could_compile
    from meshplan.planner.costing.fp8_eager import casts_eagerly

    if not could_compile(config):
        return ""
    compiled = _estimate_at(args, args.zero, torch_compile=True)
    faster = compiled.step_time_s <= (1 - ADVICE_MIN_SAVING) * prediction.step_time_s
    saved_bytes = prediction.peak_memory_bytes - compiled.peak_memory_bytes
    leaner = saves_memory(prediction.peak_memory_bytes, compiled.peak_memory_bytes)
    if not compiled.fits or not (faster or leaner or not prediction.fits):
        return ""
    why = ["it fuses the blocks' elementwise kernels" + (" and casts each shared Float8 Linear input once (eagerly "
           "each Linear casts its own, forward and again backward)" if casts_eagerly(config) else "")]
    if compiles_loss(replace(config, torch_compile=True)) and not compiles_loss(config):
        why.append(_compiled_loss_why(leaner))
    gains = []
    if faster:
        gains.append(f"{compiled.step_time_s * 1e3:.1f} ms per step "
                     f"({1 - compiled.step_time_s / prediction.step_time_s:.1%} less)")
    if leaner or not prediction.fits:
        gains.append(f"a {compiled.peak_memory_bytes / GIB:.1f} GiB peak ({saved_bytes / GIB:.1f} GiB less"
                     f"{', which fits' if not prediction.fits else ''})")
    return (f"hint: --compile (torch.compile, {config.engine}'s training.compile) gives {' and '.join(gains)}: "
            f"{'; '.join(why)}")


def _compiled_loss_why(leaner: bool) -> str:
    """What compiling the loss changes (`loss_kernels.torch_ce_moved_bytes_per_logit`): the bytes a
    logit its kernels move, and where the memory drops, what it keeps."""
    from meshplan.planner.costing.loss_kernels import torch_ce_moved_bytes_per_logit

    eager = sorted(torch_ce_moved_bytes_per_logit(kind) for kind in ("eager", "loss_parallel"))
    moved = f"moves {torch_ce_moved_bytes_per_logit('compiled'):.0f} bytes a logit"
    eager_moved = f"moves {eager[0]:.0f} to {eager[1]:.0f}"
    if leaner:
        return (f"its compiled loss keeps the logits in bf16 and {moved}, where the eager one keeps fp32 log-probs "
                f"and fp32 copies in backward and {eager_moved}")
    return f"its compiled loss {moved}, where the eager one {eager_moved}"

def _zero_hint(args, prediction) -> str:
    """When the configuration does not fit, the first higher ZeRO stage that does (same job)."""
    dp = args.gpus // (args.tp * args.pp * args.cp)
    if prediction.fits or dp * args.cp <= 1 or args.zero >= 3:
        return ""
    from meshplan.planner.contracts.errors import MeshplanError

    for zero in range(args.zero + 1, 4):
        try:
            other = _estimate_at(args, zero)
        except MeshplanError:
            return ""
        if other.fits:
            return (f"hint: with --zero {zero} (sharding the {_SHARDS[zero]}) it fits: "
                    f"{other.peak_memory_bytes / GIB:.2f} GiB per GPU, step {other.step_time_s * 1e3:.1f} ms")
    return ""
