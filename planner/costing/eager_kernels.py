"""A block's elementwise kernels under an engine that runs them eagerly, one kernel per op.

The profile's `elementwise_bytes_per_activation_byte` (fitted on runs of fused kernels) prices
every other engine's norms, activations and residual adds from the bytes a block saves. Two
engines run their blocks op by op, and their traffic is counted from their code instead,
forward and backward (`profiling.eager_traffic`):

- torchtitan without torch.compile, its Llama block (`torchtitan_bytes_per_token`, the closed form
  of `eager_traffic.block_bytes`'s count): about 149 and 308 bytes per token and hidden unit for
  Llama 3 8B's shapes, where the fitted rule charges about 87 and 173;
- meshplan's own executor (`meshplan train`), its GPT and Llama blocks on a GPU profile
  (`executor_bytes_per_token`, the closed form of `eager_traffic.executor_block_bytes`'s count): for Llama 3 8B's shapes 146 and 812 (its RMSNorm's statistics and
  backward and SwiGLU's backward run in fp32, op by op), for a GPT block 36 and 78. A CPU profile
  keeps its calibrated factor: `meshplan calibrate` fits it on the executor's own GPT block on
  that CPU, whose elementwise ops are not the bandwidth-bound kernels a GPU runs;
- llm-foundry (Composer, no torch.compile), its MPT block (`gpt` family) on a GPU profile
  (`foundry_bytes_per_token`, the closed form of `eager_traffic.foundry_block_bytes`'s count): two
  bf16 LayerNorms, exact GELU, two residual adds and the bias gradients, 36 and 78 bytes per token
  and hidden unit, where the fitted rule charges about 81 and 162 (under fp8 its Linears are
  Transformer Engine's, which take the bias gradients inside their casts: 78 less 10 h + 2 f).

`compute_time.compute_times_s` reads it for the blocks `counts_eager_kernels` names. The counts
are the code's, written in closed form so that pricing imports no torch; nothing is fitted.
"""
from __future__ import annotations

from meshplan.planner.contracts.cluster import ClusterProfile
from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.contracts.engine_rules import runs_compiled
from meshplan.planner.contracts.graph import LayerProfile, ModelInfo
from meshplan.planner.costing import gemm
from meshplan.planner.costing.device_time import infer_seq
from meshplan.planner.costing.tp_split import is_split

# Engines whose Llama blocks run eagerly unless the configuration compiles them
# (`engine_rules.runs_compiled`): torchtitan's `training.compile` / `[compile] enable` is off by default.
EAGER_ENGINES = ("torchtitan",)
# llm-foundry's MPT blocks (the zoo's `gpt` family: LayerNorm, biases, GELU), always eager.
FOUNDRY_ENGINE, FOUNDRY_FAMILY = "llm-foundry", "gpt"
# meshplan's executor: the zoo's GPT and Llama blocks (`models.transformer.Block`), always eager, counted
# where their elementwise kernels run in bf16 (under fp8 only the Linears change, their casts priced by `fp8`).
EXECUTOR_ENGINE, EXECUTOR_FAMILIES, BF16_BLOCKS = "meshplan", ("gpt", "llama"), ("bf16-mixed", "fp8")


def counts_eager_kernels(layer: LayerProfile, config: ParallelConfig, info: ModelInfo, profile_dtype: str,
                         cluster: ClusterProfile | None = None) -> bool:
    """Whether `layer` is a dense block an eager engine runs op by op: under torchtitan (not
    compiled) a Llama block, under meshplan's executor on a GPU profile (`cluster` with SMs) a GPT
    or Llama block of the zoo, under llm-foundry on a GPU profile a GPT (MPT) block, each in
    bf16-mixed or fp8 (fp32 keeps the rule); the block's Linears
    known by shape, no routed experts, an even head dimension (which the rotary embedding pairs)."""
    if layer.kind != "block" or layer.expert_params or info.attention_head_dim % 2:
        return False
    on_gpu = cluster is not None and cluster.device.num_sms > 0 and config.precision in BF16_BLOCKS
    if config.engine in EAGER_ENGINES:
        eager = not runs_compiled(config) and info.family == "llama"
    elif config.engine == FOUNDRY_ENGINE:
        eager = on_gpu and info.family == FOUNDRY_FAMILY
    else:
        eager = config.engine == EXECUTOR_ENGINE and info.family in EXECUTOR_FAMILIES and on_gpu
    return eager and bool(gemm.block_linear_shapes(layer, info, infer_seq(layer, info, profile_dtype)))


