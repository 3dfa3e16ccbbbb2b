"""What meshplan's executor runs: one rule, read by the search and by `meshplan train`.

    why_not_executable(config, model, layer_degrees=()) -> str | None

None when the executor runs `config` on `model` as planned; else one line naming the problem and
the fix. The search marks every plan with it (`Plan.executable`, `Plan.not_executable_reason`) and
leaves out of its default space what it refuses (`search.candidates.enumerate_candidates`);
`executor.checks.check_plan_runnable` refuses with it. Only the configuration and the model count
here: the request around a plan (process count, files, timeouts) is the executor's to check.

`model` is a `ModelFacts`: what the rule reads of a model, made from the planner's `ModelGraph`
(`model_facts`, no torch) or from the model the executor builds (`built_model_facts`).

Two of the rules say whether a model can be split at all, and are the only copy of them:
`tp_split_problem` (every layer divides tp ways: heads, K/V heads, MLP width, vocabulary;
Hugging Face decoder layers need a known layout) and `cp_split_problem` (attention to split,
every sequence cut into 2*cp equal chunks, and under Ulysses heads to split over the cp ranks). The cost model needs them too, so `estimate`, the
candidates and the executor all call these two.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from meshplan.planner.contracts.config import DEFAULT_CP_METHOD, DEFAULT_MOE_DISPATCHER
from meshplan.planner.contracts.graph import TPSplit
from meshplan.planner.contracts.schedule import SCHEDULE_SPECS
from meshplan.planner.costing.expert_parallel import check_expert_parallel
from meshplan.planner.costing.fp8 import is_fp8
from meshplan.planner.costing.state_memory import executed_zero
from meshplan.planner.costing.ulysses import ULYSSES, ulysses_head_problem

# Model families the executor runs whole on every rank (data parallelism only).
WHOLE_MODEL_FAMILIES = ("file",)
# Families whose sequence the executor does not split: no context parallelism, and no sequence
# parallelism (Hugging Face models run TP with replicated norms and residual stream).
NO_SEQUENCE_SPLIT_FAMILIES = ("file", "hf")

LAYERWISE = ("layerwise plan: layers use their own tensor/data-parallel degrees inside a stage, which the "
             "executor does not run yet; plan without --layerwise for a runnable plan")


@dataclass(frozen=True)
class ModelFacts:
    """What the executability rule reads of a model.

    `layers`: (name, kind, TPSplit) of every layer in execution order. `pipeline_cut_problem`:
    why the executor cannot cut the model into pipeline stages ("" when it can;
    `ModelInfo.pipeline_cut_problem`).
    """

    spec: str
    family: str
    seq: int
    num_heads: int = 0
    num_experts: int = 0
    num_kv_heads: int = 0  # 0: as many as num_heads
    layers: tuple[tuple[str, str, TPSplit], ...] = ()
    pipeline_cut_problem: str = ""

    @cached_property
    def distinct_layers(self) -> tuple[tuple[str, str, TPSplit], ...]:
        """The first layer of each distinct (kind, split), in order: all the split rules need to
        read (a model's blocks share a handful of splits; the search asks for thousands of meshes)."""
        first: dict[tuple[str, TPSplit], str] = {}
        for name, kind, split in self.layers:
            first.setdefault((kind, split), name)
        return tuple((name, kind, split) for (kind, split), name in first.items())

    def __post_init__(self):
        if self.seq <= 0:
            raise ValueError(f"ModelFacts.seq must be positive, got {self.seq}")
        if self.num_heads < 0 or self.num_experts < 0 or self.num_kv_heads < 0:
            raise ValueError(f"ModelFacts.num_heads, num_experts and num_kv_heads must be >= 0, got "
                             f"{self.num_heads}, {self.num_experts}, {self.num_kv_heads}")


def model_facts(graph) -> ModelFacts:
    """The facts of a profiled `ModelGraph`."""
    info = graph.info
    return ModelFacts(spec=graph.spec, family=info.family, seq=graph.seq, num_heads=info.num_heads,
                      num_experts=info.num_experts, num_kv_heads=info.num_kv_heads or 0,
                      layers=tuple((layer.name, layer.kind, layer.tp_split) for layer in graph.layers),
                      pipeline_cut_problem=info.pipeline_cut_problem)


def built_model_facts(built, spec: str, seq: int) -> ModelFacts:
    """The facts of a model built by `models.registry.build_model` (a `BuiltModel`): its layer
    groups' splits, or unsplittable layers where it has none (file models)."""
    layers = (tuple((group.name, group.kind, group.tp_split) for group in built.layer_groups)
              or tuple((name, kind, TPSplit()) for name, kind, _ in built.layer_modules))
    return ModelFacts(spec=spec, family=built.info.family, seq=seq, num_heads=built.info.num_heads,
                      num_experts=built.info.num_experts, num_kv_heads=built.info.num_kv_heads or 0, layers=layers,
                      pipeline_cut_problem=built.info.pipeline_cut_problem)


def tp_split_problem(model: ModelFacts, tp: int, label: str | None = None) -> str | None:
    """Why `model` cannot be split `tp` ways (None: it can). `label` names the degree in the
    message (default "tp=N"; the CLI's checks say "--tp N")."""
    if tp == 1:
        return None
    label = label or f"tp={tp}"
    for name, kind, split in model.distinct_layers:
        if model.family == "hf" and kind == "block" and split.kind == "none":
            return (f"{label}: layer {name!r} cannot be split over tensor-parallel ranks: "
                    f"{split.reason or 'no known layout'}; use --tp 1")
        if not split.max_degree_ok(tp):
            return f"{label} does not divide layer {name!r}: {split.divisors_text()}; pick a tp that divides them"
    return None


def _split_refusal(config, model: ModelFacts) -> str | None:
    """A split the cost model prices and the executor does not run (`TPSplit.executor_refusal`:
    Mamba-2 mixers, attention-only and MLP-only decoder layers of Hugging Face hybrids)."""
    if config.tp == 1:
        return None
    for name, _, split in model.distinct_layers:
        if split.executor_refusal:
            return (f"tp={config.tp}: {split.executor_refusal} (layer {name!r}); re-plan with --tp 1 to train, "
                    "or export the plan to Megatron-LM")
    return None


def cp_split_problem(model: ModelFacts, cp: int, label: str | None = None, method: str = DEFAULT_CP_METHOD,
                     tp: int = 1) -> str | None:
    """Why `model`'s attention cannot be split over `cp` context-parallel ranks (None: it can):
    CP cuts every sequence into 2*cp chunks (load-balanced causal attention); the Ulysses
    `method` also splits the heads of each of `tp` ranks over the cp ranks
    (`ulysses.ulysses_head_problem`)."""
    if cp == 1:
        return None
    label = label or f"cp={cp}"
    if not model.num_heads:
        return (f"{label}: context parallelism splits attention over the sequence, and {model.spec!r} has no "
                "attention meshplan can split; use --cp 1")
    recurrent = next((name for name, _, split in model.distinct_layers if split.mixer in ("mamba2", "ssm")), None)
    if recurrent is not None:  # Megatron-Core's Mamba CP swaps sequence for heads by all-to-alls around the scan
        return (f"{label}: layer {recurrent!r} is a state-space mixer, whose context parallelism (all-to-alls of its "
                "heads around the scan) meshplan does not price; use --cp 1")
    if model.seq % (2 * cp):
        return (f"{label} cuts each sequence into 2*cp = {2 * cp} equal chunks; seq {model.seq} is not divisible "
                f"by {2 * cp}: use a sequence length that is")
    if method == ULYSSES:
        return ulysses_head_problem(model.num_heads, model.num_kv_heads, tp, cp, label)
    return None


def whole_model_problem(config) -> str | None:
    """File models run whole on every rank: pp, tp and ep stay 1 (reads config.pp, tp, ep)."""
    if config.pp > 1 or config.tp > 1 or config.ep > 1:
        return (f"file models train with data parallelism only, this plan has pp={config.pp} tp={config.tp}"
                f"{f' ep={config.ep}' if config.ep > 1 else ''}; re-plan it (meshplan plan keeps them at "
                "pp=1 tp=1)")
    return None


def why_not_executable(config, model: ModelFacts, layer_degrees=()) -> str | None:
    """None when the executor runs `config` (a `ParallelConfig`) on `model` as planned, else the
    problem and its fix in one line. `layer_degrees`: each layer's (tp, dp) where a plan has its
    own per layer (`--layerwise`)."""
    if any((tp, dp) != (config.tp, config.dp) for tp, dp in layer_degrees):
        return LAYERWISE
    if is_fp8(config.precision):
        return ("FP8 plans are planned, not executed (meshplan's executor has no FP8 Linears yet); re-plan with "
                "--precision bf16-mixed to train")
    if config.offload != "none":
        return (f"offloading ({config.offload}) is planned, not executed: meshplan's executor keeps every model "
                "state on the device (on the cpu cluster the device is the host, so there is nothing to move); "
                "export the plan to DeepSpeed, Megatron-LM or torchtitan, or re-plan with --offload none")
    if config.microbatch_group_size:
        return (f"a micro-batch group size ({config.microbatch_group_size}) is planned, not executed: torch's "
                "ScheduleInterleaved1F1B runs its own rounds (m // max(1, m // pp)); export the plan to Megatron-LM "
                "or drop --microbatch-group-size to train")
    if executed_zero(config.zero, config.data_ranks, config.pp, config.schedule) != config.zero:
        return (f"ZeRO-{config.zero} with the {config.schedule} schedule (pp {config.pp}, dp {config.dp}) runs as "
                "ZeRO-1: a split backward defers gradient sync and resharding to the step's end; set zero to 1, "
                f"or use a schedule without a split backward ({_whole_backward_schedules()})")
    if model.family in WHOLE_MODEL_FAMILIES and whole_model_problem(config):
        return whole_model_problem(config)
    return (_sequence_problem(config, model) or tp_split_problem(model, config.tp) or _split_refusal(config, model)
            or _expert_problem(config, model) or _pipeline_problem(config, model))


def dispatcher_problem(config, moe_dispatcher: str) -> str | None:
    """Why a plan costed under another MoE token dispatcher than the executor's is not executed:
    the executor sends every routed copy by one all-to-all (`executor.parallel.expert`). Kept out
    of `why_not_executable`, which also prunes the search's candidates: a dispatcher the user
    names prices every EP candidate alike, and only the plan says `train` refuses it."""
    if config.ep == 1 or moe_dispatcher == DEFAULT_MOE_DISPATCHER:
        return None
    return (f"the {moe_dispatcher} token dispatcher is planned, not executed: meshplan's executor dispatches MoE "
            "tokens with one all-to-all of every routed copy; export the plan to Megatron-LM, or re-plan with "
            "--moe-dispatcher alltoall to train")


def mtp_problem(mtp_num_layers: int) -> str | None:
    """Why a plan costed with multi-token prediction (`profiling.mtp`) is not executed: the
    executor trains the model as its code defines it, and transformers' models have no MTP
    module. Beside `dispatcher_problem`, for the same reason (it holds for every candidate)."""
    if not mtp_num_layers:
        return None
    return (f"multi-token prediction ({mtp_num_layers} depth{'s' if mtp_num_layers > 1 else ''}) is planned, not "
            "executed: meshplan's executor trains the model its code defines, without MTP modules; export the plan "
            "to Megatron-LM (--mtp-num-layers), or re-plan without --mtp-num-layers to train")


def _sequence_problem(config, model: ModelFacts) -> str | None:
    """Context and sequence parallelism split the sequence: zoo transformers only."""
    if config.cp > 1 and model.family in NO_SEQUENCE_SPLIT_FAMILIES:
        return (f"context parallelism (cp {config.cp}) needs a zoo transformer whose attention meshplan can "
                "split over the sequence; file and Hugging Face models train with cp 1")
    if config.sp and model.family in NO_SEQUENCE_SPLIT_FAMILIES:
        return (f"sequence parallelism is not implemented for Hugging Face models (this plan has tp={config.tp} "
                "with sp); re-plan it without --sp")
    if config.sp and model.seq % config.tp:
        return (f"sequence parallelism splits the sequence ({model.seq} tokens) over tp={config.tp} ranks; use "
                f"a sequence length divisible by {config.tp} or turn --sp off")
    return cp_split_problem(model, config.cp, method=config.cp_method, tp=config.tp)


def _expert_problem(config, model: ModelFacts) -> str | None:
    """The folded expert layout (`executor.parallel.expert`) runs on zoo mixtures of experts with
    data, context, tensor and pipeline parallelism, ZeRO 0-3 and HSDP, when etp divides tp and,
    under TP, without sequence parallelism (the tp ranks hold the same tokens and each expert-TP
    group routes a slice of them). Hugging Face mixtures of experts train with tp 1."""
    if model.family == "hf" and model.num_experts and config.tp > 1:
        return (f"the executor trains Hugging Face mixture-of-experts models with tp=1 (this plan has "
                f"tp={config.tp}): it does not split transformers' routed experts; re-plan with --tp 1")
    etp = config.expert_tp
    if model.family == "moe" and config.tp * etp > 1:
        if config.tp % etp:
            return (f"the executor splits the experts over etp ranks inside a tp group: etp={etp} must divide "
                    f"tp={config.tp}; re-plan with --etp 1 or --etp {config.tp}")
        if config.sp and moe_refuses_sp(model, config.tp):
            return (f"the executor runs mixture-of-experts blocks under tp={config.tp} without sequence parallelism "
                    "(the expert layout slices the tokens a tp group holds alike); re-plan without --sp")
        slices = config.tp // etp
        if (config.microbatch_size * model.seq // config.cp) % slices:
            return (f"the {config.tp // etp} expert-TP groups of a tp group each route an equal slice of the "
                    f"micro-batch's {config.microbatch_size * model.seq // config.cp} tokens per rank; use a "
                    f"micro-batch size or sequence length that {slices} divides")
    if config.ep == 1:
        return None
    if model.family == "hf":
        return (f"Hugging Face models train without expert parallelism, this plan has ep={config.ep}; re-plan "
                "it with --ep 1")
    try:
        check_expert_parallel(model, config.ep)
    except ValueError as exc:
        return str(exc)
    return None


def moe_refuses_sp(model: ModelFacts, tp: int) -> bool:
    """The executor runs a zoo mixture of experts under TP without sequence parallelism
    (`_expert_problem`): true for every expert layout at this tp (the search drops SP there
    before enumerating the layouts)."""
    return model.family == "moe" and tp > 1


def _pipeline_problem(config, model: ModelFacts) -> str | None:
    if config.pp > 1 and model.pipeline_cut_problem:
        return model.pipeline_cut_problem
    return None


def _whole_backward_schedules() -> str:
    """The schedules whose backward is not split (ZeRO-2/3 run as planned under them)."""
    return ", ".join(spec.name for spec in SCHEDULE_SPECS.values() if not spec.split_backward)
