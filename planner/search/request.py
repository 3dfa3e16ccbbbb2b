"""What `meshplan plan` is asked (`PlanRequest`): the model, the cluster and the sizes, the pins,
how many plans to keep and how long to search. Validated once, here; the search reads it whole."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from functools import cached_property

from meshplan.planner.contracts.cluster import ClusterProfile
from meshplan.planner.contracts.config import (ENGINE_CP_METHODS, ENGINES, MTP_ENGINES, TP_OVERLAP_ENGINES,
                                                a2a_overlap_engine_problem, bf16_grads_problem,
                                                ce_fusion_problem)
from meshplan.planner.contracts.engine_rules import compile_loss_problem, compile_problem, early_stop_problem
from meshplan.planner.contracts.fp8_choice import stored_fp8_filter, stored_fp8_recipe
from meshplan.planner.contracts.schedule import SCHEDULE_SPECS
from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.search.candidates import Pins


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """One search's request. `PlanRequest.of` builds it the way `meshplan.plan` is called (a
    cluster by name, a default precision, pins as keywords)."""

    spec: str
    cluster: ClusterProfile  # as loaded: `planning_cluster` adds the headroom
    gpus: int
    global_batch: int
    precision: str  # a recipe of contracts.config.PRECISIONS
    seq: int | None = None  # None: the model's default (`registry.default_seq`)
    pins: Pins = field(default_factory=Pins)
    top_k: int = 5
    dtype: str | None = None  # of the profile; None: fp32 for fp32 training, else bf16
    attention: str = "flash"
    layerwise: bool = False
    time_limit_s: float = 2.5  # per candidate ILP
    seed: int = 0  # recorded in the plan (training data order)
    workers: int = 2
    num_rerank: int | None = None  # None: max(2 top_k, 6)
    max_mbs: int | None = None  # the largest micro-batch size searched; None: what memory allows
    moe_imbalance: float = 1.0
    moe_capacity_factor: float | None = None
    moe_pad_to_capacity: bool = False
    moe_dispatcher: str = "alltoall"  # contracts.config.MOE_DISPATCHERS
    mtp_num_layers: int = 0  # multi-token-prediction depths (`profiling.mtp`)
    memory_headroom_bytes: float = 0.0  # kept free on each GPU beyond the profile's reserve
    engine: str = "meshplan"  # whose memory recipe the search plans under (contracts.config.ENGINES)
    fp8_recipe: str | None = None  # under fp8 (contracts.config.FP8_RECIPES); None: the engine's default
    fp8_filter: tuple[str, ...] = ()  # under fp8, the block Linears left in bf16 (`contracts.fp8_choice`)
    grad_reduce_in_bf16: bool = False  # engine megatron: Megatron-LM's bf16 gradient buffer and reduction
    tp_comm_overlap: bool | None = None  # TP collectives pipelined with their GEMMs; None: the engine's record
    moe_a2a_overlap: bool = False  # engine megatron's combined 1F1B, where a candidate can run it (`costing.moe_overlap`)
    cross_entropy_fusion: str = "none"  # engine megatron's cross-entropy kernels (`costing.loss_kernels`)
    recompute_early_stop: bool | None = None  # torch's checkpoint early stop; None: the engine's rule
    torch_compile: bool = False  # the engine compiles the model (torchtitan's training.compile)
    compile_loss: bool | None = None  # the engine compiles the loss; None: with the model

    def __post_init__(self):
        from meshplan.planner.costing.fp8 import check_fp8_supported
        from meshplan.planner.simulation.estimator import with_memory_headroom

        with_memory_headroom(self.cluster, self.memory_headroom_bytes)  # MeshplanError unless some memory is left
        sizes = (("--gpus", self.gpus), ("--gbs", self.global_batch), ("--top", self.top_k))
        for name, value in sizes + ((("--max-mbs", self.max_mbs),) if self.max_mbs is not None else ()):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise MeshplanError(f"{name} must be a positive integer, got {value!r}")
        cluster = self.cluster
        capacity = cluster.gpus_per_node * cluster.max_nodes
        if self.gpus > capacity:
            raise MeshplanError(f"--gpus {self.gpus} exceeds the {capacity} GPUs of cluster {cluster.name!r} "
                                f"({cluster.max_nodes} nodes x {cluster.gpus_per_node}); use at most {capacity}")
        if self.engine not in ENGINES:
            raise MeshplanError(f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        check_fp8_supported(cluster, self.precision, self.fp8_recipe)
        if self.fp8_filter:
            try:
                stored = stored_fp8_filter(self.precision, self.engine, stored_fp8_recipe(
                    self.precision, self.engine, self.fp8_recipe), tuple(self.fp8_filter), searched=True)
            except ValueError as exc:
                raise MeshplanError(str(exc).replace("fp8_filter", "--fp8-filter")) from None
            object.__setattr__(self, "fp8_filter", stored)
        if self.mtp_num_layers and self.engine not in MTP_ENGINES + ("meshplan",):
            raise MeshplanError(f"--mtp-num-layers {self.mtp_num_layers} with --engine {self.engine}: only Megatron-LM "
                                "builds multi-token-prediction depths (--mtp-num-layers); plan --engine megatron, or "
                                "without --mtp-num-layers")
        schedule = self.pins.schedule
        if schedule in SCHEDULE_SPECS and self.pins.pp != 1 and not SCHEDULE_SPECS[schedule].runs_under(self.engine):
            runs = [name for name, spec in SCHEDULE_SPECS.items() if spec.runs_under(self.engine)]
            raise MeshplanError(f"--schedule {schedule}: {self.engine} does not run it (it runs {', '.join(runs)}); "
                                "pin one of those or leave --schedule out")
        method = self.pins.cp_method
        if method is not None and method not in ENGINE_CP_METHODS.get(self.engine, (method,)):
            raise MeshplanError(f"--cp-method {method}: {self.engine} does not run it (its context parallelism: "
                                f"{', '.join(ENGINE_CP_METHODS[self.engine])}); pin that or leave --cp-method out")
        if self.tp_comm_overlap and self.engine not in TP_OVERLAP_ENGINES:
            raise MeshplanError(f"--tp-comm-overlap on: {self.engine} runs its TP collectives on the compute stream; "
                                f"TP overlap is --engine {' or '.join(TP_OVERLAP_ENGINES)}'s")
        if self.moe_a2a_overlap and (problem := a2a_overlap_engine_problem(self.engine)):
            raise MeshplanError(problem)
        if self.grad_reduce_in_bf16 and (problem := bf16_grads_problem(self.engine, self.precision)):
            raise MeshplanError(problem.replace("grad_reduce_in_bf16", "--grad-reduce-in-bf16").replace(
                "engine", "--engine").replace("precision", "--precision"))
        if problem := ce_fusion_problem(self.engine, self.cross_entropy_fusion):
            raise MeshplanError(problem.replace("cross_entropy_fusion", "--cross-entropy-fusion").replace(
                "use engine", "use --engine"))
        if problem := early_stop_problem(self.engine, self.recompute_early_stop):
            raise MeshplanError(f"--recompute-early-stop on: {problem}")
        if problem := (compile_problem(self.engine, self.torch_compile)
                       or compile_loss_problem(self.engine, self.compile_loss)):
            raise MeshplanError(problem.replace("under engine", "under --engine"))

    @classmethod
    def of(cls, spec: str, cluster, gpus: int, global_batch: int, seq: int | None = None, *,
           pins: Pins | None = None, precision: str | None = None, **options) -> PlanRequest:
        """The request of `search_plan`'s arguments: `cluster` a profile or its name (or TOML
        path), `precision` None for the cluster's default (fp8 only when asked: it changes
        numerics), `attention` None (or absent) for the engine's own kernel, `options` the other
        fields by name and, without `pins`, the pins by name."""
        from meshplan.planner.costing.attention_kernels import engine_attention
        from meshplan.planner.costing.hardware import load_cluster
        from meshplan.planner.simulation.estimator import default_precision

        if isinstance(cluster, str):
            cluster = load_cluster(cluster)
        names = {f.name for f in fields(cls)}
        settings = {name: value for name, value in options.items() if name in names}
        # no kernel named: the one the engine runs (`meshplan estimate`'s rule)
        settings["attention"] = engine_attention(settings.get("engine"), settings.get("attention"))[0]
        pin_kwargs = {name: value for name, value in options.items() if name not in names}
        return cls(spec=spec, cluster=cluster, gpus=gpus, global_batch=global_batch, seq=seq,
                   pins=pins or Pins(**pin_kwargs), precision=precision or default_precision(cluster), **settings)

    @property
    def num_keep(self) -> int:
        """Solutions re-ranked by the simulator (the pruning keeps this many best objectives)."""
        return self.num_rerank or max(2 * self.top_k, 6)

    @cached_property
    def planning_cluster(self) -> ClusterProfile:
        """The cluster with `memory_headroom_bytes` more reserved per GPU: the search, the
        simulator's fit check and the plan's embedded profile all plan against what is left."""
        from meshplan.planner.simulation.estimator import with_memory_headroom

        return with_memory_headroom(self.cluster, self.memory_headroom_bytes)
