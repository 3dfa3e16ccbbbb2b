"""A block's elementwise kernels under an engine that runs them eagerly, one kernel per op.

The profile's `elementwise_bytes_per_activation_byte` (fitted on runs of fused kernels) prices
every other engine's norms, activations and residual adds from the bytes a block saves. torchtitan
without torch.compile runs its Llama block op by op, and its traffic is counted from that code
instead (`profiling.eager_traffic.block_bytes`), forward and backward: about 149 and 308 bytes per
token and hidden unit for Llama 3 8B's shapes, where the fitted rule charges about 87 and 173.
`compute_time.compute_times_s` reads it for the blocks `counts_eager_kernels` names.
"""
from __future__ import annotations

from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.contracts.engine_rules import runs_compiled
from meshplan.planner.contracts.graph import LayerProfile, ModelInfo
from meshplan.planner.costing import gemm
from meshplan.planner.costing.device_time import infer_seq
from meshplan.planner.costing.tp_split import is_split

# Engines whose Llama blocks run eagerly unless the configuration compiles them
# (`engine_rules.runs_compiled`): torchtitan's `training.compile` / `[compile] enable` is off by default.
EAGER_ENGINES = ("torchtitan",)


def counts_eager_kernels(layer: LayerProfile, config: ParallelConfig, info: ModelInfo, profile_dtype: str) -> bool:
    """Whether `layer` is a dense Llama block an eager engine runs op by op: the engine in
    `EAGER_ENGINES`, not compiled, and the block's Linears known by shape (no routed experts; an
    even head dimension, which the rotary embedding pairs)."""
    return (config.engine in EAGER_ENGINES and not runs_compiled(config) and info.family == "llama"
            and layer.kind == "block" and not layer.expert_params and info.attention_head_dim % 2 == 0
            and bool(gemm.block_linear_shapes(layer, info, infer_seq(layer, info, profile_dtype))))


def eager_bytes(layer: LayerProfile, config: ParallelConfig, info: ModelInfo, profile_dtype: str) -> tuple[float, float]:
    """(forward, backward) bytes one micro-batch's eager elementwise kernels move on one rank: the
    counted bytes per token times the rank's tokens, split over TP (sequence parallelism shards the
    norms and residual adds, TP the heads and the MLP's width)."""
    from meshplan.planner.profiling.eager_traffic import block_bytes  # traces with torch: only when priced

    shard = config.tp if is_split(layer, config.tp) else 1
    tokens = config.rank_microbatch * infer_seq(layer, info, profile_dtype) / shard
    fwd, bwd = block_bytes(info.hidden, info.num_heads, info.num_kv_heads or info.num_heads, info.attention_head_dim,
                           info.ffn or layer.tp_split.mlp_width)
    return fwd * tokens, bwd * tokens
