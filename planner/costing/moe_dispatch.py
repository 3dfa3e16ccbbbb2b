"""The MoE token dispatchers (`contracts.config.MOE_DISPATCHERS`, `ModelInfo.moe_dispatcher`):
what one dispatch and one combine of a micro-batch's routed copies cost over the EP group (ep
ranks `stride` = etp apart, placed on nodes by `collectives.group_placement`).

Notation: D one rank's routed copies in bytes (T k h b, `expert_parallel.dispatch_send_bytes`),
F the busiest rank's load factor, k = top_k, E routed experts; the group spans N nodes with
g of its ranks on the fullest node.

- alltoall (Megatron-Core's alltoall dispatcher; meshplan's default): every copy is sent to the
  rank holding its expert, one all-to-all of F D each way (`collectives._all_to_all_s`: NVLink
  inside a node, the rails across).
- allgather (Megatron-Core's allgather dispatcher): every rank gathers the whole EP group's tokens
  (each rank's T h b = D / k, whatever the routing) and keeps those its experts take; the combine
  reduce-scatters the outputs back: one all-gather and one reduce-scatter of ep D / k.
- deepep (Megatron-Core's flex dispatcher with DeepEP, `--moe-enable-deepep`): DeepEP's normal
  kernels send a token once per destination node over the rails, to the GPU of the same local
  index, which forwards it over NVLink to the GPUs in that node that hold its experts (DeepEP
  README, "normal kernels with NVLink and RDMA forwarding", github.com/deepseek-ai/DeepEP
  docs/legacy.md; DeepSeek-V3 technical report, arXiv:2412.19437, section 3.2.2). Under uniform
  routing a token's top-k among E experts, E/N per node, lands on N (1 - C(E - E/N, k) / C(E, k))
  distinct nodes (`expected_distinct_nodes`), (N - 1) of the N in that expectation remote, so a
  rank sends F D / k (N - 1) (1 - C(E - E/N, k) / C(E, k)) bytes over the rails instead of the
  all-to-all's F D (ep - g) / ep: for Qwen3-235B (top-8 of 128) over 4 nodes, 2.72 copies of a
  token instead of 6. Inside the node, NVLink carries the copies for the
  other local ranks, (g - 1) / ep of F D, plus the forwarding of the received remote tokens to
  their experts' GPUs, (ep - g) / ep F D (g - 1) / g. Rails and NVLink run at once (DeepEP
  pipelines the forwarding), so the slower one is paid, as the all-to-all's two parts are.
  Inside a node DeepEP also sends a token once per destination GPU, not once per expert
  (`get_dispatch_layout` marks each token's destination ranks in `is_token_in_rank`, and the
  dispatch copies the token to each marked rank once; the receiver permutes it to its local
  experts, the shuffle `moe_compute` prices): a token's k experts, E / ep per GPU, fall on
  ep (1 - C(E - E/ep, k) / C(E, k)) distinct GPUs of the group (`expected_distinct_nodes` at
  GPU grain), so every NVLink term above carries that many of a token's copies instead of k
  (`per_gpu_share`: 2/3 for top-8 of 128 experts over 8 GPUs). On one node this is the NVLink
  all-to-all of the deduplicated bytes.
Group-limited routing (DeepSeek-V2/V3's node-limited routing, Megatron-Core's
`--moe-router-num-groups` / `--moe-router-group-topk`, the HF config's n_group / topk_group): the
experts form G contiguous groups, a token first picks M of them and then its k experts among those
M groups' experts only, so its copies reach at most M groups; "each token will be sent to at most
M nodes" (DeepSeek-V3 technical report, section 2.1.2, M = 4 of 8 groups, one group a node at EP 64).
Under balanced routing (Megatron-Core's forced balancing draws random logits and keeps the group
limit) the M groups are any M of the G and the k experts any k of theirs, so a node, or GPU, is hit
with the probability `expected_distinct_bins` counts exactly where groups nest in nodes or nodes in
groups; other layouts keep the unlimited count.
The combine mirrors the dispatch: the same bytes the other way (each GPU returns one partial sum
per token it received).
"""
from __future__ import annotations

from math import comb

from meshplan.planner.contracts.config import MOE_DISPATCHERS
from meshplan.planner.costing.collectives import collective_time_s, group_placement


