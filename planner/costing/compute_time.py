"""Compute time of one layer's micro-batch on one rank: GEMMs by shape or on the device's
efficiency curve (fp8 Linears through `planner.costing.fp8`), traced convolutions, the named
attention kernel, the memory-bound kernels, and what recomputation repeats in backward."""
from __future__ import annotations

from meshplan.planner.contracts.attention import is_fused
from meshplan.planner.contracts.cluster import ClusterProfile
from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.contracts.engine_rules import early_stop_of, runs_compiled, wgrad_accumulator_bytes
from meshplan.planner.contracts.graph import LayerProfile, ModelInfo
from meshplan.planner.costing import (attention_kernels, eager_kernels, fp8, gemm, loss_kernels, megatron_activations,
                                      overlap,
                                      torchtitan_sac)
from meshplan.planner.costing.activation_memory import activation_bytes, rebuilt_bytes
from meshplan.planner.costing.device_time import (ATTENTION_BMMS_PER_BLOCK, attention_time_s, causal_skipped_flops,
                                                  compute_time_s, flash_attention_flops, gemm_and_attention_times_s,
                                                  infer_seq, memory_time_s)
from meshplan.planner.costing.precision import COMPUTE_DTYPE
from meshplan.planner.costing.tp_split import is_split


def num_gemms(layer: LayerProfile) -> int:
    if layer.tp_split.kind == "block":
        return len(layer.tp_split.column_linears) + len(layer.tp_split.row_linears) + ATTENTION_BMMS_PER_BLOCK
    return 1


def selective_recompute_flops(layer: LayerProfile, info: ModelInfo, dtype: str) -> float:
    """Forward FLOPs of the attention core (QK^T, softmax x V) per sample: 4 s^2 h (Korthikanti).

    Only math attention stores the scores that selective recomputation drops. A flash kernel
    keeps none, but the executor's policy (`executor.parallel.recompute`) still reruns its
    forward in backward: `compute_times_s` charges that at the kernels' attention efficiency.
    """
    if layer.tp_split.kind != "block" or layer.act_attn_score_bytes == 0:
        return 0.0
    seq = infer_seq(layer, info, dtype)
    return 4.0 * seq * seq * info.hidden


# The `ParallelConfig` fields `compute_times_s` reads (the engine and its loss kernels:
# `loss_kernels`); under fp8 also the recipe's, and the micro-batch count that with the engine sets
# how often an engine casts its weights (`fp8.weight_cast_share`), and whether compilation fuses casts.
COMPUTE_TIME_FIELDS = ("precision", "tp", "sp", "rank_microbatch", "recompute", "attention_query_split", "engine",
                       "cross_entropy_fusion", "recompute_early_stop", "tp_comm_overlap")
FP8_TIME_FIELDS = ("fp8_recipe", "fp8_filter", "num_microbatches")


def compute_time_key(config: ParallelConfig) -> tuple:
    """What `compute_times_s` of one layer depends on in `config`: a memo's key (`layer_cost`)."""
    key = tuple(getattr(config, name) for name in COMPUTE_TIME_FIELDS) + (runs_compiled(config),)
    if not fp8.is_fp8(config.precision):
        return key
    # and, under fp8, the weight casts of a float8 all-gather (over the data ranks it shards across)
    return key + tuple(getattr(config, name) for name in FP8_TIME_FIELDS) + (fp8.gathered_weight_cast_bytes(config),)