def eager_bytes(layer: LayerProfile, config: ParallelConfig, info: ModelInfo, profile_dtype: str) -> tuple[float, float]:
    """(forward, backward) bytes one micro-batch's eager elementwise kernels move on one rank: the
    counted bytes per token times the rank's tokens, split over TP (sequence parallelism shards the
    norms and residual adds, TP the heads and the MLP's width)."""
    shard = config.tp if is_split(layer, config.tp) else 1
    tokens = config.rank_microbatch * infer_seq(layer, info, profile_dtype)
    ffn = info.ffn or layer.tp_split.mlp_width
    if config.engine in EAGER_ENGINES:  # torchtitan: TP always with sequence parallelism
        fwd, bwd = torchtitan_bytes_per_token(info, ffn)
        return fwd * tokens / shard, bwd * tokens / shard
    if config.engine == FOUNDRY_ENGINE:
        fwd, fwd_stream, bwd, bwd_stream = foundry_bytes_per_token(info, ffn, config.precision == "fp8")
    else:
        fwd, fwd_stream, bwd, bwd_stream = executor_bytes_per_token(info, ffn, *_llama_options(layer, info),
                                                                     rebuilds_norms=config.recompute != "full")
    stream_shard = shard if config.sp else 1  # the residual stream is whole on every TP rank without SP
    return (tokens * ((fwd - fwd_stream) / shard + fwd_stream / stream_shard),
            tokens * ((bwd - bwd_stream) / shard + bwd_stream / stream_shard))


# torchtitan's 2024 Llama block per token, bf16, counted as `eager_traffic.block_bytes` traces it (its
# tests count it by hand and hold this closed form to the trace): bytes per unit of (h, H d, kv d, f, d, 1);
# (forward, backward). Forward: two fp32 RMSNorms (36 h + 24 each), the complex rotary embedding of q and
# k (20 H d + 20 kv d + 8 d), two residual adds (12 h), SwiGLU (10 f). Backward: the norms' (92 h + 40
# each), five residual-stream gradient sums (30 h), the rotary embedding's (20 H d + 20 kv d + 40 d),
# SwiGLU's (18 f). Grouped-query attention adds repeat_kv's copies forward and their sums backward,
# 4 (H d + kv d) each way.
_TORCHTITAN_LLAMA = ((84, 20, 20, 10, 8, 48), (214, 20, 20, 18, 40, 80))
_TORCHTITAN_REPEAT_KV = ((0, 4, 4, 0, 0, 0), (0, 4, 4, 0, 0, 0))


def torchtitan_bytes_per_token(info: ModelInfo, ffn: int) -> tuple[float, float]:
    """(forward, backward) bytes per token torchtitan's eager Llama block moves in its elementwise
    kernels, unsharded (the table above)."""
    heads, kv = info.num_heads, info.num_kv_heads or info.num_heads
    tables = [_TORCHTITAN_LLAMA] + [_TORCHTITAN_REPEAT_KV] * (heads != kv)
    return _per_token(tables, _units(info, ffn)[:5] + (1,))


# meshplan's executor block per token, bf16, counted as `eager_traffic.executor_block_bytes` traces it
# (`tests/planner/costing/test_eager_kernels.py` holds the closed form to the trace): bytes per unit of
# (h, H d, kv d, f, d, H, kv, 1) for h hidden, H query heads and kv K/V heads of d, f the MLP's width;
# (forward, forward on the residual stream, backward, backward on the residual stream).
#   residual stream, Llama: two op-by-op RMSNorms (x.float(), pow, mean, rsqrt, two multiplies, type_as,
#   the weight) and two residual adds, 84 h + 16 forward; their fp32 backwards, the norm outputs
#   rebuilt (`normed_call`) and the input gradients' sums, 326 h + 48 backward. GPT: LayerNorm 20 h + 16
#   and 46 h + 16.
#   TP region, Llama: RoPE's tables and rotations of q and k (22 H d + 18 kv d + 24 d), SwiGLU's
#   silu and product (10 f), forward; backward SwiGLU's fp32 recomputation of silu and its product
#   rule (126 f) and RoPE's (36 H d + 32 kv d + 8 d). Qwen's per-head q and k RMSNorms add 36 (H + kv) d
#   + 24 (H + kv) forward and 112 (H + kv) d + 16 (H + kv) backward, biases on q, k, v their gradients'
#   sums, 2 H d + 4 kv d. GPT: GELU 4 f forward (f = 4 h: 16 h), 8 f backward.
_EXECUTOR_LLAMA = ((84, 22, 18, 10, 24, 0, 0, 72), (84, 0, 0, 0, 0, 0, 0, 16),
                   (326, 36, 32, 126, 8, 0, 0, 80), (326, 0, 0, 0, 0, 0, 0, 48))
_EXECUTOR_QK_NORM = ((0, 36, 36, 0, 0, 24, 24, 0), (0,) * 8, (0, 112, 112, 0, 0, 16, 16, 0), (0,) * 8)
_EXECUTOR_QKV_BIAS = ((0,) * 8, (0,) * 8, (0, 2, 4, 0, 0, 0, 0, 0), (0,) * 8)
# The Llama block's two norm outputs rebuilt in backward (`normed_call`; two RMSNorm forwards: 72 h + 16
# on the residual stream, and their per-token statistics' 32, which the trace tells apart by width):
# not under full recomputation, whose rerun forward keeps them. (total, residual stream)
_EXECUTOR_LLAMA_REBUILD = ((72, 0, 0, 0, 0, 0, 0, 48), (72, 0, 0, 0, 0, 0, 0, 16))
_EXECUTOR_GPT = ((20, 0, 0, 4, 0, 0, 0, 16), (20, 0, 0, 0, 0, 0, 0, 16),
                 (46, 0, 0, 8, 0, 0, 0, 16), (46, 0, 0, 0, 0, 0, 0, 16))


