"""`estimate`: predict one hand-written parallel configuration (what `meshplan estimate` prints).

    estimate(spec, cluster, gpus, global_batch, seq, tp, pp, ...) -> Prediction

builds the configuration's `ParallelConfig` once (`parallel_config`, checked against the
cluster before anything is profiled), profiles the model (`planner.profiling.profiler.profile`),
checks the configuration against the model (`check_model_fit`), then plays the step in the
event-driven simulator on the uniform plan: every layer under the configuration's strategy, the
layers cut into balanced chunks (`planner.simulation.simulator.simulate_config`).
"""
from __future__ import annotations

from dataclasses import replace

from meshplan.planner.contracts.cluster import ClusterProfile
from meshplan.planner.contracts.config import DEFAULT_CP_METHOD, ParallelConfig, moe_sp_problem
from meshplan.planner.contracts.schedule import SCHEDULE_SPECS
from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.contracts.prediction import Prediction
from meshplan.planner.costing.fp8 import check_fp8_supported
from meshplan.planner.costing.fp8_advice import filter_problem as fp8_filter_problem
from meshplan.planner.costing.hardware import load_cluster
from meshplan.planner.costing.offload import check_offload
from meshplan.planner.simulation.simulator import simulate_config

DEFAULT_SEQ = 2048


def with_memory_headroom(cluster: ClusterProfile, headroom_bytes: float) -> ClusterProfile:
    """`cluster` with `headroom_bytes` more reserved on each GPU; MeshplanError unless the headroom
    leaves some memory usable."""
    if not headroom_bytes:
        return cluster
    usable = cluster.device.usable_memory_bytes
    if not 0 < headroom_bytes < usable:
        raise MeshplanError(f"--memory-headroom must be between 0 and the {usable / 2**30:.2f} GiB usable per GPU "
                            f"on {cluster.device.name}, got {headroom_bytes / 2**30:.3g} GiB")
    device = replace(cluster.device, reserved_memory_bytes=cluster.device.reserved_memory_bytes + headroom_bytes)
    return replace(cluster, device=device)


def default_precision(cluster: ClusterProfile) -> str:
    """bf16-mixed where the device computes bf16 faster than fp32 (GPUs), else fp32 (CPUs)."""
    peaks = cluster.device.peak_flops_per_s
    return "bf16-mixed" if peaks.get("bf16", 0.0) > peaks.get("fp32", 0.0) else "fp32"


def make_config(graph, cluster: ClusterProfile, **degrees) -> ParallelConfig:
    """The ParallelConfig of `degrees` (`parallel_config`'s keywords), checked against the cluster
    and the model; MeshplanError says why not."""
    config = parallel_config(cluster, **degrees)
    check_model_fit(graph, config)
    return config


def check_model_fit(graph, config: ParallelConfig) -> None:
    """The checks that need the model: CP and EP apply to it, TP splits every layer, the layers
    fill every pipeline chunk, and an fp8 filter applies to its blocks (`costing.fp8_filter`)."""
    check_context_parallel(graph, config.cp, config.cp_method, config.tp)
    check_expert_parallel_request(graph, config.ep, config.etp)
    check_tp_splits(graph, config.tp)
    if problem := moe_sp_problem(config.engine, config.tp, config.sp, graph.info.num_experts > 0):
        raise MeshplanError(problem)
    if config.moe_a2a_overlap and graph.info.moe_dispatcher == "allgather":
        raise MeshplanError("--moe-a2a-overlap pairs the dispatch and combine all-to-alls of Megatron-LM's alltoall "
                            "and flex dispatchers; its allgather dispatcher has none: use --moe-dispatcher alltoall "
                            "or deepep")
    if config.num_model_chunks > len(graph.layers):
        raise MeshplanError(f"pp*vpp = {config.num_model_chunks} pipeline chunks need at least "
                            f"{config.num_model_chunks} layers; the model has {len(graph.layers)}")
    if problem := fp8_filter_problem(graph, config):
        raise MeshplanError(problem)


def check_tp_splits(graph, tp: int) -> None:
    """Every layer splits tp ways (`costing.executable.tp_split_problem`, the one rule)."""
    from meshplan.planner.costing.executable import model_facts, tp_split_problem

    problem = tp_split_problem(model_facts(graph), tp, f"--tp {tp}")
    if problem:
        raise MeshplanError(problem)


