"""Megatron-LM: a plan as `pretrain_gpt.py` arguments, and arguments (a file or a launch script)
back into an `EngineJob`.

Megatron places the embedding on the first pipeline stage and the output layer on the last, and
counts only transformer layers in its split: uniform (`--num-layers` / (pp * vpp) per chunk), or
uneven first and last stages (`--decoder-first-pipeline-num-layers`,
`--decoder-last-pipeline-num-layers`) with the rest spread evenly. Recomputation is one rule for
the whole model: selective (the attention core), or full for the first N layers of every chunk
(`--recompute-method block`) or for every layer (`uniform`). Its pipeline schedule is 1F1B, or
interleaved 1F1B with virtual stages. `--use-distributed-optimizer` shards the optimizer states
over the data-parallel ranks (ZeRO-1); gradients accumulate in fp32 (`--grad-reduce-in-bf16`: bf16).
"""
from __future__ import annotations

import re

from meshplan.planner.contracts.config import DEFAULT_FP8_RECIPE, FP8_RECIPES, RECOMPUTE_MODULES
from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.engines import job as layout
from meshplan.planner.engines.job import EngineJob
from meshplan.planner.engines.launch_script import parse_arguments
from meshplan.planner.engines.megatron_hf import hf_megatron_args, plan_hybrid_pattern, published_spec
from meshplan.planner.engines.megatron_split import (LAYOUT_FLAG, VPP_FLAG, hybrid_layout_args, mtp_args, read_cut,
                                                     split_args)
from meshplan.planner.engines.shapes import spec_for_shape, zoo_shape
from meshplan.planner.models.config import TransformerConfig
from meshplan.planner.models.registry import hf_config_path

MEGATRON_NORM_EPSILON = 1e-5  # Megatron-LM's --norm-epsilon default

# Megatron-LM's flag for each parallel axis (`contracts.axes`; dp follows from the world size).
AXIS_FLAGS = {"tp": "--tensor-model-parallel-size", "pp": "--pipeline-model-parallel-size",
              "cp": "--context-parallel-size", "ep": "--expert-model-parallel-size",
              "etp": "--expert-tensor-parallel-size"}
# Megatron-LM's flags for a job's batch, sequence, schedule and recomputation: the plan field each
# sets (the export writes them, `read_megatron_args` reads them, and `meshplan.flag_hints` names
# meshplan's flag for each).
BATCH_FLAGS = {"gbs": "--global-batch-size", "mbs": "--micro-batch-size", "seq": "--seq-length"}
SP_FLAG, RECOMPUTE_FLAG = "--sequence-parallel", "--recompute-granularity"
# Megatron-Core's context-parallel communication type: meshplan's Ulysses is its "a2a". Its
# default "p2p" (ring attention), "allgather" and the hierarchical "a2a+p2p" are priced as the
# all-gather method (`contracts.config.CP_METHODS`), which moves the same K/V bytes per rank.
CP_COMM_FLAG = "--cp-comm-type"
CP_COMM_TYPES = {"a2a": "ulysses", "allgather": "all-gather", "p2p": "all-gather", "a2a+p2p": "all-gather"}
# HSDP under the distributed optimizer: the optimizer states shard within dp / N ranks, N copies.
INSTANCES_FLAG = "--num-distributed-optimizer-instances"
GROUP_FLAG = "--microbatch-group-size-per-virtual-pipeline-stage"  # a plan's `microbatch_group_size`
BF16_GRADS_FLAG = "--grad-reduce-in-bf16"  # a bf16 gradient buffer: the plan's `grad_reduce_in_bf16`
# Transformer Engine's userbuffers TP overlap, off unless named (megatron/training/arguments.py): the
# plan's `tp_comm_overlap`, read as given; meshplan's megatron record prices it on where no file says.
TP_OVERLAP_FLAG = "--tp-comm-overlap"
# Megatron-Core's combined 1F1B (the plan's `moe_a2a_overlap`), off unless named.
A2A_OVERLAP_FLAG = "--overlap-moe-expert-parallel-comm"
# Megatron-Core's fused loss (the plan's `cross_entropy_fusion`), off unless named; its kernels "native"
# unless --cross-entropy-fusion-impl names te.
CE_FUSION_FLAG, CE_IMPL_FLAG = "--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl"
# Megatron-LM's --fp8-recipe choices that meshplan prices (megatron/training/arguments.py also
# offers blockwise; it has no rowwise).
MEGATRON_FP8_RECIPES = ("tensorwise", "delayed", "mxfp8")
# Megatron-Core's token dispatcher (0.12 on: --moe-token-dispatcher-type allgather|alltoall|flex,
# DeepEP under flex with --moe-enable-deepep); absent, its default allgather.
DISPATCHER_FLAG, DEEPEP_FLAG = "--moe-token-dispatcher-type", "--moe-enable-deepep"
MEGATRON_DISPATCHERS = {"alltoall": "alltoall", "allgather": "allgather", "flex": "deepep",
                        "alltoall_seq": "alltoall"}  # alltoall_seq (before 0.12) sends as alltoall
