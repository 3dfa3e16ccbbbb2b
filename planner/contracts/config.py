"""`ParallelConfig`: the uniform choices of one plan (what `estimate` takes and `plan` searches).

The executable plan space (docs/architecture.md): one mesh (pp, dp, cp, tp and the MoE layers'
folded etp, ep: `contracts.axes`) for the whole model, one ZeRO stage (optionally hybrid: sharded over
`shard_group` data-parallel ranks, replicated across the rest), one sequence-parallel switch, one
precision recipe, one schedule; per-layer stage and recomputation live in the Plan's layer
assignments. It is also what the cost model prices a layer under (`costing.uniform.layer_config`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Literal

from meshplan.planner.contracts.axes import AXES, FOLDED_AXES, MESH_AXES, mesh_product_text, mesh_stride
from meshplan.planner.contracts.engine_rules import (a2a_overlap_engine_problem, bf16_grads_problem, ce_fusion_problem,
                                                     compile_problem, moe_sp_problem, stored_compile_loss,
                                                     stored_early_stop, tp_sp_problem)
from meshplan.planner.contracts.fp8_choice import (DEFAULT_FP8_RECIPE, FP8_LINEARS, FP8_RECIPES,  # noqa: F401
                                                   stored_fp8_filter, stored_fp8_recipe)
from meshplan.planner.contracts.schedule import SCHEDULES, Schedule, default_microbatch_group, schedule_spec

RECOMPUTE = ("none", "selective", "full")
# fp8: FP8 Linears over bf16-mixed under one of FP8_RECIPES (planner.costing.fp8); planned, not executed.
PRECISIONS = ("bf16-mixed", "fp32", "fp8")
# The training engine whose memory recipe prices a plan (`costing.engine_memory`): meshplan's own
# executor, Megatron-LM, torchtitan, DeepSpeed or MosaicML's llm-foundry (Composer's FSDP); or
# "generic", a stack meshplan has no record of: fused kernels (no cost only meshplan's eager
# executor pays), overlap and memory as meshplan's executor has them (published runs of Megatron-LM
# 2021-2022 and of Llama 3's stack, the fit sets among them, are priced so).
ENGINES = ("meshplan", "megatron", "torchtitan", "deepspeed", "llm-foundry", "generic")
# The engines that run a plan meshplan exports (`export --to`) and whose logs `measured` reads.
EXTERNAL_ENGINES = ("megatron", "torchtitan", "deepspeed")
# Engines whose memory is meshplan's executor's own recipe (`state_memory`, `activation_memory`).
EXECUTOR_MEMORY_ENGINES = ("meshplan", "generic")
# Engines that can pipeline the sequence-parallel TP collectives with their GEMMs
# (`ParallelConfig.tp_comm_overlap`): Transformer Engine's userbuffers under Megatron-LM's
# --tp-comm-overlap, torchtitan's async TP (parallelism.enable_async_tensor_parallel).
TP_OVERLAP_ENGINES = ("megatron", "torchtitan")
# Engines that train with data and tensor parallelism alone (no pipeline, context or expert parallelism).
NO_PIPELINE_ENGINES = ("llm-foundry",)
# Engines with a multi-token-prediction module (Megatron-Core's MultiTokenPredictionLayer,
# --mtp-num-layers): the only export of a plan costed with MTP depths (`profiling.mtp`); the
# search also plans them for meshplan's own engine, priced but not executed (`executable.mtp_problem`).
MTP_ENGINES = ("megatron",)
# Model states moved to host memory (`costing.offload`): none; the optimizer's states and its step
# (DeepSpeed ZeRO-Offload `offload_optimizer`, Megatron-LM `--optimizer-cpu-offload`); or also the
# parameters and gradients (ZeRO-Infinity `offload_param`, FSDP2 `CPUOffloadPolicy`), ZeRO-3 only.
OFFLOAD = ("none", "optimizer", "params")
Recompute = Literal["none", "selective", "full"]
# Megatron-Core's fine-grained recomputation (`--recompute-granularity selective --recompute-modules ...`):
# the submodules a layer under selective recomputation rebuilds in backward (`costing.megatron_activations`
# prices each). Megatron-LM's default, and selective elsewhere but torchtitan's op policy, is the attention core.
RECOMPUTE_MODULES = ("core_attn", "layernorm", "mla_up_proj", "moe_act", "mlp", "moe", "shared_experts")
DEFAULT_RECOMPUTE_MODULES = ("core_attn",)
# How context-parallel ranks attend over the whole sequence (`--cp-method`, plan.json `cp_method`):
# "all-gather" gathers every rank's K/V before attention (Llama 3; the first method, the default);
# "ulysses" (DeepSpeed-Ulysses, Megatron-LM's --cp-comm-type a2a) turns sequence shards into head
# shards with an all-to-all of q, k, v and back with one of the output.
CP_METHODS = ("all-gather", "ulysses")
DEFAULT_CP_METHOD = CP_METHODS[0]
# The CP methods each engine runs, where not all: torchtitan's context parallelism is torch's ring
# attention (its all-gather or all-to-all rotation of K/V shards), priced as all-gather; it has no
# Ulysses (`engines.torchtitan.job_sections` refuses it).
ENGINE_CP_METHODS = {"torchtitan": ("all-gather",)}
# How a MoE block's routed copies reach the experts' ranks (`--moe-dispatcher`, plan.json
# `model.moe_dispatcher`; `costing.moe_dispatch` prices each): "alltoall" sends every copy
# (Megatron-Core's alltoall dispatcher; the default); "allgather" gathers every token over the EP
# group (its allgather dispatcher); "deepep" sends a token once per destination node over the
# rails and forwards it over NVLink inside the node (its flex dispatcher with DeepEP).
MOE_DISPATCHERS = ("alltoall", "allgather", "deepep")
DEFAULT_MOE_DISPATCHER = MOE_DISPATCHERS[0]


# Meshes (sizes and degrees, plain ints) `ParallelConfig._check_mesh` accepted; emptied at `_MAX_CHECKED_MESHES`
# so a long-lived process stays bounded (a search asks a few thousand; a forgotten one is checked again).
_CHECKED_MESHES: set[tuple] = set()
_MAX_CHECKED_MESHES = 1 << 16


def _optional_positive_int(name: str, value) -> bool:
    """True for a positive int, False for None; anything else is refused (bools too: True == 1)."""
    if value is None:
        return False
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return True


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Mesh, batch split and uniform switches. `gpus = pp * dp * cp * tp`.

    MoE parallel folding: the MoE layers' routed experts regroup the tp * cp * dp ranks of a stage
    as (edp, ep, etp), etp innermost: each expert split over `etp` consecutive ranks (None: tp),
    the experts over `ep` ranks etp apart, expert data parallelism over the edp ranks left.

    Mesh order (pp, dp, cp, tp), tp innermost: a context-parallel group is `cp` ranks `tp` apart,
    each holding 1/cp of every sequence; data parallelism and ZeRO span dp * cp ranks.

    global_batch = dp * microbatch_size * num_microbatches (samples per optimizer step).
    `recompute` is the default for every layer; a Plan may override it per layer.
    """

    gpus: int
    global_batch: int
    tp: int = 1
    pp: int = 1
    dp: int = 1
    microbatch_size: int = 1
    cp: int = 1
    zero: int = 0
    recompute: Recompute = "none"
    sp: bool = False
    schedule: str = "1f1b"  # a name in SCHEDULES; its description: `schedule_spec`
    virtual_stages: int = 1
    precision: str = "bf16-mixed"
    # HSDP: ZeRO shards over groups of `shard_group` consecutive data-parallel ranks and replicates
    # across the dp / shard_group groups; None shards over all dp ranks (plain ZeRO / FSDP).
    shard_group: int | None = None
    # Expert parallelism: each MoE layer's routed experts are split over groups of `ep` ranks, etp
    # apart (Megatron-Core's folding; with etp = tp, ep of the dp x cp data ranks); ep does not multiply gpus.
    ep: int = 1
    # Expert tensor parallelism: each routed expert split over `etp` consecutive ranks; None follows
    # tp (Megatron-LM's default). Stored as None when equal to tp, so equal layouts compare equal.
    etp: int | None = None
    engine: str = "meshplan"  # a name in ENGINES: whose memory recipe and overlap (`contracts.overlap`) price the plan
    # Under fp8 a name in FP8_RECIPES (None: the engine's DEFAULT_FP8_RECIPE, stored resolved); else None.
    fp8_recipe: str | None = None
    # Under fp8, the block Linears left in bf16 (names in FP8_LINEARS, or "auto": torchao's auto
    # filter; `contracts.fp8_choice`); stored in FP8_LINEARS order. Engines with torchao's Linears only.
    fp8_filter: tuple[str, ...] = ()
    # The submodules selective recomputation rebuilds (names in RECOMPUTE_MODULES), Megatron-Core's
    # `--recompute-modules`; () is DEFAULT_RECOMPUTE_MODULES. Only the megatron engine has them.
    # Stored sorted, so equal sets compare equal.
    recompute_modules: tuple[str, ...] = ()
    offload: str = "none"  # a name in OFFLOAD: which model states live in host memory
    # A name in CP_METHODS; stored as the default when cp = 1 (no CP), so equal layouts compare equal.
    cp_method: str = DEFAULT_CP_METHOD
    # Interleaved 1F1B's micro-batch group: micro-batches go round the virtual stages this many at a
    # time (Megatron-Core's --microbatch-group-size-per-virtual-pipeline-stage; Llama 3's tunable N).
    # None: the schedule's own (`schedule.default_microbatch_group`); stored as None when equal to it.
    microbatch_group_size: int | None = None
    # Megatron-LM's --grad-reduce-in-bf16 (Megatron-Bridge's `ddp.grad_reduce_in_fp32 = False`): the
    # gradient buffer (`main_grad`) accumulates and is reduced in bf16, not fp32. Engine megatron only.
    grad_reduce_in_bf16: bool = False
    # Whether the sequence-parallel TP collectives are pipelined with the GEMMs they feed
    # (Megatron-LM's --tp-comm-overlap, torchtitan's enable_async_tensor_parallel): None, the
    # engine's recorded default (`contracts.overlap.EngineOverlap.tp_comm_overlap`, which
    # `costing.overlap.overlap_of` applies). Only the engines in TP_OVERLAP_ENGINES can, and only
    # with tp > 1 and SP.
    tp_comm_overlap: bool | None = None
    # Megatron-LM's --overlap-moe-expert-parallel-comm (Megatron-Bridge's moe_a2a_overlap): the
    # combined 1F1B schedule, a micro-batch's forward paired with another's backward so each
    # one's dispatch and combine all-to-alls run beside the other's compute
    # (`costing.moe_overlap`). Engine megatron, and with pp > 1 interleaved (v > 1); stored False
    # with ep 1, where there is nothing to hide (`estimator.parallel_config` refuses asking for it).
    moe_a2a_overlap: bool = False
    # Megatron-Core's cross-entropy kernels, a name in `engine_rules.CE_FUSIONS` (engine megatron).
    cross_entropy_fusion: str = "none"
    # torch's checkpoint early stop under full recomputation (`engine_rules.early_stop_of`); None, and
    # stored None where it says the same: the engine's rule. Megatron and DeepSpeed cannot stop early.
    recompute_early_stop: bool | None = None
    torch_compile: bool = False  # torch.compile of the model (`engine_rules.COMPILE_ENGINES`: torchtitan's)
    # torch.compile of the loss (torchtitan's [compile] components); None (also stored where equal): with the model
    compile_loss: bool | None = None  # `engine_rules.compiles_loss`

    def __post_init__(self):
        if self.etp is not None and self.etp == self.tp:
            object.__setattr__(self, "etp", None)
        self._check_fp8_recipe()
        self._check_recompute_modules()
        if self.cp_method not in CP_METHODS:
            raise ValueError(f"cp_method must be one of {', '.join(CP_METHODS)}, got {self.cp_method!r}")
        if self.cp == 1 and self.cp_method != DEFAULT_CP_METHOD:
            object.__setattr__(self, "cp_method", DEFAULT_CP_METHOD)
        self._check_mesh()
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero must be 0, 1, 2 or 3, got {self.zero!r}")
        self._check_shard_group()
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {self.recompute!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.engine in NO_PIPELINE_ENGINES and max(self.pp, self.cp, self.ep) > 1:
            raise ValueError(f"{self.engine} trains with FSDP (and tensor parallelism) alone: it has no pipeline, "
                             f"context or expert parallelism; use pp, cp and ep 1 (got pp={self.pp}, cp={self.cp}, "
                             f"ep={self.ep})")
        self._check_offload()
        if self.grad_reduce_in_bf16 and (problem := bf16_grads_problem(self.engine, self.precision)):
            raise ValueError(problem)
        object.__setattr__(self, "recompute_early_stop", stored_early_stop(self.engine, self.recompute_early_stop))
        if self.sp and self.tp == 1:
            raise ValueError("sequence parallelism (--sp) needs tensor parallelism: set --tp > 1")
        if problem := (ce_fusion_problem(self.engine, self.cross_entropy_fusion) or compile_problem(
                self.engine, self.torch_compile) or moe_sp_problem(self.engine, self.tp, self.sp, self.ep > 1)
                or tp_sp_problem(self.engine, self.tp, self.sp)):
            raise ValueError(problem)
        self._check_tp_comm_overlap()
        self._check_moe_a2a_overlap()
        object.__setattr__(self, "compile_loss", stored_compile_loss(self))
        samples_per_replica, rest = divmod(self.global_batch, self.dp)
        if rest:
            raise ValueError(f"global batch {self.global_batch} is not divisible by dp={self.dp}; "
                             f"use a multiple of {self.dp}")
        if samples_per_replica % self.microbatch_size:
            raise ValueError(f"micro-batch size {self.microbatch_size} does not divide the {samples_per_replica} "
                             f"samples per data-parallel replica (global batch {self.global_batch} / dp {self.dp})")
        if self.pp > 1 and self.num_microbatches < self.pp:
            raise ValueError(f"{self.num_microbatches} micro-batches is fewer than the {self.pp} pipeline stages; "
                             f"lower --mbs or raise --gbs to at least {self.pp * self.dp * self.microbatch_size}")
        self.schedule_spec.check(self.pp, self.num_microbatches, self.virtual_stages)
        self._check_microbatch_group()

    def _check_microbatch_group(self) -> None:
        group = self.microbatch_group_size
        if not _optional_positive_int("microbatch_group_size", group):
            return
        if self.schedule_spec.actions != "interleaved":
            raise ValueError(f"a micro-batch group size ({group}) orders interleaved 1F1B (Megatron-Core's "
                             f"--microbatch-group-size-per-virtual-pipeline-stage); use --schedule interleaved, "
                             f"not {self.schedule}")
        m = self.num_microbatches
        if m % group or group < self.pp:
            # below pp, rank 0's warm-up forwards wait on the last rank's, which waits on rank 0's backward
            raise ValueError(f"the micro-batch group size ({group}) must be at least pp ({self.pp}), else interleaved "
                             f"1F1B deadlocks, and divide the {m} micro-batches per step; use a divisor of {m} "
                             f"from {self.pp} up")
        if group == default_microbatch_group(self.pp, m):
            object.__setattr__(self, "microbatch_group_size", None)

    def rank_of_chunk(self, chunk: int) -> int:
        """Pipeline rank that runs model chunk `chunk` (`Schedule.chunk_rank`)."""
        return self.schedule_spec.chunk_rank(self.pp, chunk)

    def chunk_at(self, stage: int, virtual_stage: int) -> int:
        """Model chunk that pipeline rank `stage` runs as its virtual stage `virtual_stage`."""
        return self.schedule_spec.chunk_index(self.pp, stage, virtual_stage)

    def chunks_of_rank(self, rank: int) -> tuple[int, ...]:
        """Model chunks pipeline rank `rank` runs, by virtual stage."""
        return tuple(self.chunk_at(rank, local) for local in range(self.virtual_stages))

    def _check_mesh(self) -> None:
        """Sizes are positive integers, the mesh axes multiply to the GPUs, each folded axis divides
        the ranks it is carved out of (`contracts.axes`). A mesh of plain ints checked once is not
        checked again (the search builds tens of thousands of configurations over a few meshes)."""
        key = (self.gpus, self.global_batch, self.microbatch_size, self.virtual_stages, self.tp, self.pp, self.dp,
               self.cp, self.ep, self.etp)
        if key in _CHECKED_MESHES and all(type(value) is int for value in key[:-1]):  # True == 1: types too
            return
        self._check_mesh_fully()
        if all(type(value) is int for value in key[:-1]) and type(self.etp) in (int, type(None)):
            if len(_CHECKED_MESHES) >= _MAX_CHECKED_MESHES:
                _CHECKED_MESHES.clear()
            _CHECKED_MESHES.add(key)

    def _check_mesh_fully(self) -> None:
        sizes = (self.gpus, self.global_batch, self.microbatch_size, self.virtual_stages)
        if not all(type(value) is int and value > 0 for value in sizes):  # the search builds many: fast path first
            for name in ("gpus", "global_batch", "microbatch_size", "virtual_stages"):
                value = getattr(self, name)
                if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                    raise ValueError(f"{name} must be a positive integer, got {value!r}")
        product = 1
        for axis in MESH_AXES:
            axis.check(self)
            product *= getattr(self, axis.name)
        if product != self.gpus:
            raise ValueError(f"{mesh_product_text(self)} must equal the number of GPUs ({self.gpus})")
        for axis in FOLDED_AXES:
            axis.check(self)

    def _check_fp8_recipe(self) -> None:
        object.__setattr__(self, "fp8_recipe", stored_fp8_recipe(self.precision, self.engine, self.fp8_recipe))
        if self.fp8_filter != ():
            object.__setattr__(self, "fp8_filter", stored_fp8_filter(self.precision, self.engine, self.fp8_recipe,
                                                                     self.fp8_filter))

    def _check_recompute_modules(self) -> None:
        modules = self.recompute_modules
        if modules == ():  # the default, and what the search builds tens of thousands of
            return
        if isinstance(modules, str) or not all(isinstance(name, str) for name in modules):
            raise ValueError(f"recompute_modules must be a sequence of names, got {modules!r}")
        unknown = [name for name in modules if name not in RECOMPUTE_MODULES]
        if unknown:
            raise ValueError(f"unknown recompute module(s) {', '.join(unknown)}; known: {', '.join(RECOMPUTE_MODULES)}")
        if modules and self.engine != "megatron":
            raise ValueError(f"recompute modules ({' '.join(modules)}) are Megatron-Core's fine-grained "
                             f"recomputation: price them with engine megatron, not {self.engine!r} (whose "
                             "selective recomputation rebuilds the attention core)")
        object.__setattr__(self, "recompute_modules", tuple(sorted(set(modules))))

    @property
    def selective_modules(self) -> tuple[str, ...]:
        """What selective recomputation rebuilds: `recompute_modules`, or the attention core."""
        return self.recompute_modules or DEFAULT_RECOMPUTE_MODULES

    def _check_shard_group(self) -> None:
        group = self.shard_group
        if not _optional_positive_int("shard_group", group):
            return
        if self.zero == 0:
            raise ValueError(f"shard_group {group} (HSDP) shards ZeRO state: it needs --zero 1, 2 or 3, got zero 0")
        if self.dp % group or group == 1:
            raise ValueError(f"shard_group {group} must divide dp={self.dp} and be > 1 (state is sharded over "
                             f"the group and replicated across the dp / {group} groups)")

    def _check_tp_comm_overlap(self) -> None:
        overlap = self.tp_comm_overlap
        if overlap is None:
            return
        if not isinstance(overlap, bool):
            raise ValueError(f"tp_comm_overlap must be true, false or null (the engine's default), got {overlap!r}")
        if overlap and self.engine not in TP_OVERLAP_ENGINES:
            raise ValueError(f"{self.engine} runs its TP collectives on the compute stream: TP communication overlap "
                             f"needs engine megatron (its --tp-comm-overlap) or torchtitan (its async TP)")
        if overlap and not (self.tp > 1 and self.sp):
            raise ValueError(f"TP communication overlap pipelines the sequence-parallel all-gathers and "
                             f"reduce-scatters with their GEMMs: it needs tp > 1 and sequence parallelism "
                             f"(got tp={self.tp}, sp={self.sp})")

    def _check_moe_a2a_overlap(self) -> None:
        if not isinstance(self.moe_a2a_overlap, bool):
            raise ValueError(f"moe_a2a_overlap must be true or false, got {self.moe_a2a_overlap!r}")
        if self.moe_a2a_overlap and self.ep == 1:  # nothing to hide: equal layouts compare equal
            object.__setattr__(self, "moe_a2a_overlap", False)
        if self.moe_a2a_overlap and (problem := self.a2a_overlap_problem()):
            raise ValueError(problem)

    def a2a_overlap_problem(self) -> str | None:
        """Why this layout cannot run Megatron-Core's combined 1F1B, or None (ep 1 included: it
        then has nothing to hide). The search asks it of every candidate before turning it on."""
        if problem := a2a_overlap_engine_problem(self.engine):
            return problem
        if self.pp > 1 and self.virtual_stages < 2:
            return (f"Megatron-LM's combined 1F1B with pipelining extends its interleaved schedule: pp={self.pp} "
                    f"needs virtual stages > 1 (got {self.virtual_stages}); use --schedule interleaved with --vpp 2 "
                    "or more")
        return None

    def _check_offload(self) -> None:
        if self.offload not in OFFLOAD:
            raise ValueError(f"offload must be one of {', '.join(OFFLOAD)}, got {self.offload!r}")
        if self.offload == "params" and self.zero != 3:
            raise ValueError(f"offloading parameters (offload params) needs them sharded, ZeRO-3 (as DeepSpeed's "
                             f"offload_param and FSDP2's CPUOffloadPolicy do), got zero {self.zero}; set --zero 3 "
                             "or offload the optimizer only")

    @property
    def schedule_spec(self) -> Schedule:
        """The description of the pipeline schedule (`contracts.schedule`)."""
        return schedule_spec(self.schedule)

    @property
    def shard_degree(self) -> int:
        """Ranks that share one copy of the sharded states: (HSDP's shard group or dp) x cp."""
        return (self.shard_group or self.dp) * self.cp

    @property
    def data_ranks(self) -> int:
        """Ranks over which gradients are averaged: every data-parallel and context-parallel rank."""
        return self.dp * self.cp

    @property
    def rank_microbatch(self) -> int | float:
        """Samples' worth of tokens of a micro-batch one rank holds: mbs, or mbs / cp under
        context parallelism (each rank holds 1/cp of every sequence)."""
        return self.microbatch_size if self.cp == 1 else self.microbatch_size / self.cp

    @property
    def attention_query_split(self) -> int:
        """What one attention call's queries are cut by: cp when the ranks attend over their sequence
        chunks (all-gather, rings), 1 under Ulysses (each rank attends over the whole sequence for
        its heads / cp)."""
        return 1 if self.cp_method == "ulysses" else self.cp

    @property
    def stage_ranks(self) -> int:
        """Ranks of one pipeline stage, which the dense and the expert layers each lay out: tp * cp * dp."""
        return self.tp * self.cp * self.dp

    @property
    def expert_tp(self) -> int:
        """The routed experts' tensor-parallel degree: etp, or tp when unset."""
        return self.tp if self.etp is None else self.etp

    @property
    def expert_ranks(self) -> int:
        """Expert-TP groups of a stage, which ep regroups as (edp, ep): tp * cp * dp / etp."""
        return self.stage_ranks // self.expert_tp

    @property
    def expert_data_ranks(self) -> int:
        """Ranks over which routed-expert gradients are averaged (each holds the same expert shards):
        tp * cp * dp / (etp * ep); dp * cp / ep when etp = tp."""
        return self.expert_ranks // self.ep

    @property
    def expert_data_stride(self) -> int:
        """Ranks between two that hold the same expert shards: etp * ep."""
        return self.expert_tp * self.ep

    def degree(self, axis: str) -> int:
        """The degree of the mesh or folded axis `axis`, an unset following axis resolved (etp: tp)."""
        return self.expert_tp if axis == "etp" else getattr(self, axis)

    def stride(self, axis: str) -> int:
        """Ranks between neighbours of a mesh axis's group (`contracts.axes.mesh_stride`): tp 1,
        cp tp, dp cp*tp, pp dp*cp*tp."""
        return mesh_stride(self, axis)

    def enabled(self, axis: str) -> bool:
        """Whether the mesh or folded axis `axis` (a name in `contracts.axes`) splits anything."""
        return self.degree(axis) > 1

    @property
    def num_microbatches(self) -> int:
        return self.global_batch // (self.dp * self.microbatch_size)

    @property
    def num_model_chunks(self) -> int:
        """Pipeline chunks the layers are cut into (pp * virtual stages)."""
        return self.pp * self.virtual_stages

    @property
    def sort_key(self) -> tuple:
        """The search's tie-break order: smaller pipelines, then smaller TP, ... first (computed
        once: the search sorts and heaps tens of thousands of candidates by it)."""
        key = self.__dict__.get("_sort_key")
        if key is None:
            mesh = tuple(getattr(self, axis.name) for axis in _MESH_BY_TIE_BREAK)
            folded = tuple(self.degree(axis.name) for axis in _FOLDED_BY_TIE_BREAK)
            key = (*mesh, self.microbatch_size, self.zero, self.sp, self.schedule, self.virtual_stages,
                   -(self.shard_group or self.dp), *folded, self.cp_method != DEFAULT_CP_METHOD)
            object.__setattr__(self, "_sort_key", key)
        return key

    def __hash__(self) -> int:
        """The fields' hash, computed once (a search keys dicts and sets by configurations many
        times over). Not pickled (`__getstate__`): string hashes differ between processes."""
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(tuple(getattr(self, name) for name in CONFIG_FIELDS))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __getstate__(self) -> dict:
        return {name: value for name, value in self.__dict__.items() if name != "_hash"}

    def mesh_label(self) -> str:
        """'pp=2 dp=4 tp=8', the axes in mesh order, an optional one only when it is on; a CP
        method other than the default after cp ('cp=2 ulysses')."""
        return " ".join(f"{axis.name}={getattr(self, axis.name)}"
                        + (f" {self.cp_method}" if axis.name == "cp" and self.cp_method != DEFAULT_CP_METHOD else "")
                        for axis in AXES if axis.shown(self))

    def label(self) -> str:
        interleaving = self.schedule_spec.free_chunks
        sched = f"{self.schedule} x{self.virtual_stages}" if interleaving else self.schedule
        sched += f" group {self.microbatch_group_size}" if self.microbatch_group_size else ""
        return (f"{self.mesh_label()}"
                f"{' +sp' if self.sp else ''}, {sched}, "
                f"mbs {self.microbatch_size}, ZeRO-{self.zero}"
                + (f" HSDP shard {self.shard_group}" if self.shard_group else "")
                + (f", {self.offload} offloaded" if self.offload != "none" else "")
                + (", bf16 gradients" if self.grad_reduce_in_bf16 else "")
                + (f", {self.cross_entropy_fusion} fused loss" if self.cross_entropy_fusion != "none" else "")
                + (", compiled" if self.torch_compile else "")
                + ("" if self.compile_loss is None else ", loss compiled" if self.compile_loss else ", loss eager"))

    def precision_label(self) -> str:
        """The precision, under fp8 with its recipe and the Linears a filter keeps in bf16."""
        if self.precision != "fp8":
            return self.precision
        return f"fp8 {self.fp8_recipe}" + (f" ({','.join(self.fp8_filter)} in bf16)" if self.fp8_filter else "")

    def to_json(self) -> dict:
        return asdict(self)


# Its fields' names, in order (a memo keys on their values: `costing.layer_cost`).
CONFIG_FIELDS = tuple(f.name for f in fields(ParallelConfig))
# The search's tie-break order (`ParallelConfig.sort_key`): mesh axes, then the switches, then folded axes.
_MESH_BY_TIE_BREAK = tuple(sorted(MESH_AXES, key=lambda axis: axis.tie_break))
_FOLDED_BY_TIE_BREAK = tuple(sorted(FOLDED_AXES, key=lambda axis: axis.tie_break))


def chunk_rank(schedule: str, pp: int, chunk: int) -> int:
    """Pipeline rank of model chunk `chunk` under the schedule named `schedule` (`Schedule.chunk_rank`)."""
    return schedule_spec(schedule).chunk_rank(pp, chunk)


def chunk_index(schedule: str, pp: int, stage: int, virtual_stage: int) -> int:
    """Inverse of `chunk_rank`: the chunk rank `stage` runs as its virtual stage (`Schedule.chunk_index`)."""
    return schedule_spec(schedule).chunk_index(pp, stage, virtual_stage)