def check_expert_parallel_request(graph, ep: int, etp: int | None = None) -> None:
    """EP and ETP need a mixture of experts whose expert count ep divides and whose experts' width
    etp divides (the mesh checks are ParallelConfig's)."""
    from meshplan.planner.costing.expert_parallel import check_expert_parallel

    try:
        check_expert_parallel(graph.info, ep, etp)
    except ValueError as exc:
        flags = f"--ep {ep}" + (f" --etp {etp}" if etp is not None else "")
        raise MeshplanError(f"{flags}: {exc}") from None


def check_context_parallel(graph, cp: int, method: str = DEFAULT_CP_METHOD, tp: int = 1) -> None:
    """CP splits attention, every sequence in 2*cp chunks, and under Ulysses the heads
    (`costing.executable.cp_split_problem`)."""
    from meshplan.planner.costing.executable import cp_split_problem, model_facts

    problem = cp_split_problem(model_facts(graph), cp, f"--cp {cp}", method, tp)
    if problem:
        raise MeshplanError(problem)


def parallel_config(cluster: ClusterProfile, *, gpus: int, global_batch: int, tp: int = 1, pp: int = 1,
                    mbs: int = 1, zero: int = 0, recompute: str = "none", sp: bool = False, schedule: str = "1f1b",
                    vpp: int = 1, precision: str = "bf16-mixed", shard_group: int | None = None, cp: int = 1,
                    ep: int = 1, etp: int | None = None, engine: str = "meshplan",
                    fp8_recipe: str | None = None, recompute_modules: tuple[str, ...] = (),
                    offload: str = "none", cp_method: str | None = None,
                    microbatch_group_size: int | None = None, grad_reduce_in_bf16: bool = False,
                    tp_comm_overlap: bool | None = None, moe_a2a_overlap: bool = False,
                    cross_entropy_fusion: str = "none", recompute_early_stop: bool | None = None,
                    torch_compile: bool = False, fp8_filter: tuple[str, ...] = (),
                    compile_loss: bool | None = None) -> ParallelConfig:
    """The ParallelConfig of command-line degrees, DP = gpus / (tp * pp * cp), checked against the
    cluster (`check_mesh`, `check_fp8_supported` with the recipe the engine runs) and by
    ParallelConfig itself; its errors become MeshplanError.
    `recompute_modules`: Megatron-Core's `--recompute-modules` (with recompute "selective");
    `fp8_filter`: the block Linears left in bf16 under fp8 (`contracts.fp8_choice`)."""
    check_mesh(cluster, gpus, tp, pp, cp)
    check_fp8_supported(cluster, precision, fp8_recipe)
    if moe_a2a_overlap and ep < 2:
        raise MeshplanError(f"--moe-a2a-overlap hides expert-parallel all-to-alls: it needs --ep > 1, got --ep {ep}")
    if recompute_early_stop is not None and recompute != "full":
        raise MeshplanError(f"--recompute-early-stop says how full recomputation reruns a block: add --recompute full "
                            f"(got --recompute {recompute})")
    if recompute_modules and recompute != "selective":
        raise MeshplanError(f"--recompute-modules {' '.join(recompute_modules)} names what selective recomputation "
                            f"rebuilds: add --recompute selective (got --recompute {recompute})")
    dp = gpus // (tp * pp * cp)
    if schedule in SCHEDULE_SPECS and vpp == 1:
        vpp = SCHEDULE_SPECS[schedule].least_chunks  # a V always holds two chunks per rank: --vpp 2 is implied
    if shard_group == dp:  # sharding over every dp rank is plain ZeRO
        shard_group = None
    try:
        config = ParallelConfig(gpus=gpus, global_batch=global_batch, tp=tp, pp=pp, dp=dp, cp=cp,
                                microbatch_size=mbs, zero=zero, recompute=recompute, sp=sp, schedule=schedule,
                                virtual_stages=vpp, precision=precision, shard_group=shard_group, ep=ep,
                                etp=etp, engine=engine, fp8_recipe=fp8_recipe,
                                recompute_modules=tuple(recompute_modules), offload=offload,
                                cp_method=cp_method or DEFAULT_CP_METHOD,
                                microbatch_group_size=microbatch_group_size,
                                grad_reduce_in_bf16=grad_reduce_in_bf16, tp_comm_overlap=tp_comm_overlap,
                                moe_a2a_overlap=moe_a2a_overlap, cross_entropy_fusion=cross_entropy_fusion,
                                recompute_early_stop=recompute_early_stop, torch_compile=torch_compile,
                                fp8_filter=tuple(fp8_filter), compile_loss=compile_loss)
    except ValueError as exc:
        raise MeshplanError(str(exc).replace("shard_group", "--shard-group").replace(
            "cp_method", "--cp-method").replace("microbatch_group_size", "--microbatch-group-size").replace(
            "grad_reduce_in_bf16 keeps", "--grad-reduce-in-bf16 keeps").replace("use engine", "use --engine").replace(
            "cross_entropy_fusion", "--cross-entropy-fusion").replace(
            "TP communication overlap", "--tp-comm-overlap on").replace(
            "torch's early stop needs", "--recompute-early-stop on needs").replace(
            "expert parallelism ep=", "--ep ").replace(
            "expert tensor parallelism etp=", "--etp ").replace("fp8_filter", "--fp8-filter")) from None
    check_fp8_supported(cluster, config.precision, config.fp8_recipe)  # the engine's default recipe too
    return config


