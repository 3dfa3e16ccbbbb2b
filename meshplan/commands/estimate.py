"""`meshplan estimate`: predict one hand-written configuration (DP = gpus / (tp * pp))."""
from __future__ import annotations

import json
import sys

from meshplan.planner.contracts.config import PRECISIONS, SCHEDULES
from meshplan.planner.contracts.schedule import schedule_spec
from meshplan.commands.common import (GIB, add_axis_arguments, add_job_arguments, announce_model_code, axis_arguments,
                                     check_seq, check_sizes, moe_notes, throughput_line)


def add_arguments(parser) -> None:
    add_job_arguments(parser)
    # --from FILE fills the job from an engine config, so the job arguments are checked in run()
    for action in parser._actions:
        if action.dest in ("model", "cluster", "gpus", "gbs"):
            action.required = False
    parser.add_argument("--from", dest="from_file", default=None, metavar="FILE",
                        help="predict an engine config (torchtitan TOML, Megatron-LM arguments, DeepSpeed JSON)")
    parser.add_argument("--engine", default=None, choices=("torchtitan", "megatron", "deepspeed"),
                        help="engine of --from FILE (default: guessed from the file)")
    add_axis_arguments(parser, 1, skip=("dp",))  # dp = gpus / (pp * cp * tp)
    parser.add_argument("--mbs", type=int, default=1, help="micro-batch size")
    parser.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3), help="ZeRO stage")
    parser.add_argument("--shard-group", type=int, default=None, metavar="N",
                        help="HSDP: shard ZeRO state over groups of N data-parallel ranks and replicate across "
                             "them (needs --zero 1-3; default: shard over all of dp)")
    parser.add_argument("--recompute", default="none", choices=("none", "selective", "full"),
                        help="activation recomputation of the transformer blocks")
    parser.add_argument("--sp", action="store_true", help="sequence parallelism (needs --tp > 1)")
    parser.add_argument("--schedule", default="1f1b", choices=SCHEDULES, help="pipeline schedule")
    parser.add_argument("--vpp", type=int, default=1, help="virtual stages per pipeline rank (interleaved, zb-interleaved; zbv and dualpipev: 2)")
    parser.add_argument("--precision", default=None, choices=PRECISIONS,
                        help="precision recipe (default bf16-mixed on GPUs, fp32 on the cpu profile; fp8: FP8 Linears on Hopper and newer, planned not executed)")
    parser.add_argument("--attention", default="flash", choices=("flash", "math"), help="attention kernel profiled")
    parser.add_argument("--json", action="store_true", help="print one JSON object (keys: docs/architecture.md)")


def run(args) -> int:
    from meshplan.planner.contracts.errors import MeshplanError

    check_seq(args.seq)
    check_sizes(args)
    announce_model_code("estimate", args.model)
    if args.from_file:
        from meshplan.commands.export import estimate_from

        return estimate_from(args, format_prediction)
    missing = [f"--{name}" for name in ("model", "cluster", "gpus", "gbs") if getattr(args, name) is None]
    if missing:
        raise MeshplanError(f"the following arguments are required: {', '.join(missing)} (or --from FILE)")

    notes = moe_notes(args.model, args.moe_imbalance, args.moe_capacity_factor,
                      args.moe_pad_expert_input_to_capacity)
    prediction = _estimate_at(args, args.zero)
    if notes:
        print("\n".join(notes), file=sys.stderr)
    if args.json:
        print(json.dumps(prediction.to_json()))
        return 0
    from meshplan.planner.costing.hardware import load_cluster

    print(format_prediction(prediction, args, load_cluster(args.cluster).device.usable_memory_bytes))
    hint = _zero_hint(args, prediction)
    if hint:
        print(hint)
    return 0


_SHARDS = {1: "optimizer states", 2: "gradients too", 3: "parameters too"}


def _estimate_at(args, zero: int):
    """The command's job at ZeRO stage `zero`."""
    from meshplan.planner.simulation.estimator import estimate

    return estimate(args.model, args.cluster, gpus=args.gpus, global_batch=args.gbs, seq=args.seq,
                    **axis_arguments(args, skip=("dp",)), mbs=args.mbs, zero=zero, recompute=args.recompute,
                    sp=args.sp, schedule=args.schedule, vpp=args.vpp, precision=args.precision,
                    attention=args.attention, shard_group=args.shard_group,
                    moe_imbalance=args.moe_imbalance, moe_capacity_factor=args.moe_capacity_factor,
                    moe_pad_to_capacity=args.moe_pad_expert_input_to_capacity)


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