HEADER = "# meshplan:"  # the line that records what the arguments cannot say (world size, model SPEC)


def _overlap_args(cfg) -> list[tuple[str, object]]:
    """The overlap flags of meshplan's megatron record, with the plan's own TP overlap where it
    sets one (`costing.overlap.overlap_under`), where they apply: TP overlap needs tp > 1 and SP;
    the distributed optimizer's gradient and parameter overlap."""
    from meshplan.planner.costing.overlap import overlap_under

    overlap, out = overlap_under(cfg, "megatron"), []
    if overlap.tp_comm_overlap and cfg.tp > 1 and cfg.sp:
        out.append((TP_OVERLAP_FLAG, None))
    if cfg.data_ranks > 1 and overlap.grad_reduce_overlaps(cfg.zero):
        out.append(("--overlap-grad-reduce", None))
    if cfg.data_ranks > 1 and cfg.zero >= 1 and overlap.param_gather_prefetch:
        out.append(("--overlap-param-gather", None))
    if cfg.moe_a2a_overlap:
        out.append((A2A_OVERLAP_FLAG, None))
    return out


def export_megatron(plan) -> tuple[str, list[str]]:
    """(argument file text, approximation notes) for `plan`."""
    cfg, notes = plan.config, []
    args: list[tuple[str, object]] = []
    args += _model_args(plan, notes)
    args += mtp_args(plan, notes)
    args += [(AXIS_FLAGS[name], getattr(cfg, name)) for name in ("tp", "pp")]
    megatron_schedule = cfg.schedule_spec.megatron
    if megatron_schedule is None and cfg.pp > 1:
        raise MeshplanError(f"Megatron-LM has no {cfg.schedule} pipeline schedule (it runs 1f1b and interleaved); "
                            "re-plan with --schedule interleaved or 1f1b")
    pattern = plan_hybrid_pattern(plan)
    if megatron_schedule == "interleaved":  # a hybrid pattern's segments say its virtual stages
        args += [] if pattern else [(VPP_FLAG, cfg.virtual_stages)]
        args += [(GROUP_FLAG, cfg.microbatch_group_size)] if cfg.microbatch_group_size else []
    args += hybrid_layout_args(plan, pattern, notes) if pattern else split_args(plan, notes)
    if cfg.sp:
        args.append((SP_FLAG, None))
    args += [(AXIS_FLAGS[name], getattr(cfg, name)) for name in ("cp", "ep") if getattr(cfg, name) > 1]
    if cfg.cp > 1 and cfg.cp_method == "ulysses":
        args.append((CP_COMM_FLAG, "a2a"))
    if cfg.ep > 1 or cfg.etp is not None:  # MoE parallel folding: Megatron-LM's default expert TP is tp
        args.append((AXIS_FLAGS["etp"], cfg.expert_tp))
    if cfg.ep > 1 or plan.model.moe_dispatcher != "alltoall":  # Megatron-Core's default is allgather
        dispatcher = plan.model.moe_dispatcher
        args += [(DISPATCHER_FLAG, "flex" if dispatcher == "deepep" else dispatcher)]
        args += [(DEEPEP_FLAG, None)] if dispatcher == "deepep" else []
    args += _recompute_args(plan, notes)
    args += [(BATCH_FLAGS["mbs"], cfg.microbatch_size), (BATCH_FLAGS["gbs"], cfg.global_batch),
             (BATCH_FLAGS["seq"], plan.model.seq), ("--max-position-embeddings", plan.model.seq)]
    args += _state_args(cfg, notes)
    head = f"{HEADER} gpus={cfg.gpus} model={plan.model.spec}"
    script = "pretrain_hybrid.py (pretrain_mamba.py before core_v0.18)" if pattern else "pretrain_gpt.py"
    lines = [head, f"# {script} arguments written by meshplan export; pass them after the script name"]
    lines += [flag if value is None else f"{flag} {value}" for flag, value in args]
    return "\n".join(lines) + "\n", notes