def check_mesh(cluster: ClusterProfile, gpus: int, tp: int, pp: int, cp: int = 1) -> None:
    """The checks that need no model: degrees divide the GPUs, TP fits in a node, GPUs exist."""
    for name, value in (("gpus", gpus), ("tp", tp), ("pp", pp), ("cp", cp)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise MeshplanError(f"--{name} must be a positive integer, got {value!r}")
    if gpus % (tp * pp * cp):
        names, values = ("tp*pp*cp", f"{tp}*{pp}*{cp}") if cp > 1 else ("tp*pp", f"{tp}*{pp}")
        raise MeshplanError(f"--gpus {gpus} is not divisible by {names} = {values} = {tp * pp * cp}; "
                            f"use a multiple of {tp * pp * cp} GPUs or other degrees")
    if tp > cluster.gpus_per_node or cluster.gpus_per_node % tp:
        raise MeshplanError(f"--tp {tp} must divide the {cluster.gpus_per_node} GPUs of one node of "
                            f"{cluster.name!r} (tensor parallelism stays inside a node)")
    max_gpus = cluster.gpus_per_node * cluster.max_nodes
    if gpus > max_gpus:
        raise MeshplanError(f"--gpus {gpus} exceeds the {max_gpus} GPUs profile {cluster.name!r} allows "
                            f"({cluster.max_nodes} nodes of {cluster.gpus_per_node})")


def estimate(spec: str, cluster: str | ClusterProfile, gpus: int, global_batch: int, seq: int | None = None,
             tp: int = 1, pp: int = 1, mbs: int = 1, zero: int = 0, recompute: str = "none", sp: bool = False,
             schedule: str = "1f1b", vpp: int = 1, precision: str | None = None, dtype: str | None = None,
             attention: str | None = None, shard_group: int | None = None, cp: int = 1, ep: int = 1,
             etp: int | None = None, moe_imbalance: float = 1.0, moe_capacity_factor: float | None = None,
             moe_pad_to_capacity: bool = False, engine: str = "meshplan",
             memory_headroom_bytes: float = 0.0, fp8_recipe: str | None = None,
             recompute_modules: tuple[str, ...] = (), offload: str = "none", cp_method: str | None = None,
             moe_dispatcher: str = "alltoall", microbatch_group_size: int | None = None,
             grad_reduce_in_bf16: bool = False, tp_comm_overlap: bool | None = None,
             mtp_num_layers: int = 0, moe_a2a_overlap: bool = False, cross_entropy_fusion: str = "none",
             recompute_early_stop: bool | None = None, torch_compile: bool = False,
             fp8_filter: tuple[str, ...] = (), compile_loss: bool | None = None) -> Prediction:
    """Predict step time, memory per pipeline rank, throughput and MFU of one configuration.
    `attention`: the kernel (`contracts.attention`; None: the one `engine` runs,
    `attention_kernels.engine_attention`); `shard_group`: HSDP (ZeRO over groups of that many dp
    ranks, replicated across them); `cp`: context parallelism (each of cp ranks holds 1/cp of
    every sequence), `cp_method` how they attend (`contracts.config.CP_METHODS`); `engine`: whose
    memory recipe prices it (`costing.engine_memory`; meshplan: its own executor); `offload`: model
    states kept in host memory (`costing.offload`: none, optimizer, params); `recompute_modules`:
    Megatron-Core's `--recompute-modules` (engine megatron, `contracts.config.RECOMPUTE_MODULES`);
    `memory_headroom_bytes`: kept free on each GPU beyond the profile's reserve (`fits` judges
    against what is left); `fp8_recipe`: under fp8, a name in `contracts.config.FP8_RECIPES`
    (None: the engine's default); `moe_dispatcher`: how MoE tokens reach the experts
    (`contracts.config.MOE_DISPATCHERS`, priced by `costing.moe_dispatch`); `microbatch_group_size`:
    interleaved 1F1B's micro-batches per round (Megatron-Core's group size; None: pp);
    `grad_reduce_in_bf16`: Megatron-LM's bf16 gradient buffer (engine megatron); `tp_comm_overlap`:
    the TP collectives pipelined with their GEMMs or not (None: the engine's record);
    `mtp_num_layers`: multi-token-prediction depths (`profiling.mtp`); `moe_a2a_overlap`:
    Megatron-Core's combined 1F1B (`costing.moe_overlap`, engine megatron); `cross_entropy_fusion`:
    Megatron-Core's cross-entropy kernels (`costing.loss_kernels`, engine megatron);
    `recompute_early_stop`: torch's checkpoint early stop on or off under full recomputation (None:
    the engine's rule, `contracts.engine_rules.early_stop_default`); `torch_compile`, `compile_loss`:
    the engine compiles the model, the loss (None: with the model; `engine_rules.compiles_loss`);
    `fp8_filter`: the block Linears fp8 leaves in bf16 (`contracts.fp8_choice`, `costing.fp8_filter`)."""
    from meshplan.planner.costing.attention_kernels import engine_attention
    from meshplan.planner.models.registry import default_seq
    from meshplan.planner.profiling.profiler import profile

    cluster = with_memory_headroom(cluster if isinstance(cluster, ClusterProfile) else load_cluster(cluster),
                                   memory_headroom_bytes)
    precision = precision or default_precision(cluster)
    # built and checked before profiling, which is the slow part: a bad mesh fails fast
    config = parallel_config(cluster, gpus=gpus, global_batch=global_batch, tp=tp, pp=pp, mbs=mbs, zero=zero,
                             recompute=recompute, sp=sp, schedule=schedule, vpp=vpp, precision=precision,
                             shard_group=shard_group, cp=cp, ep=ep, etp=etp, engine=engine, fp8_recipe=fp8_recipe,
                             recompute_modules=recompute_modules, offload=offload, cp_method=cp_method,
                             microbatch_group_size=microbatch_group_size, grad_reduce_in_bf16=grad_reduce_in_bf16,
                             tp_comm_overlap=tp_comm_overlap, moe_a2a_overlap=moe_a2a_overlap,
                             cross_entropy_fusion=cross_entropy_fusion, recompute_early_stop=recompute_early_stop,
                             torch_compile=torch_compile, fp8_filter=fp8_filter, compile_loss=compile_loss)
    check_offload(config, cluster)
    dtype = dtype or ("fp32" if precision == "fp32" else "bf16")
    attention = engine_attention(engine, attention)[0]
    graph = profile(spec, default_seq(spec, DEFAULT_SEQ) if seq is None else seq, batch=1, dtype=dtype,
                    attention=attention, moe_imbalance=moe_imbalance, moe_capacity_factor=moe_capacity_factor,
                    moe_pad_to_capacity=moe_pad_to_capacity, moe_dispatcher=moe_dispatcher,
                    mtp_num_layers=mtp_num_layers, engine=engine)
    check_model_fit(graph, config)
    return predict(graph, cluster, config)



def predict(graph, cluster: ClusterProfile, config: ParallelConfig, chunk_of_layer=None,
            recompute_of_layer=None) -> Prediction:
    """The simulator's step (no timeline) of `config` on `graph`: None for `chunk_of_layer` and
    `recompute_of_layer` is the uniform plan (`costing.uniform`)."""
    return simulate_config(graph, cluster, config, chunk_of_layer=chunk_of_layer,
                           recompute_of_layer=recompute_of_layer, timeline=False)
