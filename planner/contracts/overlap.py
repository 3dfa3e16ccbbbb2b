"""What each training engine overlaps with compute: one `EngineOverlap` per `--engine`, as data.

The cost model's rule functions read it (`costing.overlap`, `costing.context_parallel`,
`costing.state_memory.grad_sync_mode`), so the event simulator and the ILP price one engine's
overlap alike; `estimate` prints which one it assumed and `--json` records it (`overlap`).

Each engine is taken at a named version with the settings its documentation recommends for
performance (Megatron) or its defaults (torchtitan, DeepSpeed); every field cites its source.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from meshplan.planner.contracts.config import ENGINES

# How the K/V of a context-parallel group travel (`costing.context_parallel`):
# - "all_gather": one blocking all-gather of K/V before attention, a reduce-scatter of their
#   gradients after it (meshplan's executor, `executor.parallel.context`);
# - "ring_p2p": cp ring steps; each step sends the rank's K/V (K/V heads only) to the next rank
#   while the attention of the chunk in hand runs, so a step exposes only what its transfer takes
#   beyond that attention; dK/dV travel back the same way (Transformer Engine, cp_comm_type "p2p");
# - "torch_ring": torch's context_parallel ring attention with its default all-gather rotation:
#   K/V (at the query heads: torchtitan's Llama repeats K/V before SDPA) all-gathered once behind
#   the first step's attention, each step's output merged in fp32, dK/dV rotated back in fp32
#   behind the next step's attention, the last rotation exposed.
CP_EXCHANGES = ("all_gather", "ring_p2p", "torch_ring")

# When the data-parallel ranks gather ZeRO-1/2 parameters (`costing.communication.dp_comm_s`):
# - "fsdp": FSDP2's resharding: before every micro-batch's forward without pipelining (it reshards
#   after each backward), once per step under pipelining, after the optimizer (blocking);
# - "first_forward": FSDP2 kept gathered between a step's micro-batches (resharded after the last
#   backward alone, `set_reshard_after_backward`): once per step, unit by unit during the step's
#   first forward, each unit's gather prefetched while the unit before it computes;
# - "next_forward": Megatron's distributed optimizer with --overlap-param-gather: once per step,
#   bucket by bucket during the next step's first forward, each bucket's gather issued when the
#   layers before it start (`costing.overlap.exposed_step_gather_s`).
PARAM_GATHERS = ("fsdp", "first_forward", "next_forward")
# When a pipelined rank reduces its ZeRO-0/1 gradients (`costing.state_memory.grad_sync_mode`):
# - "after_chunk": a chunk's whole reduction after its last backward, blocking the rank (torch
#   pipelining's `perform_reduce_grad`);
# - "during_last_backward": in buckets launched as the last micro-batch's backward of each chunk
#   fills them, beside compute (Megatron's --overlap-grad-reduce under every schedule).
PP_GRAD_REDUCES = ("after_chunk", "during_last_backward")
# How an engine's TP overlap pipelines the sequence-parallel collectives with their GEMMs
# (`costing.overlap.unpipelined_tp_comm_s`):
# - "userbuffers": Transformer Engine's userbuffers overlap every all-gather and reduce-scatter of
#   a block's Linears, forward and backward;
# - "micro_pipeline": torch's async TP (Inductor's micro_pipeline_tp pass,
#   torch/_inductor/fx_passes/micro_pipeline_tp.py) fuses an all-gather only into the matmuls
#   that consume the gathered tensor directly and a reduce-scatter only with the matmul that
#   produces it; any op between (a cast after the gather, a sum of input gradients or a rescale
#   before the scatter) leaves the collective blocking.
TP_OVERLAP_PATTERNS = ("userbuffers", "micro_pipeline")


@dataclass(frozen=True)
class EngineOverlap:
    """One engine's communication/computation overlap.

    `tp_comm_overlap`: the sequence-parallel all-gathers and reduce-scatters pipelined with the
    GEMMs they feed (Transformer Engine userbuffers, `--tp-comm-overlap`; torchtitan async TP):
    the GEMM is cut into tp pieces, each piece's transfer hidden behind the previous piece's
    product, so one piece (1/tp of the collective), or whatever the GEMMs cannot cover, stays exposed.
    `tp_overlap_pattern`: which of them it can pipeline, one of `TP_OVERLAP_PATTERNS`.
    `tp_backward_beside_gemms`: without that overlap, a column Linear's backward still runs its two
    collectives beside its own GEMMs: the kept shard's all-gather beside the input gradient, the input
    gradient's reduce-scatter (all-reduce without SP) beside the weight gradient (`costing.tp_backward`).
    `grad_overlap_min_zero`: the lowest ZeRO stage whose gradient reduction runs in buckets during
    the backward (0: always; 3: only ZeRO-3); below it the reduction waits for the backward to end.
    `param_gather_prefetch`: ZeRO/FSDP parameter all-gathers issued one unit ahead of the compute
    that needs them. `pp_p2p_async`: pipeline sends and receives run beside compute.
    `cp_exchange`: one of `CP_EXCHANGES`. `ep_a2a_hidden_fraction`: the share of the expert-parallel
    all-to-alls hidden behind other compute, in [0, 1]. `param_gather`: one of `PARAM_GATHERS`;
    `pp_grad_reduce`: one of `PP_GRAD_REDUCES`. `ep_a2a_paired`: Megatron-Core's combined 1F1B
    (`ParallelConfig.moe_a2a_overlap`), which hides what `costing.moe_overlap` derives instead.
    """

    engine: str
    version: str
    tp_comm_overlap: bool
    grad_overlap_min_zero: int
    param_gather_prefetch: bool
    pp_p2p_async: bool
    cp_exchange: str
    ep_a2a_hidden_fraction: float
    param_gather: str
    pp_grad_reduce: str
    sources: tuple[str, ...]
    ep_a2a_paired: bool = False
    tp_overlap_pattern: str = "userbuffers"
    tp_backward_beside_gemms: bool = False

    def __post_init__(self):
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.tp_overlap_pattern not in TP_OVERLAP_PATTERNS:
            raise ValueError(f"{self.engine}: tp_overlap_pattern must be one of {', '.join(TP_OVERLAP_PATTERNS)}, "
                             f"got {self.tp_overlap_pattern!r}")
        if self.cp_exchange not in CP_EXCHANGES:
            raise ValueError(f"cp_exchange must be one of {', '.join(CP_EXCHANGES)}, got {self.cp_exchange!r}")
        if self.grad_overlap_min_zero not in (0, 1, 2, 3, 4):
            raise ValueError(f"grad_overlap_min_zero must be a ZeRO stage 0-3 or 4 (never), "
                             f"got {self.grad_overlap_min_zero}")
        if self.param_gather not in PARAM_GATHERS:
            raise ValueError(f"param_gather must be one of {', '.join(PARAM_GATHERS)}, got {self.param_gather!r}")
        if self.pp_grad_reduce not in PP_GRAD_REDUCES:
            raise ValueError(f"pp_grad_reduce must be one of {', '.join(PP_GRAD_REDUCES)}, got {self.pp_grad_reduce!r}")
        if not 0.0 <= self.ep_a2a_hidden_fraction <= 1.0:
            raise ValueError(f"ep_a2a_hidden_fraction must be in [0, 1], got {self.ep_a2a_hidden_fraction}")
        if not self.version or not self.sources:
            raise ValueError(f"{self.engine}: an engine's overlap names its version and sources")

    def grad_reduce_overlaps(self, zero: int) -> bool:
        """Whether the gradient reduction runs during the backward at ZeRO stage `zero`."""
        return zero >= self.grad_overlap_min_zero

    def summary(self) -> str:
        """One line: what this engine hides behind compute."""
        grads = ("overlapped with the backward" if self.grad_overlap_min_zero == 0 else
                 f"overlapped from ZeRO-{self.grad_overlap_min_zero}, after the backward below")
        grads += (", pipelined during each chunk's last backward" if self.pp_grad_reduce == "during_last_backward"
                  else ", pipelined after each chunk's last backward")
        gather = "prefetched" if self.param_gather_prefetch else "blocking"
        if self.param_gather != "fsdp":
            gather += f", ZeRO-1/2 once per step in the {self.param_gather.replace('_', ' ')}"
        return (f"{self.engine} ({self.version}): TP comm {self._tp_words()}; "
                f"grad reduce {grads}; param gather {gather}; "
                f"PP p2p {'async' if self.pp_p2p_async else 'blocking'}; CP {self.cp_exchange.replace('_', ' ')}; "
                + ("EP all-to-all paired with another micro-batch's compute (combined 1F1B)" if self.ep_a2a_paired
                   else f"EP all-to-all {self.ep_a2a_hidden_fraction:.0%} hidden"))

    def _tp_words(self) -> str:
        if not self.tp_comm_overlap:
            return ("blocking, but for each column Linear's backward all-gather and reduce-scatter, beside its own "
                    "GEMMs" if self.tp_backward_beside_gemms else "blocking")
        if self.tp_overlap_pattern == "micro_pipeline":
            return "micro-pipelined with the GEMMs next to it (async TP)"
        return "pipelined with its GEMMs"

    def to_json(self) -> dict:
        out = asdict(self)
        out["sources"] = list(self.sources)
        return out


MESHPLAN_OVERLAP = EngineOverlap(
    engine="meshplan", version="meshplan's executor (torch FSDP2 / DDP, torch pipelining)",
    tp_comm_overlap=False,           # DTensor collectives block the compute stream (`executor.parallel.tensor`)
    grad_overlap_min_zero=0,         # DDP buckets / FSDP2 per-unit reduce-scatter during the backward
    param_gather_prefetch=True,      # FSDP2 prefetches the next unit's all-gather
    pp_p2p_async=True,               # torch pipelining's batched isend/irecv
    cp_exchange="all_gather",        # `executor.parallel.context`: all_gather_tensor_autograd of K/V
    ep_a2a_hidden_fraction=0.0,      # all_to_all_single on the compute path (`executor.parallel.expert`)
    param_gather="first_forward",    # ZeRO-0/1/2 stay gathered across micro-batches (`executor.runtime`)
    pp_grad_reduce="after_chunk",    # torch pipelining reduces a chunk after its last backward
    sources=("meshplan executor/parallel/{tensor,data,pipeline,context,expert}.py",))

# A stack meshplan has no record of (`contracts.config.ENGINES`): meshplan's executor's overlap,
# field for field, since the runs priced so (Narayanan et al. 2021, Korthikanti et al. 2022, Dubey
# et al. 2024) publish step times, not their stacks' overlap.
GENERIC_OVERLAP = replace(
    MESHPLAN_OVERLAP, engine="generic",
    version="a stack meshplan has no record of, fused kernels, overlapped as meshplan's executor overlaps",
    sources=("meshplan's executor's record (the papers priced under it publish no overlap)",))

ENGINE_OVERLAPS = {overlap.engine: overlap for overlap in (
    MESHPLAN_OVERLAP,
    GENERIC_OVERLAP,
    EngineOverlap(
        engine="megatron", version="Megatron-Core 0.14 with Transformer Engine, as Megatron-Bridge 25.11's "
                                   "performance recipes configure it",
        tp_comm_overlap=True,            # CommOverlapConfig(tp_comm_overlap=True): needs tp >= 2, SP and TE
        tp_backward_beside_gemms=True,   # without it: TE's and Megatron-Core's Linear backwards, async_op=True
        grad_overlap_min_zero=0,         # ddp.overlap_grad_reduce=True: one layer's chunk exposed
        param_gather_prefetch=True,      # ddp.overlap_param_gather=True (distributed optimizer)
        pp_p2p_async=True,               # overlap_p2p_comm with virtual stages, batch_p2p_comm without
        cp_exchange="ring_p2p",          # TransformerConfig.cp_comm_type default "p2p"
        ep_a2a_hidden_fraction=0.0,      # overlap_moe_expert_parallel_comm is off by default
        param_gather="next_forward",     # --overlap-param-gather: once per step, bucket by bucket in the next forward
        pp_grad_reduce="during_last_backward",  # --overlap-grad-reduce: each chunk's buckets in its last backward
        sources=("docs.nvidia.com/nemo/megatron-bridge/latest/training/communication-overlap.html "
                 "(TP, DP, PP and CP overlap; TP overlap gated on tp >= 2, sequence parallelism and TE)",
                 "Megatron-Bridge docs/performance-guide.md; Megatron-Core DistributedDataParallelConfig "
                 "(overlap_grad_reduce, overlap_param_gather)",
                 "Transformer Engine attention.py AttnFuncWithCPAndKVP2P (cp_comm_type='p2p')",
                 "Transformer Engine pytorch/module/layernorm_linear.py, layernorm_mlp.py, linear.py (backward: "
                 "'Tensor-parallel communication is overlapped with dgrad GEMM', the input gradient's "
                 "reduce_scatter_along_first_dim / allreduce with async_op=True before the wgrad GEMM) and "
                 "Megatron-Core tensor_parallel/layers.py LinearWithGradAccumulationAndAsyncCommunication.backward",
                 "Megatron-LM megatron/core/optimizer/distrib_optimizer.py (overlap_param_gather: the first "
                 "bucket's all-gather dispatched after step(), each next one from the forward pre-hook that "
                 "waits on its predecessor) and megatron/core/pipeline_parallel/schedules.py (no_sync for all "
                 "but the last micro-batch; a chunk's grad sync after its last backward), commit f2e5db4 "
                 "(mid-2024); core_v0.14.0's param_and_grad_buffer.py bucket groups (finish_param_sync "
                 "dispatches the next group's gather) keep both")),
    EngineOverlap(
        engine="torchtitan", version="torchtitan 0.2 on torch 2.6-2.9 (job-config defaults)",
        tp_comm_overlap=False,           # parallelism.enable_async_tensor_parallel defaults to false
        grad_overlap_min_zero=0,         # FSDP2 reduce-scatters each unit during the backward
        param_gather_prefetch=True,      # FSDP2 implicit forward/backward prefetch
        pp_p2p_async=True,               # torch.distributed.pipelining's isend/irecv
        cp_exchange="torch_ring",        # parallelism.context_parallel_rotate_method defaults to "allgather"
        ep_a2a_hidden_fraction=0.0,      # all-to-all dispatch on the compute stream
        param_gather="fsdp",             # FSDP2 reshards after every backward (no set_reshard_after_backward)
        pp_grad_reduce="after_chunk",    # torch.distributed.pipelining, as meshplan's executor
        tp_overlap_pattern="micro_pipeline",  # async TP: Inductor's micro-pipelined collective matmuls
        sources=("torchtitan docs/fsdp.md (FSDP2 prefetching); torchtitan config job_config.py "
                 "(enable_async_tensor_parallel=False, context_parallel_rotate_method='allgather')",
                 "torch torch/_inductor/fx_passes/micro_pipeline_tp.py (fuse_all_gather_matmul: the "
                 "gathered tensor's consumer matmuls; fuse_matmul_reduce_scatter: _find_producer_matmul)",
                 "torch torch/distributed/tensor/experimental/_context_parallel/_attention.py "
                 "(_templated_ring_attention, _AllGatherRotater, _SDPAMerger with convert_to_f32)")),
    EngineOverlap(
        engine="deepspeed", version="DeepSpeed 0.16 (ds_config defaults)",
        tp_comm_overlap=False,           # AutoTP all-reduces block the compute stream
        grad_overlap_min_zero=3,         # zero_optimization.overlap_comm: default true for stage 3 only
        param_gather_prefetch=True,      # ZeRO-3 stage3_prefetch_bucket_size
        pp_p2p_async=True,               # the pipeline engine's p2p beside compute
        cp_exchange="all_gather",        # sequence_parallel_size: costed as meshplan's K/V all-gather
        ep_a2a_hidden_fraction=0.0,      # MoE all-to-all on the compute stream
        param_gather="fsdp",             # ZeRO-1/2 gathers priced by FSDP2's resharding rule
        pp_grad_reduce="after_chunk",    # the pipeline engine reduces after the last micro-batch
        sources=("deepspeed.ai/docs/config-json (zero_optimization.overlap_comm: stage 3 default true, "
                 "else false; stage3_prefetch_bucket_size)",
                 "DeepSpeed deepspeed/runtime/zero/config.py (overlap_comm validator)")),
    EngineOverlap(
        engine="llm-foundry", version="llm-foundry 0.x on Composer's FSDP (torch FSDP1), its MPT yamls",
        tp_comm_overlap=False,           # no sequence-parallel TP: FSDP alone in the benchmark yamls
        grad_overlap_min_zero=0,         # FSDP1 reduce-scatters each unit during the backward
        # Composer's backward_prefetch default, BACKWARD_POST, issues the next unit's all-gather from the
        # current unit's post-backward hook, which the CPU runs once it has queued that unit's kernels:
        # ahead of the GPU, with limit_all_gathers holding at most two units gathered, so the gather
        # still runs beside the current unit's backward, one unit ahead as prefetching prices it
        param_gather_prefetch=True,
        pp_p2p_async=True,               # no pipeline parallelism (NO_PIPELINE_ENGINES): never read
        cp_exchange="all_gather",        # no context parallelism: never read
        ep_a2a_hidden_fraction=0.0,      # no expert parallelism: never read
        param_gather="fsdp",             # FULL_SHARD (ZeRO-3): never read at ZeRO 1/2
        pp_grad_reduce="after_chunk",    # no pipeline parallelism: never read
        sources=("llm-foundry scripts/train/yamls/pretrain/mpt-*.yaml (fsdp_config: FULL_SHARD, "
                 "limit_all_gathers, activation_checkpointing)",
                 "Composer composer.utils.FSDPConfig (backward_prefetch='BACKWARD_POST', limit_all_gathers=True "
                 "by default); torch torch/distributed/fsdp/api.py (BackwardPrefetch)")),
)}


def engine_overlap(engine: str) -> EngineOverlap:
    """The named engine's `EngineOverlap`."""
    try:
        return ENGINE_OVERLAPS[engine]
    except KeyError:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}") from None