def compute_times_s(layer: LayerProfile, config: ParallelConfig, cluster: ClusterProfile, info: ModelInfo,
                    act_scale: float, vocab_scale: float, profile_dtype: str,
                    attention: str = "flash") -> tuple[float, float, float]:
    """(forward, backward, recomputation) seconds of one micro-batch on one rank.

    GEMM time: a dense block's Linears one GEMM at a time by shape (`gemm`), other FLOPs on the
    efficiency curve as `num_gemms` equal GEMMs (backward twice as many); fused attention at the
    named kernel's efficiency (`attention_kernels`); memory-bound time of the non-GEMM kernels from the bytes the layer saves
    (`elementwise_bytes_per_activation_byte`, backward twice), or, for the logits of a loss whose
    kernels the engine's code names, those kernels' own bytes (`loss_kernels`), and for a block an
    engine runs eagerly (torchtitan's Llama, meshplan's executor on a GPU), its kernels' bytes counted
    op by op, the norm outputs it rebuilds in backward included (`eager_kernels`). Full recomputation
    repeats the forward; selective repeats the attention core (QK^T, softmax, x V), or under
    torchtitan its per-op policy's rerun (`torchtitan_sac`).
    """
    dtype = COMPUTE_DTYPE[config.precision]
    shard = config.tp if is_split(layer, config.tp) else 1
    mbs = config.rank_microbatch
    traffic_per_act_byte = cluster.device.elementwise_bytes_per_activation_byte
    saved_bytes, _ = activation_bytes(layer, config, act_scale * vocab_scale, recompute="none")
    if runs_fused_mamba2(layer, config, info):
        saved_bytes = fused_mamba2_saved_bytes(layer, config, info, profile_dtype, attention)
    skipped = causal_skipped_flops(layer, attention)
    fwd_flops = (layer.fwd_flops - skipped) * mbs * vocab_scale / shard
    bwd_flops = (layer.bwd_flops - 2 * skipped) * mbs * vocab_scale / shard
    attention_fwd = flash_attention_flops(layer, attention, cluster) * mbs / shard
    kernel = kernel_efficiency(layer, info, cluster, attention, profile_dtype, config.attention_query_split) if attention_fwd else 0.0
    if fp8.is_fp8(config.precision) and fp8.converts(layer):  # the Linears' GEMMs in fp8, plus casts
        fwd_gemm_s, bwd_gemm_s = _fp8_gemm_times_s(layer, info, cluster, config, fwd_flops, bwd_flops, shard,
                                                   profile_dtype, attention_fwd, kernel)
    else:
        fwd_gemm_s, bwd_gemm_s = _bf16_gemm_times_s(layer, info, cluster, fwd_flops, bwd_flops, mbs, shard,
                                                    profile_dtype, dtype, attention_fwd, kernel, config)
    # Norm outputs rebuilt in backward rather than kept are still written by the forward and read
    # by the backward, as when they were kept (the traffic proxy counts them alike), and the
    # backward writes them once more (`transformer.normed_call`; not under recomputation, which
    # keeps them: `activation_memory.activation_bytes`).
    rebuilt = rebuilt_bytes(layer, config, act_scale)
    saved_bytes += rebuilt
    bwd_extra = rebuilt if config.recompute == "none" else 0.0
    loss_fwd_s = loss_bwd_s = 0.0
    if loss_kernels.counts_loss_kernels(layer, config, cluster):  # the logits' traffic counted kernel by kernel
        saved_bytes -= loss_kernels.logits_saved_bytes(layer, config, act_scale, vocab_scale)
        loss_fwd_s, loss_bwd_s = loss_kernels.loss_times_s(layer, config, cluster, vocab_scale, profile_dtype)
    fwd_bytes, bwd_bytes = traffic_per_act_byte * saved_bytes, traffic_per_act_byte * (2 * saved_bytes + bwd_extra)
    if eager_kernels.counts_eager_kernels(layer, config, info, profile_dtype, cluster):  # counted op by op instead
        fwd_bytes, bwd_bytes = eager_kernels.eager_bytes(layer, config, info, profile_dtype)
    fwd_s = fwd_gemm_s + loss_fwd_s + memory_time_s(fwd_bytes, cluster)
    bwd_s = bwd_gemm_s + loss_bwd_s + memory_time_s(bwd_bytes, cluster)
    if config.recompute == "full":
        return fwd_s, bwd_s, fwd_s - early_stop_skipped_s(layer, config, cluster, info, profile_dtype)
    if config.recompute == "selective":
        core_s = attention_core_recompute_s(layer, config, cluster, info, act_scale, profile_dtype, attention, kernel)
        if torchtitan_sac.applies(config):  # its per-op policy reruns all but the attention and saved GEMMs
            return fwd_s, bwd_s, torchtitan_sac.recompute_s(layer, config, cluster, info, fwd_s, core_s,
                                                            profile_dtype, dtype)
        return fwd_s, bwd_s, core_s
    return fwd_s, bwd_s, 0.0


def runs_fused_mamba2(layer: LayerProfile, config: ParallelConfig, info: ModelInfo) -> bool:
    """Whether the engine runs the layer's Mamba-2 mixer as mamba_ssm's fused kernels (Megatron-Core's
    `MambaMixer`), where the profile traced transformers' torch path (which keeps several more
    tensors per token: unfused conv, gate and fp32 norm intermediates)."""
    return config.engine == "megatron" and layer.tp_split.mixer == "mamba2" and bool(info.mamba_heads)


def fused_mamba2_saved_bytes(layer: LayerProfile, config: ParallelConfig, info: ModelInfo, profile_dtype: str,
                             attention: str) -> float:
    """Bytes a micro-batch of the layer keeps on one rank as Megatron-Core's Mamba-2 layer keeps them
    (`megatron_activations.block_terms`): the memory-bound kernels' traffic follows them."""
    seq = infer_seq(layer, info, profile_dtype)
    per_token = sum(term.bytes_per_token for term in megatron_activations.block_terms(layer, config, info, attention,
                                                                                       seq))
    return per_token * seq * config.rank_microbatch