def _state_args(cfg, notes: list[str]) -> list[tuple[str, object]]:
    """The model state's flags (distributed optimizer or Megatron FSDP by ZeRO stage, overlaps,
    offload) and the precision's (bf16 and its gradient reduction, the priced loss kernels, fp8)."""
    args: list[tuple[str, object]] = []
    if cfg.zero >= 1:
        args.append(("--use-distributed-optimizer", None))
    if cfg.zero == 1 and cfg.shard_group:
        args.append((INSTANCES_FLAG, cfg.dp // cfg.shard_group))
    elif cfg.shard_group:
        notes.append(f"HSDP (shard groups of {cfg.shard_group}) at ZeRO-{cfg.zero}: Megatron FSDP shards over all "
                     f"data-parallel ranks; exported as ZeRO-{cfg.zero} over {cfg.dp}")
    if cfg.zero >= 2:  # Megatron FSDP also shards the gradients (and the parameters), as `_read_zero` reads it back
        args += [("--use-megatron-fsdp", None),
                 ("--data-parallel-sharding-strategy", "optim_grads_params" if cfg.zero == 3 else "optim_grads")]
    args += _overlap_args(cfg)
    if cfg.offload != "none":  # Megatron-Core's HybridDeviceOptimizer (megatron/core/optimizer/cpu_offloading)
        args += [("--optimizer-cpu-offload", None), ("--optimizer-offload-fraction", 1.0),
                 ("--use-precision-aware-optimizer", None)]
        if cfg.offload == "params":
            notes.append("offload params: Megatron-LM offloads the optimizer's states and step only; exported as "
                         "--optimizer-cpu-offload, which keeps parameters and gradients on the GPUs")
    if cfg.precision in ("bf16-mixed", "fp8"):
        args += [("--bf16", None)] + ([(BF16_GRADS_FLAG, None)] if cfg.grad_reduce_in_bf16 else [])
    if cfg.cross_entropy_fusion != "none":  # the loss kernels the plan was priced with
        args += [(CE_FUSION_FLAG, None)] + ([(CE_IMPL_FLAG, "te")] if cfg.cross_entropy_fusion == "te" else [])
    if cfg.precision == "fp8":  # Transformer Engine's E4M3 forward / E5M2 gradients, under the plan's recipe
        recipe = cfg.fp8_recipe
        if recipe not in MEGATRON_FP8_RECIPES:
            notes.append(f"fp8 recipe {recipe}: Megatron-LM's --fp8-recipe has no such choice "
                         f"({', '.join(MEGATRON_FP8_RECIPES)}); exported as tensorwise")
            recipe = "tensorwise"
        args += [("--fp8-format", "hybrid"), ("--fp8-recipe", recipe)]
        if cfg.zero >= 1:
            args.append(("--fp8-param-gather", None))
    return args


def _model_args(plan, notes: list[str]) -> list[tuple[str, object]]:
    cfg = zoo_shape(plan.model.spec, plan.model.seq)
    config_path = hf_config_path(plan.model.spec) if cfg is None else None
    hf_args = hf_megatron_args(config_path, notes) if config_path is not None else None
    if hf_args is not None:  # DeepSeek's latent attention, GPT-OSS (`megatron_hf`)
        return hf_args
    if config_path is not None:  # Llama-style configs Megatron-Bridge builds as GPTModel, MoE ones as the moe family
        from meshplan.planner.models.hf_engine import zoo_config

        cfg = zoo_config(config_path, "megatron")
    if cfg is None:
        notes.append(f"model {plan.model.spec}: not a zoo transformer; write its Megatron-LM model arguments by hand")
        return []
    args: list[tuple[str, object]] = [
        ("--num-layers", cfg.num_layers), ("--hidden-size", cfg.hidden), ("--ffn-hidden-size", cfg.ffn_dim),
        ("--num-attention-heads", cfg.num_heads), ("--vocab-size", cfg.vocab)]
    if cfg.family in ("llama", "moe"):
        args += [("--swiglu", None), ("--normalization", "RMSNorm"), ("--position-embedding-type", "rope"),
                 ("--rotary-base", int(cfg.rope_theta)), ("--disable-bias-linear", None)]
        if cfg.kv_heads != cfg.num_heads:
            args += [("--group-query-attention", None), ("--num-query-groups", cfg.kv_heads)]
        args += _attention_args(cfg)
    else:
        args.append(("--position-embedding-type", "learned_absolute"))
    if not cfg.tied_embeddings:
        args.append(("--untie-embeddings-and-output-weights", None))
    if cfg.family == "moe":
        args += _moe_args(cfg)
    return args


def _attention_args(cfg: TransformerConfig) -> list[tuple[str, object]]:
    """What else shapes a Llama-style block in Megatron-LM's arguments: a head width other than
    hidden / heads (`--kv-channels`, Qwen3's 128), Qwen3's q/k RMSNorms, Qwen2's q/k/v biases, and
    the norms' epsilon where it is not Megatron-LM's default 1e-5 (the ModelZoo's Qwen configs pass
    all four: model_configs/benchmarking/Qwen3-235B-A22B.yaml, Qwen2-57B-A14B.yaml)."""
    args: list[tuple[str, object]] = []
    if cfg.head_dim * cfg.num_heads != cfg.hidden:
        args.append(("--kv-channels", cfg.head_dim))
    if cfg.qk_norm:
        args.append(("--qk-layernorm", None))
    if cfg.qkv_bias:
        args.append(("--add-qkv-bias", None))
    if cfg.norm_eps != MEGATRON_NORM_EPSILON:
        args.append(("--norm-epsilon", cfg.norm_eps))
    return args


def _moe_args(cfg: TransformerConfig) -> list[tuple[str, object]]:
    """A mixture of experts' shape in Megatron-Core's MoE arguments."""
    args: list[tuple[str, object]] = [("--num-experts", cfg.num_experts), ("--moe-router-topk", cfg.top_k),
                                      ("--moe-ffn-hidden-size", cfg.expert_ffn), ("--moe-grouped-gemm", None)]
    if cfg.num_shared_experts:
        args.append(("--moe-shared-expert-intermediate-size", cfg.shared_expert_width))
    if cfg.shared_expert_gate:  # Qwen2-MoE's sigmoid gate on the shared experts' output
        args.append(("--moe-shared-expert-gate", None))
    if cfg.dense_layers:  # quoted: the launch scripts pass it through a shell
        args.append(("--moe-layer-freq", f"'([0]*{cfg.dense_layers}+[1]*{cfg.num_layers - cfg.dense_layers})'"))
    return args


def _recompute_args(plan, notes: list[str]) -> list[tuple[str, object]]:
    modes = layout.block_recompute(plan)
    if all(mode == "none" for mode in modes):
        return []
    if all(mode == "selective" for mode in modes):
        return [(RECOMPUTE_FLAG, "selective")]
    if all(mode == "full" for mode in modes):
        return [(RECOMPUTE_FLAG, "full"), ("--recompute-method", "uniform"), ("--recompute-num-layers", 1)]
    first = layout.first_n_full_per_chunk(plan)
    if first is not None:
        return [(RECOMPUTE_FLAG, "full"), ("--recompute-method", "block"), ("--recompute-num-layers", first)]
    full_per_chunk = [sum(plan.layers[i].recompute == "full" for i in chunk) for chunk in plan.chunks()]
    if any(full_per_chunk):
        count = max(1, round(sum(full_per_chunk) / len(full_per_chunk)))
        notes.append(f"per-layer recomputation ({_summary(modes)}): Megatron-LM recomputes the first N layers of "
                     f"each chunk; exported as full recomputation of the first {count}")
        return [(RECOMPUTE_FLAG, "full"), ("--recompute-method", "block"), ("--recompute-num-layers", count)]
    notes.append(f"per-layer recomputation ({_summary(modes)}): Megatron-LM's selective recomputation applies to "
                 "every layer; exported as selective for all")
    return [(RECOMPUTE_FLAG, "selective")]


def _summary(modes: list[str]) -> str:
    return ", ".join(f"{mode} {modes.count(mode)}" for mode in ("none", "selective", "full") if modes.count(mode))


# ------------------------------------------------------------------------------------------------
# reading


def header_fields(text: str) -> dict[str, str]:
    """key=value pairs of the `# meshplan:` line meshplan export writes."""
    for line in text.splitlines():
        if line.startswith(HEADER):
            return dict(item.split("=", 1) for item in line[len(HEADER):].split() if "=" in item)
    return {}


def _read_offload(flags: dict, notes: list[str]) -> str:
    """`--optimizer-cpu-offload`: the optimizer's states and step on the CPU (meshplan's "optimizer");
    a fraction below 1 keeps the rest on the GPU, priced as all of it offloaded."""
    if "--optimizer-cpu-offload" not in flags:
        return "none"
    fraction = flags.get("--optimizer-offload-fraction")
    if fraction is not None and fraction not in ("1", "1.0"):
        notes.append(f"--optimizer-offload-fraction {fraction}: priced as 1.0 (the whole optimizer offloaded)")
    if "--overlap-cpu-optimizer-d2h-h2d" in flags:
        notes.append("--overlap-cpu-optimizer-d2h-h2d: priced without that overlap")
    return "optimizer"


def read_megatron(text: str) -> EngineJob:
    """An EngineJob from Megatron-LM arguments (see `parse_arguments`)."""
    flags, header, notes = parse_arguments(text), header_fields(text), []
    get = _IntReader(flags)
    degrees = {name: get(flag, None if name == "etp" else 1) for name, flag in AXIS_FLAGS.items()}  # etp: tp
    tp, pp = degrees["tp"], degrees["pp"]
    vpp, layers_per_chunk = read_cut(flags, get, pp)
    sp = SP_FLAG in flags
    if sp and tp == 1:
        notes.append("--sequence-parallel with tensor parallelism 1 has no effect; ignored")
        sp = False
    if "--expert-tensor-parallel-size" not in flags and degrees["ep"] > 1:
        degrees["etp"] = tp  # Megatron-Core's default: the experts split as the dense layers are
    gpus = int(header["gpus"]) if header.get("gpus", "").isdigit() else _launcher_world_size(get)
    recompute, first_per_chunk, modules = _read_recompute(flags, get, notes)
    precision, fp8_recipe = _read_precision(flags, notes)
    cp_method = _read_cp_method(flags, degrees["cp"], notes)
    job = dict(
        engine="megatron", model=header.get("model") or _model_spec(flags, get, notes),
        seq=get(BATCH_FLAGS["seq"], None), gpus=gpus, global_batch=get(BATCH_FLAGS["gbs"], None),
        microbatch_size=get(BATCH_FLAGS["mbs"], 1), **degrees, zero=_read_zero(flags, notes), sp=sp,
        shard_group=_shard_group(get, degrees, gpus, notes), recompute=recompute,
        recompute_first_per_chunk=first_per_chunk, recompute_modules=modules,
        schedule="interleaved" if vpp > 1 else "1f1b", vpp=vpp, precision=precision, fp8_recipe=fp8_recipe,
        microbatch_group_size=None if vpp == 1 or get(GROUP_FLAG, pp) == pp else get(GROUP_FLAG, None),
        grad_reduce_in_bf16=BF16_GRADS_FLAG in flags, tp_comm_overlap=TP_OVERLAP_FLAG in flags,
        moe_a2a_overlap=A2A_OVERLAP_FLAG in flags and degrees["ep"] > 1,
        cross_entropy_fusion=_read_ce_fusion(flags, notes),
        layers_per_chunk=layers_per_chunk, offload=_read_offload(flags, notes),
        cp_method=cp_method, mtp_num_layers=get("--mtp-num-layers", 0),
        moe_dispatcher=_read_dispatcher(flags, degrees["ep"], notes)
        if degrees["ep"] > 1 or "--num-experts" in flags or DISPATCHER_FLAG in flags else "alltoall")
    for flag in ("--overlap-grad-reduce", "--overlap-param-gather"):
        if flag not in flags and not header:  # meshplan's own exports name both where they apply
            notes.append(f"no {flag}: priced with it, as meshplan's megatron overlap record has it "
                         "(Megatron-LM's default is off)")
    for flag in ("--fp4-format", "--cpu-offloading", "--first-last-layers-bf16"):
        if flag in flags:
            notes.append(f"{flag} {flags[flag] or ''}".rstrip() + ": not modelled by meshplan; priced without it")
    if "--no-gradient-accumulation-fusion" in flags:  # engine_rules.WGRAD_ACCUMULATING_ENGINES: main_grad in the GEMM
        notes.append("--no-gradient-accumulation-fusion: not modelled by meshplan; priced with Megatron-LM's fusion")
    return EngineJob(**job, notes=tuple(notes))


def _read_cp_method(flags: dict[str, str | None], cp: int, notes: list[str]) -> str:
    """meshplan's CP method of `--cp-comm-type` (absent: p2p, Megatron-Core's default)."""
    kind = flags.get(CP_COMM_FLAG) or "p2p"
    if kind not in CP_COMM_TYPES:
        raise MeshplanError(f"Megatron-LM argument {CP_COMM_FLAG} must be one of {', '.join(CP_COMM_TYPES)}, "
                            f"got {kind!r}")
    if cp > 1 and CP_COMM_FLAG in flags and kind in ("p2p", "a2a+p2p"):
        notes.append(f"{CP_COMM_FLAG} {kind}: priced as meshplan's all-gather context parallelism (same K/V bytes "
                     "per rank, no overlap with attention)")
    return CP_COMM_TYPES[kind]


def _read_dispatcher(flags: dict[str, str | None], ep: int, notes: list[str]) -> str:
    """meshplan's MoE dispatcher of `--moe-token-dispatcher-type` (flex: DeepEP)."""
    kind = flags.get(DISPATCHER_FLAG) or "allgather"
    if kind not in MEGATRON_DISPATCHERS:
        raise MeshplanError(f"Megatron-LM argument {DISPATCHER_FLAG} must be one of "
                            f"{', '.join(MEGATRON_DISPATCHERS)}, got {kind!r}")
    if kind == "flex" and DEEPEP_FLAG not in flags:
        notes.append(f"{DISPATCHER_FLAG} flex without {DEEPEP_FLAG}: priced as DeepEP's node-deduplicated dispatch")
    elif ep > 1 and DISPATCHER_FLAG not in flags:
        notes.append(f"no {DISPATCHER_FLAG}: priced as Megatron-Core's default allgather dispatcher")
    return MEGATRON_DISPATCHERS[kind]


class _IntReader:
    def __init__(self, flags: dict[str, str | None]):
        self.flags = flags

    def __call__(self, flag: str, default):
        if flag not in self.flags:
            return default
        value = self.flags[flag]
        if value is None or not value.lstrip("+").isdigit():
            raise MeshplanError(f"Megatron-LM argument {flag} needs a positive integer, got {value!r}; "
                                "substitute the script's variables or pass the expanded arguments")
        return int(value)


def _shard_group(get, degrees: dict, gpus: int | None, notes: list[str]) -> int | None:
    """HSDP's shard group from --num-distributed-optimizer-instances N (dp / N ranks per copy)."""
    instances = get(INSTANCES_FLAG, 1)
    if instances == 1:
        return None
    if gpus is None:
        notes.append(f"{INSTANCES_FLAG} {instances}: the world size is unknown, so the shard group is; priced "
                     "as one optimizer instance")
        return None
    dp = gpus // (degrees["tp"] * degrees["pp"] * degrees["cp"])
    if dp % instances:
        raise MeshplanError(f"{INSTANCES_FLAG} {instances} does not divide the {dp} data-parallel ranks")
    return dp // instances


def _launcher_world_size(get) -> int | None:
    per_node = get("--nproc_per_node", None) or get("--nproc-per-node", None)
    return per_node * get("--nnodes", 1) if per_node else None


def _read_recompute(flags, get, notes: list[str]) -> tuple[str, int | None, tuple[str, ...]]:
    """(granularity, first N blocks of each chunk recomputed, selective's recompute modules)."""
    granularity = flags.get(RECOMPUTE_FLAG) or ("selective" if "--recompute-activations" in flags else None)
    if granularity in (None, "selective"):
        modules = (flags.get("--recompute-modules") or "core_attn").split()
        unknown = [name for name in modules if name not in RECOMPUTE_MODULES]
        if granularity and unknown:
            notes.append(f"--recompute-modules {' '.join(unknown)}: not modelled by meshplan; priced without them")
        known = tuple(name for name in modules if name in RECOMPUTE_MODULES) if granularity else ()
        return granularity or "none", None, known
    if granularity != "full":
        raise MeshplanError(f"--recompute-granularity must be full or selective, got {granularity!r}")
    method, count = flags.get("--recompute-method"), get("--recompute-num-layers", 1)
    if "--recompute-modules" in flags:
        notes.append(f"--recompute-modules {flags['--recompute-modules']}: applies to selective granularity only; "
                     "ignored under full")
    if method == "block":
        return "none", count, ()
    if method != "uniform":
        notes.append(f"--recompute-granularity full without --recompute-method ({method}): priced as uniform")
    if count > 1:
        notes.append(f"--recompute-method uniform --recompute-num-layers {count}: checkpoints groups of {count} "
                     "layers; priced as full recomputation of every layer (its input kept per layer)")
    return "full", None, ()


def _read_ce_fusion(flags, notes: list[str]) -> str:
    """The loss kernels of the arguments (`ParallelConfig.cross_entropy_fusion`)."""
    if CE_FUSION_FLAG not in flags:
        return "none"
    impl = flags.get(CE_IMPL_FLAG) or "native"
    if impl not in ("native", "te"):
        notes.append(f"{CE_IMPL_FLAG} {impl}: meshplan prices native and te; priced as native")
        return "native"
    return impl


def _read_precision(flags, notes: list[str]) -> tuple[str, str | None]:
    """(precision, fp8 recipe) of the arguments: --fp8-recipe defaults to delayed, as in Megatron-LM."""
    if "--fp8-format" in flags:
        recipe = flags.get("--fp8-recipe") or DEFAULT_FP8_RECIPE["megatron"]
        if recipe not in FP8_RECIPES:
            notes.append(f"--fp8-recipe {recipe}: not one of meshplan's ({', '.join(FP8_RECIPES)}); priced as "
                         "tensorwise")
            recipe = "tensorwise"
        return "fp8", recipe
    if "--fp16" in flags:
        notes.append("--fp16: priced as bf16-mixed (same bytes and peak FLOP/s; no loss scaling)")
        return "bf16-mixed", None
    return "bf16-mixed" if "--bf16" in flags else "fp32", None


def _read_zero(flags, notes: list[str]) -> int:
    if any(flag in flags for flag in ("--use-torch-fsdp2", "--use-megatron-fsdp", "--use-custom-fsdp")):
        strategy = flags.get("--data-parallel-sharding-strategy") or "optim_grads_params"
        stages = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}
        if strategy not in stages:
            notes.append(f"--data-parallel-sharding-strategy {strategy}: unknown; priced as ZeRO-3")
        return stages.get(strategy, 3)
    return 1 if "--use-distributed-optimizer" in flags else 0


def _model_spec(flags, get, notes: list[str]) -> str | None:
    """A meshplan SPEC from the model-shape arguments; None when they are absent."""
    layers, hidden, heads = get("--num-layers", None), get("--hidden-size", None), get("--num-attention-heads", None)
    vocab = get("--vocab-size", None)
    if None in (layers, hidden, heads):
        return None
    published = published_spec(flags)
    if published is not None:
        return published
    if "--multi-latent-attention" in flags:
        notes.append("--multi-latent-attention with shapes no published preset has (deepseek-v3, deepseek-v2-lite): "
                     "meshplan's own families have no latent attention")
        return None
    if vocab is None:
        notes.append("--vocab-size not given (the tokenizer decides it): assumed 128256 (Llama 3)")
        vocab = 128256
    llama = "--swiglu" in flags or flags.get("--position-embedding-type") == "rope"
    if llama and "--disable-bias-linear" not in flags:  # GPT-OSS's biased Linears, say: no Llama-style block
        notes.append("the model arguments are no shape of meshplan's own families (every Linear biased, Megatron-LM's "
                     "default without --disable-bias-linear, which the Llama-style families do not build)")
        return None
    kv_heads = get("--num-query-groups", heads) if "--group-query-attention" in flags else heads
    ffn = get("--ffn-hidden-size", 4 * hidden)
    family = "moe" if get("--num-experts", 0) > 1 else "llama" if llama else "gpt"
    channels = get("--kv-channels", 0)  # Megatron-LM's default: hidden / heads
    attention = dict(attn_head_dim=channels if channels * heads != hidden else 0, qk_norm="--qk-layernorm" in flags,
                     qkv_bias="--add-qkv-bias" in flags) if family != "gpt" else {}
    try:
        cfg = TransformerConfig(family, layers, hidden, heads, vocab, ffn=ffn, num_kv_heads=kv_heads,
                                max_positions=get("--max-position-embeddings", 1024),
                                tied_embeddings="--untie-embeddings-and-output-weights" not in flags, **attention,
                                **(_read_moe(flags, get, ffn, layers) if family == "moe" else {}))
    except ValueError as exc:  # e.g. GPT-OSS's 64 heads of 64 over a hidden size of 2880
        notes.append(f"the model arguments are no shape of meshplan's own families ({exc})")
        return None
    return spec_for_shape(cfg)


def _read_moe(flags, get, ffn: int, layers: int) -> dict:
    """TransformerConfig's MoE fields from Megatron-Core's MoE arguments."""
    expert_ffn = get("--moe-ffn-hidden-size", ffn)
    shared = get("--moe-shared-expert-intermediate-size", 0)
    if shared % expert_ffn:
        raise MeshplanError(f"--moe-shared-expert-intermediate-size {shared} is not a whole number of experts of "
                            f"--moe-ffn-hidden-size {expert_ffn}; meshplan's shared experts have the routed width")
    match = re.fullmatch(r"\(?\[0\]\*(\d+)\+\[1\]\*(\d+)\)?", (flags.get("--moe-layer-freq") or "").replace(" ", ""))
    dense = int(match.group(1)) if match and int(match.group(1)) + int(match.group(2)) == layers else 0
    return dict(num_experts=get("--num-experts", 0), top_k=get("--moe-router-topk", 2), expert_ffn=expert_ffn,
                num_shared_experts=shared // expert_ffn, dense_layers=dense)