def format_prediction(prediction, args, usable_memory_bytes: float) -> str:
    """The human-readable breakdown: step time by cause, memory per stage by kind, throughput."""
    step = prediction.step_time_s
    moe = any(getattr(mem, "experts", 0.0) > 0 for mem in prediction.memory)
    cp = args.cp
    dp = args.gpus // (args.tp * args.pp * cp)
    lines = [f"{args.model} on {args.gpus} x {args.cluster}: tp={args.tp} pp={args.pp} dp={dp}"
             + (f" cp={cp}" if cp > 1 else "") + (f" ep={args.ep}" if args.ep > 1 else "")
             + f" mbs={args.mbs} "
             f"zero={args.zero}" + (f" shard_group={args.shard_group}" if getattr(args, "shard_group", None) else "")
             + f" recompute={args.recompute} sp={'on' if args.sp else 'off'} schedule={args.schedule}"
             + (f" vpp={args.vpp}" if schedule_spec(args.schedule).free_chunks else ""),
             "", f"step time        {step * 1e3:10.1f} ms"]
    for kind, seconds in prediction.breakdown.items():
        if seconds > 0:
            lines.append(f"  {kind:<14} {seconds * 1e3:10.1f} ms  {seconds / step:6.1%}")
    from meshplan.reports.plans import is_sequence_model

    sequence_model = is_sequence_model(args.model)
    seq = getattr(args, "seq", None) or _default_seq(args.model)
    lines += ["", throughput_line(args.model, prediction.tokens_per_s, seq),
              f"model TFLOP/s    {prediction.model_tflops_per_gpu:10.1f} per GPU",
              f"hw TFLOP/s       {prediction.hw_tflops_per_gpu:10.1f} per GPU",
              f"MFU              {prediction.mfu:10.1%}"
              + ("   (attention counted in full; step time uses causal FLOPs)" if sequence_model else ""),
              f"HFU              {prediction.hfu:10.1%}   (FLOPs the GPUs execute: "
              + ("causal attention, " if sequence_model else "") + "recomputation)",
              f"bubble           {prediction.bubble_fraction:10.1%}",
              "", "memory per rank (GiB)" + ("; experts: the routed experts' part of params + grads + optim"
                                            if moe else ""),
              f"  {'stage':>5} {'params':>8} {'grads':>8} {'optim':>8} {'activ':>8} {'buffers':>8} {'total':>8}"
              + (f" {'experts':>8}" if moe else "")]
    for rank in _ranks_to_show(prediction):
        if rank is None:
            lines.append(f"  {'...':>5}")
            continue
        mem = prediction.memory[rank]
        lines.append(f"  {rank:>5} {mem.params / GIB:8.2f} {mem.grads / GIB:8.2f} {mem.optimizer / GIB:8.2f} "
                     f"{mem.activations / GIB:8.2f} {mem.buffers / GIB:8.2f} {mem.total / GIB:8.2f}"
                     + (f" {mem.experts / GIB:8.2f}" if moe else ""))
    from meshplan.planner.costing.state_memory import executed_zero

    if executed_zero(args.zero, dp, args.pp, args.schedule) != args.zero:
        lines += ["", f"note: ZeRO-{args.zero} with the {args.schedule} schedule runs as ZeRO-1 (a split backward "
                      "defers gradient sync and resharding to the step's end); priced as executed"]
    verdict = "yes" if prediction.fits else "NO (largest rank exceeds the device's usable memory)"
    lines += ["", f"peak memory      {prediction.peak_memory_bytes / GIB:10.2f} GiB of {usable_memory_bytes / GIB:.2f} "
              f"GiB usable   fits: {verdict}"]
    return "\n".join(lines)


def _default_seq(spec: str) -> int:
    from meshplan.planner.models.registry import default_seq
    from meshplan.planner.simulation.estimator import DEFAULT_SEQ

    return default_seq(spec, DEFAULT_SEQ)


def _ranks_to_show(prediction, limit: int = 8) -> list:
    """Every pipeline rank when few; else the first two, the largest, the last two (None = gap)."""
    count = len(prediction.memory)
    if count <= limit:
        return list(range(count))
    largest = max(range(count), key=lambda r: prediction.memory[r].total)
    shown = sorted({0, 1, largest, count - 2, count - 1})
    out: list = []
    for rank in shown:
        if out and rank != out[-1] + 1:
            out.append(None)
        out.append(rank)
    return out