def expected_distinct_nodes(num_experts: int, top_k: int, num_nodes: int) -> float:
    """Expected distinct nodes a token's top-k of E experts (E / N on each of N nodes, chosen
    uniformly without repetition) fall on: N (1 - C(E - E/N, k) / C(E, k))."""
    if num_nodes < 1 or num_experts % num_nodes or not 0 < top_k <= num_experts:
        raise ValueError(f"expected distinct nodes need 0 < top_k <= experts and the experts split evenly over "
                         f"the nodes; got top_k={top_k}, experts={num_experts}, nodes={num_nodes}")
    missed = comb(num_experts - num_experts // num_nodes, top_k) / comb(num_experts, top_k)
    return num_nodes * (1.0 - missed)


def expected_distinct_bins(num_experts: int, top_k: int, bins: int, groups: int = 1, group_topk: int = 0) -> float:
    """Expected distinct bins (nodes or GPUs, E / bins contiguous experts each) a token's top-k
    reach when it picks its experts inside `group_topk` of `groups` contiguous expert groups
    (module docstring); without a group limit, or where groups and bins do not nest,
    `expected_distinct_nodes`."""
    per_group = num_experts // groups if groups > 0 else 0
    chosen = group_topk * per_group
    limited = groups > 1 and 0 < group_topk < groups and not num_experts % groups and top_k <= chosen
    if not limited or not (groups % bins == 0 or bins % groups == 0) or num_experts % bins:
        return expected_distinct_nodes(num_experts, top_k, bins)

    def missed(experts_out: int) -> float:  # P(none of the k among the chosen lie in `experts_out` of them)
        return comb(chosen - experts_out, top_k) / comb(chosen, top_k)

    if bins % groups == 0:  # each group spans bins / groups bins: a bin is hit only if its group is chosen
        return bins * group_topk / groups * (1.0 - missed(num_experts // bins))
    held = groups // bins  # each bin holds whole groups, j of them chosen (hypergeometric)
    total = sum(comb(held, j) * comb(groups - held, group_topk - j) / comb(groups, group_topk)
                * (1.0 - missed(j * per_group)) for j in range(0, min(held, group_topk) + 1))
    return bins * total


def per_gpu_share(num_experts: int, top_k: int, ep: int, groups: int = 1, group_topk: int = 0) -> float:
    """The share of a token's k routed copies DeepEP sends over NVLink: one per distinct GPU of
    the ep-rank group its experts fall on, ep (1 - C(E - E/ep, k) / C(E, k)) / k without a group
    limit (module docstring)."""
    return expected_distinct_bins(num_experts, top_k, ep, groups, group_topk) / top_k


def deepep_dispatch_s(copy_bytes: float, ep: int, stride: int, cluster, num_experts: int, top_k: int,
                      groups: int = 1, group_topk: int = 0) -> float:
    """One DeepEP dispatch (or combine) of `copy_bytes` (F D) per rank over ep ranks `stride` apart
    (module docstring): the node-deduplicated rail traffic or the GPU-deduplicated NVLink sends and
    forwarding, whichever is slower; `groups`, `group_topk`: the router's group limit (1, 0: none)."""
    placement = group_placement(ep, stride, cluster.gpus_per_node)
    nodes, per_node = placement.num_nodes, placement.ranks_per_node
    share = per_gpu_share(num_experts, top_k, ep, groups, group_topk)
    if nodes == 1 or num_experts % nodes:  # one node (or experts not split per node): the NVLink all-to-all
        return collective_time_s("all_to_all", copy_bytes * share, ep, cluster, stride)
    remote_nodes = expected_distinct_bins(num_experts, top_k, nodes, groups, group_topk) * (nodes - 1) / nodes
    rail_bytes = per_node * copy_bytes / top_k * remote_nodes  # the fullest node's, over its rails
    rails = min(per_node, cluster.nics_per_node)
    inter_s = rail_bytes / (rails * cluster.inter_node.bw_for("all_to_all"))
    nvlink_bytes = copy_bytes * share * ((per_node - 1) / ep + (ep - per_node) / ep * (per_node - 1) / per_node)
    intra_s = nvlink_bytes / cluster.intra_node.bw_for("all_to_all")
    latency_s = cluster.inter_node.latency_s + (cluster.intra_node.latency_s if per_node > 1 else 0.0)
    return max(inter_s, intra_s) + latency_s


def dispatch_combine_s(dispatcher: str, copy_bytes: float, token_bytes: float, ep: int, stride: int, cluster,
                       num_experts: int, top_k: int, groups: int = 1, group_topk: int = 0) -> float:
    """One pass's dispatch plus combine under `dispatcher`: `copy_bytes` the busiest rank's routed
    copies (F D), `token_bytes` one rank's tokens (D / k), over ep ranks `stride` apart; `groups`,
    `group_topk`: the router's group limit, which DeepEP's node deduplication sees (1, 0: none)."""
    if dispatcher not in MOE_DISPATCHERS:
        raise ValueError(f"moe dispatcher must be one of {', '.join(MOE_DISPATCHERS)}, got {dispatcher!r}")
    if ep == 1 or copy_bytes <= 0:
        return 0.0
    if dispatcher == "allgather":
        gathered = ep * token_bytes
        return (collective_time_s("all_gather", gathered, ep, cluster, stride)
                + collective_time_s("reduce_scatter", gathered, ep, cluster, stride))
    if dispatcher == "deepep":
        return 2 * deepep_dispatch_s(copy_bytes, ep, stride, cluster, num_experts, top_k, groups, group_topk)
    return 2 * collective_time_s("all_to_all", copy_bytes, ep, cluster, stride)