# llm-foundry's MPT block per token, bf16, counted as `eager_traffic.foundry_block_bytes` traces it (its
# test holds this closed form to the trace), in `_EXECUTOR_GPT`'s units and rows. Forward: two bf16
# LayerNorms (4 h + 8 each), two residual adds (6 h each), GELU (4 f). Backward: the LayerNorms' (their
# input gradients, and the weight and bias gradients' partial sums), the residual stream's gradient sums,
# q, k and v's gradients joined for Wqkv (the split's backward), GELU's and the four bias gradients.
_FOUNDRY_MPT = ((20, 0, 0, 4, 0, 0, 0, 16), (20, 0, 0, 0, 0, 0, 0, 16),
                (46, 0, 0, 8, 0, 0, 0, 16), (28, 0, 0, 0, 0, 0, 0, 16))
# Under fp8 its Linears are Transformer Engine's (`fc_type: te`), whose backward takes each bias
# gradient inside the output gradient's fp8 cast (`fp8.cast_times_s` prices that read): the four sums
# come off (Wqkv 6 h, out_proj 2 h, up_proj 2 f, down_proj 2 h; out_proj's and down_proj's h wide).
_FOUNDRY_TE_BIAS_GRADS = ((0,) * 8, (0,) * 8, (-10, 0, 0, -2, 0, 0, 0, 0), (-4, 0, 0, 0, 0, 0, 0, 0))


def foundry_bytes_per_token(info: ModelInfo, ffn: int, te_linears: bool = False) -> tuple[float, float, float, float]:
    """(forward, forward on the residual stream, backward, backward on the residual stream) bytes
    per token llm-foundry's eager MPT block moves in its elementwise kernels, unsharded (the tables
    above); `te_linears` (its fp8 runs) without the bias gradients' sums."""
    return _per_token([_FOUNDRY_MPT] + [_FOUNDRY_TE_BIAS_GRADS] * te_linears, _units(info, ffn))


def executor_bytes_per_token(info: ModelInfo, ffn: int, qk_norm: bool = False, qkv_bias: bool = False,
                             rebuilds_norms: bool = True) -> tuple[float, float, float, float]:
    """(forward, forward on the residual stream, backward, backward on the residual stream) bytes
    per token that meshplan's executor block moves in its elementwise kernels, unsharded (the table
    above; exact for K/V heads >= 2, within 4 d backward for a single one). `rebuilds_norms`: false
    under full recomputation, which keeps the Llama norms' outputs its rerun forward made."""
    units = _units(info, ffn)
    tables = [_EXECUTOR_GPT] if info.family == "gpt" else (
        [_EXECUTOR_LLAMA] + [_EXECUTOR_QK_NORM] * qk_norm + [_EXECUTOR_QKV_BIAS] * qkv_bias)
    fwd, fwd_stream, bwd, bwd_stream = _per_token(tables, units)
    if info.family != "gpt" and not rebuilds_norms:
        total, stream = _per_token([_EXECUTOR_LLAMA_REBUILD], units)
        bwd, bwd_stream = bwd - total, bwd_stream - stream
    return fwd, fwd_stream, bwd, bwd_stream


def _units(info: ModelInfo, ffn: int) -> tuple[int, ...]:
    """(h, H d, kv d, f, d, H, kv, 1): what the tables' coefficients multiply."""
    d = info.attention_head_dim
    heads, kv = info.num_heads, info.num_kv_heads or info.num_heads
    return info.hidden, heads * d, kv * d, ffn, d, heads, kv, 1


def _per_token(tables, units) -> tuple[float, ...]:
    """Each row of the tables (summed table by table) dotted with `units`."""
    return tuple(float(sum(sum(c * u for c, u in zip(table[row], units)) for table in tables))
                 for row in range(len(tables[0])))


def _llama_options(layer: LayerProfile, info: ModelInfo) -> tuple[bool, bool]:
    """(qk_norm, qkv_bias) of a zoo Llama block, read off its parameter count: Qwen's per-head q and
    k norms add 2 head_dim weights, biases on q, k and v their widths (the profile counts every
    parameter; `ModelInfo` names neither)."""
    if info.family == "gpt":
        return False, False
    d, heads, kv = info.attention_head_dim, info.num_heads, info.num_kv_heads or info.num_heads
    base = (2 * heads * d + 2 * kv * d) * info.hidden + 3 * info.hidden * info.ffn + 2 * info.hidden
    extra = layer.num_params - base
    bias = (heads + 2 * kv) * d
    return extra in (2 * d, 2 * d + bias), extra in (bias, 2 * d + bias)
