"""Megatron-Core's combined 1F1B (`--overlap-moe-expert-parallel-comm`): how much of a MoE block's
dispatch and combine all-to-alls it hides, from its schedule, with no fitted constant.

The schedule (Megatron-LM docs/user-guide/features/moe_a2a_overlap.md; its code,
megatron/core/pipeline_parallel/combined_1f1b.py and schedules.py) pairs the forward of micro-batch
i+1 with the backward of micro-batch i, layer by layer, and issues each paired layer's work on two
streams in this order::

    compute:  F.attn            B.expert          F.expert          B.attn
    comm:     B.combine   F.dispatch    B.dispatch       F.combine

(`attn`: attention, the norms, the router and the dispatch's local preprocessing; `expert`: the
routed experts), each node waiting for the one before it in its micro-batch's chain
(attn -> dispatch -> experts -> combine) and for the node before it on its own stream.
`paired_layer_s` is that graph's critical path. The first forward and the last backward of a
rank run alone (fill and drain), and so do the interleaved schedule's warm-up forwards and their
cool-down backwards: Megatron-Core's warm-up is (p - r - 1) * 2 + (v - 1) * p micro-batch chunks
on pipeline rank r (at most all m v of them), plus the one the overlap adds (`warmup_passes`);
with p > 1 the schedule needs v > 1 (`ParallelConfig` refuses it otherwise).

`hidden_a2a_share` is what `expert_parallel.ep_comm_s` takes as `a2a_overlap`: the share of the
all-to-alls off the compute stream, averaged over a rank's passes and over the pipeline ranks.
Dispatch and combine move the same tokens, so each is half of a pass's all-to-all time. Compute
that runs beside the transfers runs slower (`compute_slowdown`): a dispatcher that holds SMs of
its own (DeepEP's normal kernels: Megatron-Core's `moe_deepep_num_sms`, 20 by default) leaves the
compute the other SMs, so it takes SMs / (SMs - k) times as long (`COMM_SMS`); NCCL's all-to-all,
whose CTA count follows the topology NCCL detects, is charged the measured mean instead: compute
beside a collective ran 18.9% slower on average than alone (Lee et al. 2025, "Characterizing
Compute-Communication Overlap in GPU-Accelerated Distributed Deep Learning", arXiv:2507.03114:
GPT and LLaMA training on 4 A100, H100, MI250 and MI210; `NCCL_COMPUTE_SLOWDOWN`).
"""
from __future__ import annotations

# SMs a dispatcher's kernels hold while they run (Megatron-Core TransformerConfig: moe_deepep_num_sms = 20).
COMM_SMS = {"deepep": 20}
# Compute beside an NCCL collective: 18.9% slower on average than alone (Lee et al. 2025, arXiv:2507.03114).
NCCL_COMPUTE_SLOWDOWN = 0.189


def compute_slowdown(dispatcher: str, num_sms: int) -> float:
    """How much longer compute takes while `dispatcher`'s transfers run beside it, as a fraction
    (0.25: 1.25 times as long): DeepEP's held SMs, k / (SMs - k), or NCCL's measured mean; 0 on a
    device without SMs (no GPU: nothing shares them)."""
    if num_sms <= 0:
        return 0.0
    held = COMM_SMS.get(dispatcher)
    if held is None:
        return NCCL_COMPUTE_SLOWDOWN
    if held >= num_sms:
        raise ValueError(f"the {dispatcher} dispatcher's {held} SMs leave none of the device's {num_sms} for compute")
    return held / (num_sms - held)


def warmup_passes(pp: int, virtual_stages: int, num_microbatches: int, rank: int) -> int:
    """Forward passes rank `rank` runs before its first paired step (each with a backward run
    alone in the cool-down), the overlap's extra one included."""
    total = num_microbatches * virtual_stages
    if pp == 1:
        return min(1, total)
    warmup = (pp - rank - 1) * 2 + (virtual_stages - 1) * pp
    return min(min(warmup, total) + 1, total)


def paired_share(pp: int, virtual_stages: int, num_microbatches: int) -> float:
    """The share of a rank's forward (and backward) passes that run paired, over the pipeline
    ranks' mean."""
    total = num_microbatches * virtual_stages
    return sum(total - warmup_passes(pp, virtual_stages, num_microbatches, rank) for rank in range(pp)) / (pp * total)


def paired_layer_s(attn_fwd_s: float, expert_fwd_s: float, attn_bwd_s: float, expert_bwd_s: float,
                   a2a_fwd_s: float, a2a_bwd_s: float) -> float:
    """One layer's forward paired with another micro-batch's backward of it: the critical path
    of the issue order above (module docstring), each all-to-all half dispatch and half combine."""
    dispatch_f = combine_f = a2a_fwd_s / 2
    dispatch_b = combine_b = a2a_bwd_s / 2
    combine_b_end = combine_b                                   # B.combine starts at once
    attn_f_end = attn_fwd_s
    dispatch_f_end = max(attn_f_end, combine_b_end) + dispatch_f
    expert_b_end = max(attn_f_end, combine_b_end) + expert_bwd_s
    dispatch_b_end = max(dispatch_f_end, expert_b_end) + dispatch_b
    expert_f_end = max(expert_b_end, dispatch_f_end) + expert_fwd_s
    combine_f_end = max(dispatch_b_end, expert_f_end) + combine_f
    attn_b_end = max(expert_f_end, dispatch_b_end) + attn_bwd_s
    return max(attn_b_end, combine_f_end)


def hidden_a2a_share(attn_fwd_s: float, expert_fwd_s: float, attn_bwd_s: float, expert_bwd_s: float,
                     a2a_fwd_s: float, a2a_bwd_s: float, share: float, slowdown: float = 0.0) -> float:
    """The share of a layer's all-to-all time (forward and backward) the combined 1F1B hides,
    `share` of its passes running paired (`paired_share`) and the rest alone; `slowdown`: how much
    longer compute takes beside the transfers (`compute_slowdown`). Paired, the streams run side
    by side for (compute + all-to-all - critical path) seconds, and compute takes 1 + slowdown
    times as long over them: that stretch counts as exposed all-to-all."""
    if not slowdown >= 0.0:
        raise ValueError(f"the compute slowdown beside the all-to-alls must be >= 0, got {slowdown}")
    a2a_s = a2a_fwd_s + a2a_bwd_s
    if a2a_s <= 0:
        return 0.0
    compute_s = attn_fwd_s + expert_fwd_s + attn_bwd_s + expert_bwd_s
    path_s = paired_layer_s(attn_fwd_s, expert_fwd_s, attn_bwd_s, expert_bwd_s, a2a_fwd_s, a2a_bwd_s)
    side_by_side_s = max(0.0, compute_s + a2a_s - path_s)
    exposed_paired_s = path_s - compute_s + side_by_side_s * slowdown
    exposed_s = share * exposed_paired_s + (1.0 - share) * a2a_s
    return min(1.0, max(0.0, 1.0 - exposed_s / a2a_s))
