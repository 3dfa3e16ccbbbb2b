"""Arguments that several commands share, defined once so their help and defaults agree."""
from __future__ import annotations

GIB = 2**30
# `estimate` without --json: the configuration was priced but its largest rank exceeds the device's
# usable memory (the table is printed; one line on stderr says so). With --json it exits 0 and
# the answer is the `fits` key. Bad input stays 2, internal errors 1.
EXIT_DOES_NOT_FIT = 2  # the contract's code for an impossible request
# `estimate`'s and `plan`'s advice (--compile, the loss kernel) names a change that saves at least this share of the step
ADVICE_MIN_SAVING = 0.01
# ... or of the peak memory, and at least this many bytes of it (less is noise to a user)
ADVICE_MIN_MEMORY_SAVING_BYTES = 2**30


def saves_memory(before_bytes: float, after_bytes: float) -> bool:
    """Whether a change from a peak of `before_bytes` to `after_bytes` is worth naming in advice."""
    return before_bytes - after_bytes >= max(ADVICE_MIN_SAVING * before_bytes, ADVICE_MIN_MEMORY_SAVING_BYTES)
DOES_NOT_FIT_HELP = ("exit codes: 0 the configuration fits, 2 bad input or a configuration priced that does not "
                     "fit (one line on stderr; with --json: 0, and the answer is the 'fits' key), 1 an internal error")