def early_stops(config: ParallelConfig, recompute: str | None = None) -> bool:
    """Whether full recomputation (the configuration's, or a layer's `recompute`) runs under torch's
    early stop: the configuration's `recompute_early_stop`, or where it leaves it to the engine, an
    engine in `engine_rules.EARLY_STOP_RECOMPUTE_ENGINES`; bf16 Linears only (fp8 ones are custom
    autograd functions, which save their inputs only after their forward has run)."""
    return ((recompute or config.recompute) == "full" and not fp8.is_fp8(config.precision)
            and early_stop_of(config))


def early_stop_last_linear(layer: LayerProfile, config: ParallelConfig, info: ModelInfo,
                           profile_dtype: str, recompute: str | None = None) -> tuple[int, int, bool] | None:
    """The (in, out, column) Linear a full recomputation does not rerun under torch's early stop
    (`early_stops`): a dense block's last Linear, the MLP's down projection, whose input is the last
    tensor the block saves. None where the rule does not apply: `early_stops` false, layers whose
    Linears are not known by shape, a block with routed experts (its last op is the experts' combine)."""
    if not early_stops(config, recompute) or layer.expert_params:
        return None
    shapes = gemm.block_linear_shapes(layer, info, infer_seq(layer, info, profile_dtype))
    return shapes[-1] if shapes else None


def early_stop_skipped_s(layer: LayerProfile, config: ParallelConfig, cluster: ClusterProfile, info: ModelInfo,
                         profile_dtype: str) -> float:
    """Seconds of one micro-batch's forward on one rank that full recomputation leaves out under
    torch's early stop: the last Linear's GEMM (`early_stop_last_linear`), 0 where it does not apply."""
    last = early_stop_last_linear(layer, config, info, profile_dtype)
    if last is None:
        return 0.0
    tokens = config.rank_microbatch * infer_seq(layer, info, profile_dtype)
    shard = config.tp if is_split(layer, config.tp) else 1
    return gemm.linear_times_s((last,), tokens, shard, cluster, COMPUTE_DTYPE[config.precision])[0]


def attention_core_recompute_s(layer: LayerProfile, config: ParallelConfig, cluster: ClusterProfile,
                               info: ModelInfo, act_scale: float, profile_dtype: str, attention: str,
                               kernel: float = 0.0) -> float:
    """Seconds the attention core's forward (QK^T, softmax, x V) takes again in backward, one
    micro-batch on one rank: selective recomputation's default (Megatron-Core's `core_attn`
    module). Math attention recomputes its scores; a flash kernel keeps none, but Megatron-Core's
    `core_attn` checkpoint and the executor's policy (`executor.parallel.recompute`) still rerun
    its forward, at the kernel's efficiency (`kernel`: `kernel_efficiency`'s)."""
    dtype = COMPUTE_DTYPE[config.precision]
    shard = config.tp if is_split(layer, config.tp) else 1
    mbs = config.rank_microbatch
    flops = selective_recompute_flops(layer, info, profile_dtype) * mbs / shard
    if flops:
        score_bytes = layer.act_attn_score_bytes * mbs * act_scale / shard
        return (compute_time_s(flops, ATTENTION_BMMS_PER_BLOCK, cluster, dtype)
                + memory_time_s(cluster.device.elementwise_bytes_per_activation_byte * score_bytes, cluster))
    if not (is_fused(attention) and layer.attn_fwd_flops):
        return 0.0
    attention_fwd = flash_attention_flops(layer, attention, cluster) * mbs / shard
    if attention_fwd:
        return attention_time_s(attention_fwd, cluster, dtype,
                                kernel or kernel_efficiency(layer, info, cluster, attention, profile_dtype,
                                                            config.attention_query_split))
    core = (layer.attn_fwd_flops - causal_skipped_flops(layer, attention)) * mbs / shard
    return compute_time_s(core, ATTENTION_BMMS_PER_BLOCK, cluster, dtype)


def kernel_efficiency(layer: LayerProfile, info: ModelInfo, cluster: ClusterProfile, attention: str,
                      profile_dtype: str, cp: int = 1) -> float:
    """The fused attention kernel's fraction of peak at this block's head width and the queries one
    call takes: the sequence, or under context parallelism the rank's s/cp of it (`cp`: the
    config's `attention_query_split`; Ulysses attends over the whole sequence)."""
    head_dim = info.attention_head_dim
    return attention_kernels.attention_efficiency(attention, cluster, infer_seq(layer, info, profile_dtype) // cp,
                                                  head_dim)


