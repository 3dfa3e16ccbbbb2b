"""Device time of the work a layer does, and the byte sizes it is counted in: the primitives every
cost rule (`compute_time`, `fp8`, `expert_parallel`, ...) builds on, so none of them needs another."""
from __future__ import annotations

from meshplan.planner.contracts.attention import is_fused
from meshplan.planner.contracts.cluster import ClusterProfile
from meshplan.planner.contracts.graph import LayerProfile, ModelInfo

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# GEMMs in one transformer block beyond its Linears: QK^T and (softmax) x V.
ATTENTION_BMMS_PER_BLOCK = 2


def compute_time_s(flops: float, num_gemms: int, cluster: ClusterProfile, dtype: str, num_launches: int = 1) -> float:
    """Time of `flops` split over `num_gemms` equal GEMMs on one device.

    Achieved throughput per GEMM of f FLOPs: peak * matmul_efficiency * f / (f + f_half): large
    GEMMs approach `matmul_efficiency` of peak, a GEMM of `matmul_half_efficiency_flops` reaches
    half of that. Plus `kernel_overhead_s` per kernel sequence (launch/dispatch).
    """
    device = cluster.device
    overhead_s = device.kernel_overhead_s * num_launches
    if flops <= 0:
        return overhead_s
    per_gemm = flops / max(1, num_gemms)
    efficiency = device.matmul_efficiency * per_gemm / (per_gemm + device.matmul_half_efficiency_flops)
    return flops / (device.peak_flops(dtype) * efficiency) + overhead_s


def causal_skipped_flops(layer: LayerProfile, attention: str) -> float:
    """Forward FLOPs per sample a causal flash kernel skips (the masked half of QK^T and x V);
    its backward skips twice as many. Math attention computes every product."""
    if not is_fused(attention) or not 0 < layer.causal_fwd_flops < layer.fwd_flops:
        return 0.0
    return float(layer.fwd_flops - layer.causal_fwd_flops)


def flash_attention_flops(layer: LayerProfile, attention: str, cluster: ClusterProfile) -> float:
    """Forward FLOPs per sample of a layer's attention core that a flash kernel runs (its causal
    skipping applied), when the device gives the kernels their own efficiency; else 0 (the core
    stays on the GEMM curve with the rest). Math attention is batched GEMMs: 0."""
    if not is_fused(attention) or cluster.device.attention_efficiency <= 0 or not layer.attn_fwd_flops:
        return 0.0
    return float(layer.attn_fwd_flops - causal_skipped_flops(layer, attention))


def attention_time_s(flops: float, cluster: ClusterProfile, dtype: str, efficiency: float = 0.0) -> float:
    """Seconds of `flops` of fused attention at `efficiency` of peak (the kernel's, from
    `attention_kernels.attention_efficiency`; 0: the device's `attention_efficiency`)."""
    if flops <= 0:
        return 0.0
    return flops / (cluster.device.peak_flops(dtype) * (efficiency or cluster.device.attention_efficiency))


def gemm_and_attention_times_s(fwd_flops: float, bwd_flops: float, attention_fwd_flops: float, gemms: int,
                               cluster: ClusterProfile, dtype: str,
                               attention_efficiency: float = 0.0) -> tuple[float, float]:
    """(forward, backward) seconds of matmul work: `gemms` equal GEMMs forward on the efficiency
    curve (twice as many backward, in two launches), except `attention_fwd_flops` of flash
    attention (twice as many backward), which run at `attention_time_s`."""
    attn_bwd = 2.0 * attention_fwd_flops
    fwd_s = compute_time_s(max(0.0, fwd_flops - attention_fwd_flops), gemms, cluster, dtype)
    bwd_s = compute_time_s(max(0.0, bwd_flops - attn_bwd), 2 * gemms, cluster, dtype, num_launches=2)
    return (fwd_s + attention_time_s(attention_fwd_flops, cluster, dtype, attention_efficiency),
            bwd_s + attention_time_s(attn_bwd, cluster, dtype, attention_efficiency))


def memory_time_s(traffic_bytes: float, cluster: ClusterProfile) -> float:
    """Time to stream `traffic_bytes` through device memory at the achieved bandwidth."""
    device = cluster.device
    return traffic_bytes / (device.memory_bw_bytes_per_s * device.memory_efficiency)


def infer_seq(layer: LayerProfile, info: ModelInfo, dtype: str) -> int:
    """Sequence length of a block from its input (batch 1, seq, hidden) in the profile dtype."""
    if not info.hidden:
        return 0
    return round(layer.input_bytes / (info.hidden * DTYPE_BYTES.get(dtype, 2)))