def does_not_fit(command: str, prediction, usable_memory_bytes: float, hint: str = "", *, config=None,
                 cluster=None) -> int:
    """The exit code of a printed estimate: 0, or EXIT_DOES_NOT_FIT with one line on stderr. With the
    `config` and `cluster` it was priced on, a job that fits on the GPUs but not in their nodes'
    host memory (offloading) says so and what would fit."""
    import sys

    if prediction.fits:
        return 0
    if config is not None and prediction.peak_memory_bytes <= usable_memory_bytes:
        from meshplan.planner.costing.offload import host_refusal

        print(f"meshplan {command}: {host_refusal(prediction.host_state_bytes_per_node, config, cluster)}",
              file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    print(f"meshplan {command}: does not fit: {prediction.peak_memory_bytes / GIB:.2f} GiB on the largest rank, "
          f"{usable_memory_bytes / GIB:.2f} GiB usable" + (f"; {hint.removeprefix('hint: ')}" if hint else
                                                           "; see `meshplan plan` for a layout that fits"),
          file=sys.stderr)
    return EXIT_DOES_NOT_FIT


def finite_float(text: str) -> float:
    """argparse type of every real-valued flag: a finite number (inf and nan are refused in one line)."""
    import argparse
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def add_axis_arguments(parser, default: int | None, skip: tuple[str, ...] = ()) -> None:
    """One option per parallel axis (`contracts.axes`: --pp --dp --cp --tp --etp --ep) but those in
    `skip`; one that follows another (--etp: --tp) defaults to unset."""
    from meshplan.planner.contracts.axes import AXES

    from meshplan.planner.contracts.config import CP_METHODS

    for axis in AXES:
        if axis.name not in skip:
            parser.add_argument(axis.flag, type=int, default=None if axis.follows else default, help=axis.help)
        if axis.name == "cp":
            parser.add_argument("--cp-method", default=None, choices=CP_METHODS,
                                help="how context-parallel ranks attend (with --cp > 1): all-gather (default; K/V "
                                     "all-gathered before attention) or ulysses (all-to-alls turn sequence shards "
                                     "into head shards; heads/tp must be divisible by cp)")


def axis_arguments(args, skip: tuple[str, ...] = ()) -> dict[str, int | None]:
    """The parallel degrees `add_axis_arguments` parsed, by axis name."""
    from meshplan.planner.contracts.axes import AXIS_NAMES

    return {name: getattr(args, name) for name in AXIS_NAMES if name not in skip}


def add_attention_argument(parser, default: str | None = "flash") -> None:
    """--attention: the attention kernel by name (`contracts.attention`); `flash` is sdpa-flash.
    `default` None: the command picks the engine's own kernel (`attention_kernels.engine_attention`)."""
    from meshplan.planner.contracts.attention import ATTENTION_CHOICES, attention_help
    from meshplan.planner.costing.attention_kernels import ENGINE_DEFAULT_ATTENTION

    others = "; ".join(f"{kernel} under --engine {engine}" for engine, kernel in ENGINE_DEFAULT_ATTENTION.items()
                       if kernel != "flash")
    after = f" (default {default})" if default else f" (default: the kernel the engine runs: {others}; flash otherwise)"
    parser.add_argument("--attention", default=default, choices=ATTENTION_CHOICES, metavar="KERNEL",
                        help=f"attention kernel, priced by sequence length, head dimension and device: "
                             f"{attention_help()}{after}")


def add_grad_reduce_argument(parser) -> None:
    """--grad-reduce-in-bf16: Megatron-LM's bf16 gradient buffer (`ParallelConfig.grad_reduce_in_bf16`),
    priced in the megatron memory recipe and in the gradient reduction's bytes."""
    parser.add_argument("--grad-reduce-in-bf16", action="store_true",
                        help="with --engine megatron: gradients accumulate and reduce in bf16 (Megatron-LM's "
                             "--grad-reduce-in-bf16), a 2-byte gradient buffer and reduction instead of fp32's 4")


def add_cross_entropy_fusion_argument(parser) -> None:
    """--cross-entropy-fusion: Megatron-Core's cross-entropy kernels (`ParallelConfig.cross_entropy_fusion`),
    priced by the bytes they move per logit (`costing.loss_kernels`)."""
    from meshplan.planner.contracts.engine_rules import CE_FUSIONS

    parser.add_argument("--cross-entropy-fusion", choices=CE_FUSIONS, default="none",
                        help="with --engine megatron: the loss kernels, none (Megatron-LM's default, unfused fp32), "
                             "native (--cross-entropy-loss-fusion) or te (with --cross-entropy-fusion-impl te)")


def add_tp_comm_overlap_argument(parser) -> None:
    """--tp-comm-overlap on|off: whether the sequence-parallel TP collectives are pipelined with
    their GEMMs (`ParallelConfig.tp_comm_overlap`); absent, the engine's record (`contracts.overlap`)."""
    from meshplan.planner.contracts.config import TP_OVERLAP_ENGINES
    from meshplan.planner.contracts.overlap import engine_overlap

    defaults = ", ".join(f"{engine} {'on' if engine_overlap(engine).tp_comm_overlap else 'off'}"
                         for engine in TP_OVERLAP_ENGINES)
    parser.add_argument("--tp-comm-overlap", choices=("on", "off"), default=None,
                        help=f"pipeline the sequence-parallel TP all-gathers and reduce-scatters with their GEMMs "
                             f"(Megatron-LM's --tp-comm-overlap, torchtitan's async TP; needs --tp > 1 and --sp); "
                             f"default: the engine's ({defaults}; the other engines block on them)")


def add_recompute_early_stop_argument(parser) -> None:
    """--recompute-early-stop on|off: torch's checkpoint early stop under full recomputation
    (`ParallelConfig.recompute_early_stop`); absent, the engine's rule (`engine_rules.early_stop_default`)."""
    from meshplan.planner.contracts.engine_rules import EARLY_STOP_RECOMPUTE_ENGINES

    parser.add_argument("--recompute-early-stop", choices=("on", "off"), default=None,
                        help="with --recompute full: whether a checkpointed block stops rerunning once it has rebuilt "
                             "what its backward needs (torch.utils.checkpoint's non-reentrant early stop, torch 2.1 "
                             "and later; off for torch 2.0 and older or set_checkpoint_early_stop(False)); default: "
                             f"the engine's (on for {', '.join(EARLY_STOP_RECOMPUTE_ENGINES)}; megatron and deepspeed "
                             "rerun the whole block and cannot)")


def recompute_early_stop_of(args) -> bool | None:
    """`ParallelConfig.recompute_early_stop` of --recompute-early-stop (None: the engine's rule)."""
    return on_off(args.recompute_early_stop)


def add_compile_argument(parser) -> None:
    """--compile: the engine compiles the model (`ParallelConfig.torch_compile`); --compile-loss: the
    loss apart from it (`ParallelConfig.compile_loss`)."""
    from meshplan.planner.costing.loss_kernels import TORCH_CE_BYTES_PER_LOGIT, torch_ce_moved_bytes_per_logit

    parser.add_argument("--compile", dest="torch_compile", action="store_true",
                        help="with --engine torchtitan: the model runs under torch.compile (its [compile] enable); "
                             "meshplan prices its Float8 casts fused with the ops before them (torchao's float8 "
                             "roofline) and its Llama blocks' elementwise kernels fused")
    moved = {kind: f"{torch_ce_moved_bytes_per_logit(kind):.0f}" for kind in TORCH_CE_BYTES_PER_LOGIT}
    parser.add_argument("--compile-loss", choices=("on", "off"), default=None,
                        help="with --engine torchtitan: whether the loss runs under torch.compile, whose fused "
                             f"cross-entropy keeps the logits in bf16 and moves {moved['compiled']} bytes a logit, "
                             "where the eager one keeps fp32 log-probs and two or three fp32 copies in backward and "
                             f"moves {moved['eager']} or {moved['loss_parallel']}; default: with the model (torchtitan "
                             "0.2's [compile] components; before April 2025 torchtitan compiled the model alone)")


def compile_loss_of(args) -> bool | None:
    """`ParallelConfig.compile_loss` of --compile-loss (None: with the model)."""
    return on_off(getattr(args, "compile_loss", None))


def add_moe_a2a_overlap_argument(parser) -> None:
    """--moe-a2a-overlap: Megatron-Core's combined 1F1B (`ParallelConfig.moe_a2a_overlap`)."""
    parser.add_argument("--moe-a2a-overlap", action="store_true",
                        help="with --engine megatron and --ep > 1: pair each micro-batch's forward with another's "
                             "backward so their expert all-to-alls run beside the other's compute (Megatron-LM's "
                             "--overlap-moe-expert-parallel-comm, combined 1F1B; with --pp > 1 it needs --vpp 2 or "
                             "more)")


# What `estimate` and `plan` say under --moe-a2a-overlap: what the combined 1F1B's price leaves out,
# and what the published runs with it read (benchmarks/bench_fidelity.py's MoE section).
A2A_OVERLAP_NOTE = ("note: --moe-a2a-overlap prices the combined 1F1B from its schedule alone, not its host-side "
                    "cost: of the layouts published with and without it, meshplan predicts the speed-up measured "
                    "under HybridEP and a larger one under DeepEP with pipelining and under NCCL's all-to-all "
                    "(benchmarks/bench_fidelity.py), and Megatron-Bridge turned it off for Qwen3-235B on B200 for "
                    "CPU overhead; read its gain as an upper bound")


def a2a_overlap_notes(args) -> list[str]:
    return [A2A_OVERLAP_NOTE] if getattr(args, "moe_a2a_overlap", False) else []


def on_off(value: str | None) -> bool | None:
    """An on|off flag's value as a configuration field takes it (None, absent: the engine's default)."""
    return None if value is None else value == "on"


def tp_comm_overlap_of(args) -> bool | None:
    """`ParallelConfig.tp_comm_overlap` of --tp-comm-overlap (None: the engine's default)."""
    return on_off(args.tp_comm_overlap)


def add_fp8_recipe_argument(parser, default_help: str = "the engine's") -> None:
    """--fp8-recipe: how fp8 scales the GEMM operands (`contracts.config.FP8_RECIPES`, priced by
    `planner.costing.fp8`); only with --precision fp8."""
    from meshplan.planner.contracts.config import DEFAULT_FP8_RECIPE, FP8_RECIPES

    defaults = ", ".join(f"{engine} {recipe}" for engine, recipe in DEFAULT_FP8_RECIPE.items())
    parser.add_argument("--fp8-recipe", default=None, choices=FP8_RECIPES,
                        help=f"with --precision fp8: tensorwise or delayed (per-tensor scales from the current "
                             f"amax or an amax history), rowwise, or mxfp8 (32-value blocks, Blackwell only); "
                             f"default {default_help} ({defaults})")
def fp8_filter_names(text: str) -> tuple[str, ...]:
    """argparse type of --fp8-filter (`contracts.fp8_choice.parse_fp8_filter`)."""
    import argparse

    from meshplan.planner.contracts.fp8_choice import parse_fp8_filter

    try:
        return parse_fp8_filter(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_fp8_filter_argument(parser) -> None:
    """--fp8-filter: the block Linears left in bf16 under fp8 (`costing.fp8_filter`)."""
    parser.add_argument("--fp8-filter", default=(), type=fp8_filter_names, metavar="NAMES",
                        help="with --precision fp8 under torchao's Linears (engines meshplan, generic, torchtitan): "
                             "block Linears kept in bf16, comma-separated from q,k,v,o,gate,up,down (torchtitan's "
                             "filter_fqns names too: attention.wk or wk), or auto: torchao's auto filter "
                             "(torchtitan's auto_filter_small_kn), which keeps Linears too small for the recipe; "
                             "plan also takes fastest: each candidate keeps in bf16 the Linears meshplan's cost model "
                             "finds faster so on its shards; default: every block Linear in fp8")


def add_offload_argument(parser, default: str | None) -> None:
    """--offload: model states kept in host memory (`costing.offload`). `default` None: searched
    (plan offers it only when nothing fits without it)."""
    from meshplan.planner.contracts.config import OFFLOAD

    searched = "; default: none, and plan offloads only when nothing fits on the GPUs without it" \
        if default is None else " (default none)"
    parser.add_argument("--offload", default=default, choices=OFFLOAD,
                        help="keep model states in host memory as DeepSpeed ZeRO-Offload and Megatron-LM do: "
                             "optimizer (states and step on the CPU) or params (also parameters and gradients, "
                             f"ZeRO-3 only; FSDP2 CPUOffloadPolicy){searched}; planned, not executed")


def add_job_arguments(parser) -> None:
    """--model --cluster --gpus --gbs --seq: what is trained, where, and on how much data per step."""
    from meshplan.planner.costing.hardware import profile_listing

    parser.add_argument("--model", required=True,
                        help="model SPEC (built-in name, gpt:/llama: spec, file.py:fn, hf:config.json or hf:owner/name)")
    parser.add_argument("--cluster", required=True,
                        help=f"cluster profile: a .toml path or a built-in name: {profile_listing()}")
    parser.add_argument("--gpus", type=int, required=True, help="number of GPUs (cpu profile: local processes)")
    parser.add_argument("--gbs", type=int, required=True, help="global batch size in samples per optimizer step")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default 2048, GPT-2 presets 1024)")
    add_moe_imbalance_argument(parser)
    add_moe_capacity_arguments(parser)
    add_mtp_argument(parser)


def add_mtp_argument(parser) -> None:
    """--mtp-num-layers N: multi-token-prediction depths (`profiling.mtp`)."""
    parser.add_argument("--mtp-num-layers", type=int, default=0, metavar="N",
                        help="multi-token prediction (DeepSeek-V3's MTP, Megatron-LM's --mtp-num-layers): N more "
                             "depths, each one more transformer block of the model's last kind with its projection, "
                             "on the last pipeline stage, and N more output-layer passes (default 0)")


# Sanity bounds on the sizes a command line asks for, checked before any model is profiled or any
# solver sees them (a length of 2**40 tokens overflows the ILP's index arithmetic). Far above any
# real training run: 16M-token sequences, 1M-sample global batches, a million GPUs. A model's own
# position limit, where it has one (an HF config's max_position_embeddings), is checked by the profiler.
MAX_SEQ_TOKENS = 2**24
MAX_GLOBAL_BATCH = 2**20
MAX_GPUS = 2**20


def check_seq(seq: int | None) -> None:
    """--seq, when given, must be a positive length (0 is not "the default") of at most MAX_SEQ_TOKENS."""
    from meshplan.planner.contracts.errors import MeshplanError

    if seq is not None and seq <= 0:
        raise MeshplanError(f"--seq must be a positive integer, got {seq}")
    if seq is not None and seq > MAX_SEQ_TOKENS:
        raise MeshplanError(f"--seq {seq:,} is above meshplan's bound of {MAX_SEQ_TOKENS:,} tokens (2**24) per "
                            "sequence; give a real sequence length")


def check_sizes(args) -> None:
    """--gpus and --gbs, where the command has them and they are given: positive and within bounds."""
    from meshplan.planner.contracts.errors import MeshplanError

    for flag, name, bound, unit in (("--gpus", "gpus", MAX_GPUS, "GPUs (2**20)"),
                                    ("--gbs", "gbs", MAX_GLOBAL_BATCH, "samples (2**20)")):
        value = getattr(args, name, None)
        if value is None:
            continue
        if value <= 0:
            raise MeshplanError(f"{flag} must be a positive integer, got {value}")
        if value > bound:
            raise MeshplanError(f"{flag} {value:,} is above meshplan's bound of {bound:,} {unit}; give a real size")


def spec_file(spec: str | None) -> str | None:
    """The file a model spec names (`path.py:fn`, `hf:config.json`); None for built-in specs."""
    from meshplan.planner.models.plan_check import spec_file as _spec_file

    return _spec_file(spec) if spec else None


def announce_model_code(command: str, spec: str | None) -> None:
    """One stderr line before a file model's Python code runs: profile, plan, estimate and train run
    it (simulate, report, compare and export never do; they read the graph the plan carries)."""
    import sys
    from pathlib import Path

    path = spec.rpartition(":")[0] if spec and spec.partition(":")[0].endswith(".py") else None
    if path and Path(path).is_file():  # a missing file is the build's one-line error, nothing runs
        print(f"meshplan {command}: running model code from {path} (a model file is trusted code)", file=sys.stderr)


def prediction_json(prediction, spec: str, seq: int) -> dict:
    """`Prediction.to_json()`, plus `samples_per_s` for file models (counted in samples, not tokens;
    `tokens_per_s` stays for scripts: samples/s times the plan's placeholder length)."""
    from meshplan.planner.models.plan_check import is_sequence_model

    out = prediction.to_json()
    if not is_sequence_model(spec):
        out["samples_per_s"] = prediction.tokens_per_s / seq
    return out


def throughput_line(spec: str, tokens_per_s: float, seq: int) -> str:
    """'tokens/s  N' for sequence models; file models (any nn.Module) are counted in samples."""
    from meshplan.reports.plans import is_sequence_model

    if is_sequence_model(spec):
        return f"tokens/s         {tokens_per_s:12,.0f}"
    return f"samples/s        {tokens_per_s / seq:12,.1f}"


def add_moe_imbalance_argument(parser) -> None:
    parser.add_argument("--moe-imbalance", type=finite_float, default=1.0, metavar="F",
                        help="mixture of experts: the busiest expert receives F times the balanced tokens * top_k / "
                             "experts (>= 1.0, default 1.0 = balanced); the cost model scales the busiest rank's "
                             "expert GEMM time, saved expert activations and received all-to-all tokens by F")


def add_moe_capacity_arguments(parser) -> None:
    from meshplan.planner.contracts.config import MOE_DISPATCHERS

    parser.add_argument("--moe-capacity-factor", type=finite_float, default=None, metavar="C",
                        help="mixture of experts: each expert takes at most C times the balanced tokens * top_k / "
                             "experts, the rest dropped (> 0; default none: nothing dropped); the busiest rank is "
                             "costed at min(F, C) of the balanced share and the dropped share is reported")
    parser.add_argument("--moe-pad-expert-input-to-capacity", action="store_true",
                        help="with --moe-capacity-factor: pad every expert's input to its capacity (Megatron-LM's "
                             "flag of that name); expert GEMMs and all-to-alls are then costed at C, not min(F, C)")
    parser.add_argument("--moe-dispatcher", default=None, choices=MOE_DISPATCHERS,
                        help="mixture of experts: how tokens reach the experts' ranks, as Megatron-Core's token "
                             "dispatchers: alltoall (every routed copy; the default), allgather (every token "
                             "gathered over the EP group), deepep (flex with DeepEP: a token sent once per "
                             "destination node over the rails and forwarded over NVLink inside it)")


def job_notes(args, cluster, searched: bool = False) -> list[str]:
    """What `estimate` and `plan` say on stderr before pricing a job, and the kernel they price:
    where --attention names none, `args.attention` becomes the kernel the engine runs and the first
    note says so, with what it is costed as on `cluster` (`attention_kernels.engine_attention`);
    then the model's, the mixture of experts' and the combined 1F1B's notes (`searched`: `plan`)."""
    from meshplan.planner.costing.attention_kernels import engine_attention

    args.attention, attention_note = engine_attention(args.engine, args.attention, cluster)
    return (([attention_note] if attention_note else [])
            + model_notes(args.model, args.seq, args.mtp_num_layers, searched, args.engine)
            + moe_notes(args.model, args.moe_imbalance, args.moe_capacity_factor, args.moe_pad_expert_input_to_capacity)
            + a2a_overlap_notes(args))


def model_notes(spec: str | None, seq: int | None, mtp_num_layers: int = 0, searched: bool = False,
                engine: str | None = None) -> list[str]:
    """What the model's costs assume beyond its published shape: a rotary model past its trained
    context; an `hf:` config priced as `engine` builds it, or a traced mixture of experts whose
    memory is not torchtitan's own (`models.hf_engine`); a config that
    names multi-token-prediction depths (`num_nextn_predict_layers`, DeepSeek-V3's) priced without
    them (`searched`: planned, by `plan`)."""
    from meshplan.planner.models.hf_engine import engine_note
    from meshplan.planner.models.registry import context_note, hf_config_path
    from meshplan.planner.profiling.mtp import config_mtp_layers

    notes = [note] if (note := context_note(spec, seq)) else []
    config_path = hf_config_path(spec) if spec and engine else None
    if config_path is not None and (note := engine_note(config_path, engine)):
        notes.append(f"note: {note}")
    named = 0 if mtp_num_layers else config_mtp_layers(spec)
    if named:
        notes.append(f"note: the model's config names {named} multi-token-prediction layer(s), "
                     f"{'planned' if searched else 'priced'} without them; --mtp-num-layers {named} adds them as "
                     "Megatron-LM trains them (--mtp-num-layers)")
    return notes


def moe_notes(spec: str | None, moe_imbalance: float, moe_capacity_factor: float | None = None,
              pad_to_capacity: bool = False) -> list[str]:
    """Checks --moe-imbalance and --moe-capacity-factor; for a mixture of experts, the routing
    assumption the costs rest on and, with a capacity factor, the dropped share."""
    from meshplan.planner.contracts.errors import MeshplanError
    from meshplan.planner.costing import expert_parallel as epm
    from meshplan.planner.models.registry import is_moe_spec

    if not 1.0 <= moe_imbalance < float("inf"):
        raise MeshplanError(f"--moe-imbalance must be >= 1.0 (1.0: balanced routing), got {moe_imbalance}")
    if moe_capacity_factor is not None and not 0.0 < moe_capacity_factor < float("inf"):
        raise MeshplanError(f"--moe-capacity-factor must be a finite number > 0, got {moe_capacity_factor}")
    if pad_to_capacity and moe_capacity_factor is None:
        raise MeshplanError("--moe-pad-expert-input-to-capacity needs --moe-capacity-factor C")
    if spec is None:
        return []
    if not is_moe_spec(spec):
        if moe_imbalance != 1.0:
            raise MeshplanError(f"--moe-imbalance needs a mixture-of-experts model; {spec!r} has no experts")
        if moe_capacity_factor is not None:
            raise MeshplanError(f"--moe-capacity-factor needs a mixture-of-experts model; {spec!r} has no experts")
        return []
    if moe_imbalance != 1.0 and moe_capacity_factor is not None:
        notes = [f"note: mixture of experts: the busiest expert is routed {moe_imbalance:g}x the balanced share "
                 "(--moe-imbalance), costed as its capacity allows (below)"]
    elif moe_imbalance != 1.0:
        notes = [f"note: mixture of experts: the busiest rank's expert GEMMs, saved expert activations and "
                 f"received all-to-all tokens are costed at {moe_imbalance:g}x the balanced share (--moe-imbalance)"]
    else:
        notes = ["note: mixture of experts, costed under balanced routing (every expert gets tokens * top_k / "
                 "experts); --moe-imbalance F charges the busiest rank F times that"]
    if moe_capacity_factor is None:
        return notes
    load = epm.routed_load(moe_imbalance, moe_capacity_factor, pad_to_capacity)
    how = "padded to capacity" if pad_to_capacity else "min(F, C)"
    line = (f"note: capacity factor {moe_capacity_factor:g}: the busiest rank is costed at {load:g}x the balanced "
            f"share ({how}); dropped: {epm.dropped_share_of(moe_imbalance, moe_capacity_factor):.1%} of the copies routed to the busiest expert")
    if moe_imbalance > moe_capacity_factor:
        line += " (1 - C/F; at least (F - C)/experts of all routed copies in a step)"
    return notes + [line]