def _fp8_gemm_times_s(layer: LayerProfile, info: ModelInfo, cluster: ClusterProfile, config: ParallelConfig,
                      fwd_flops: float, bwd_flops: float, shard: int, profile_dtype: str, attention_fwd: float,
                      kernel: float) -> tuple[float, float]:
    """`fp8.gemm_times_s`, its Linears in row chunks where torch's micro-pipelined TP fuses them
    with their collectives, plus the sums after its fused reduce-scatters (`overlap`)."""
    seq = infer_seq(layer, info, profile_dtype)
    shapes = gemm.block_linear_shapes(layer, info, seq)
    pieces = overlap.micro_pipeline_pieces(layer, config, shapes)
    fwd_s, bwd_s = fp8.gemm_times_s(layer, info, cluster, config, fwd_flops, bwd_flops, shard, profile_dtype,
                                    attention_fwd, kernel, pieces)
    if not pieces:
        return fwd_s, bwd_s
    tokens = config.rank_microbatch * seq
    reduce_fwd_s, reduce_bwd_s = overlap.micro_pipeline_reduce_s(layer, config, shapes, tokens, cluster)
    return fwd_s + reduce_fwd_s, bwd_s + reduce_bwd_s


def _bf16_gemm_times_s(layer: LayerProfile, info: ModelInfo, cluster: ClusterProfile, fwd_flops: float,
                       bwd_flops: float, mbs: float, shard: int, profile_dtype: str, dtype: str,
                       attention_fwd: float, kernel: float, config: ParallelConfig | None = None) -> tuple[float, float]:
    """(forward, backward) matmul seconds of one micro-batch: a dense block's Linears one GEMM at
    a time by shape (`gemm.linear_times_s`; in row chunks where torch's micro-pipelined TP fuses
    them with their collectives, plus the sums after its fused reduce-scatters,
    `overlap.micro_pipeline_pieces`), the rest (attention's products, a layer whose shapes are
    unknown) as `gemms` equal GEMMs on the size curve (`matmul_times_s`)."""
    seq = infer_seq(layer, info, profile_dtype)
    shapes = gemm.block_linear_shapes(layer, info, seq)
    if not shapes:
        return matmul_times_s(layer, fwd_flops, bwd_flops, mbs / shard, num_gemms(layer), cluster, dtype,
                              attention_fwd, kernel)
    tokens = mbs * seq
    linear_fwd = gemm.linear_flops(shapes, tokens, shard)
    pieces = overlap.micro_pipeline_pieces(layer, config, shapes) if config is not None else None
    linear_fwd_s, linear_bwd_s = gemm.linear_times_s(shapes, tokens, shard, cluster, dtype, pieces=pieces,
                                                      wgrad_accumulate_bytes=wgrad_accumulator_bytes(config))
    if pieces:
        reduce_fwd_s, reduce_bwd_s = overlap.micro_pipeline_reduce_s(layer, config, shapes, tokens, cluster)
        linear_fwd_s, linear_bwd_s = linear_fwd_s + reduce_fwd_s, linear_bwd_s + reduce_bwd_s
    rest_fwd_s, rest_bwd_s = matmul_times_s(layer, max(0.0, fwd_flops - linear_fwd),
                                            max(0.0, bwd_flops - 2 * linear_fwd), mbs / shard,
                                            ATTENTION_BMMS_PER_BLOCK, cluster, dtype, attention_fwd, kernel)
    return linear_fwd_s + rest_fwd_s, linear_bwd_s + rest_bwd_s


def matmul_times_s(layer: LayerProfile, fwd_flops: float, bwd_flops: float, scale: float, gemms: int,
                   cluster: ClusterProfile, dtype: str, attention_fwd_flops: float = 0.0,
                   attention_efficiency: float = 0.0) -> tuple[float, float]:
    """(forward, backward) seconds of a layer's matmul work: GEMMs on the efficiency curve, a
    traced layer's convolutions (`conv_fwd_flops`, `conv_bwd_flops`) at `conv_efficiency` of it,
    and `attention_fwd_flops` of flash attention (twice as many backward) at `attention_time_s`."""
    conv_fwd, conv_bwd = layer.conv_fwd_flops * scale, layer.conv_bwd_flops * scale
    fwd_s, bwd_s = gemm_and_attention_times_s(fwd_flops - conv_fwd, bwd_flops - conv_bwd, attention_fwd_flops,
                                              gemms, cluster, dtype, attention_efficiency)
    if conv_fwd or conv_bwd:
        efficiency = cluster.device.conv_efficiency
        fwd_s += compute_time_s(conv_fwd, gemms, cluster, dtype, num_launches=0) / efficiency
        bwd_s += compute_time_s(conv_bwd, 2 * gemms, cluster, dtype, num_launches=0) / efficiency
    return fwd_s, bwd_s

