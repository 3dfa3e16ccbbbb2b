"""Expert parallelism (EP) and expert tensor parallelism (ETP) of the MoE blocks, folded.

Layout (Megatron-Core's MoE parallel folding, `contracts.axes`): the routed experts lay their
own (edp, ep, etp) over the same tp * cp * dp ranks of a pipeline stage as the dense layers'
(dp, cp, tp), etp innermost. Each routed expert is split over `etp` consecutive ranks (its
SwiGLU column- and row-parallel as a block's MLP under TP); the E routed experts over `ep` ranks
`etp` apart, each holding E/ep; the ranks holding the same expert shards, `etp * ep` apart, form
the expert-data-parallel group of edp = tp cp dp / (etp ep) ranks. etp defaults to tp
(Megatron-LM's default expert-tensor-parallel size), and then EP is carved out of the dp * cp
data ranks as before folding. Attention, the router, the shared experts, the norms and dense
blocks keep the dense layout: split over tp, replicated over the dp * cp data ranks.

Notation, per rank and micro-batch: T tokens on the rank (mbs * s, / cp under CP), k = top_k,
E experts, h hidden, b bytes per element of the compute dtype, F the routing imbalance
(`ModelInfo.moe_imbalance`: the busiest expert receives F times the balanced T k / E copies).

- dispatch (`folded_dispatch`): a tp group's ranks hold the same T tokens, or T/tp each under SP.
  Without SP, when etp divides tp, an expert-TP group lies inside one tp group and already shares
  its tokens: the tp/etp expert-TP groups of a tp group take a 1/(tp/etp) slice each, every rank
  sending D = T k h b etp/tp bytes of routed copies (`LayerProfile.dispatch_bytes`; D = T k h b at
  the default etp = tp), and the combined slices are all-gathered back over the tp/etp groups
  (etp apart) after the block. Otherwise (SP, or etp not dividing tp) each rank sends its T/tp
  tokens' D = T k h b / tp and the expert-TP group all-gathers what it received before the
  experts (etp times the received bytes, over etp consecutive ranks) and reduce-scatters their
  output (Megatron-Core's alltoall dispatcher); the combine returns each rank its own T/tp
  tokens, which the sequence-parallel stream keeps (no slice gathered back). An expert-TP group whose ranks received the same
  copies all-reduces the down projection's partial outputs instead (and the input's gradient in
  backward), F D over etp ranks (`expert_tp_comm_s`). Of D, (ep-1)/ep leaves the rank by one all-to-all
  over the EP group (ep ranks etp apart: `collectives.collective_time_s("all_to_all", ...)`,
  NVLink inside a node, the rails across nodes; consecutive ranks keep it inside a node where it
  fits). The busiest rank receives F D: the collective is charged at F D. Forward: dispatch,
  expert GEMMs, combine (the same volume back). Backward mirrors it: the combine's gradient goes
  out to the experts, their backward runs, the dispatch's gradient comes back: 2 all-to-alls each
  pass, 4 a2a(F D) per micro-batch (with the expert-TP gather and reduce-scatter beside them),
  blocking (the expert GEMMs need their tokens; the next layer needs the combined output); full
  recomputation repeats the forward's in backward.
- expert GEMMs: the rank's expert FLOPs are T k / tp copies' worth whatever etp and ep are
  (the ranks of a stage share the expert work of its tokens evenly under balanced routing),
  times F on the busiest rank. Each of its E/ep experts runs its GEMMs at
  m = T k F etp ep / (tp E) rows, priced by shape with a grouped GEMM's tail per extra expert,
  and the permutation and unpermutation of the computed copies are memory-bound shuffles
  (`planner.costing.moe_compute`, whose docstring has the rules and their sources); a model that
  names no expert width keeps the efficiency curve at the per-expert size
  (`device_time.compute_time_s`), n_g E/ep equal GEMMs (`expert_gemm_flops`). The experts' saved
  bytes (x F) are streamed by the memory-bound kernels as the rest of the layer's are. The
  router's gate Linear is priced by its shape too (`moe_compute.router_times_s`), outside the
  dense part (`dense_part(layer, info)`).
- TP collectives of the block (`moe_tp_regions`): attention's, and the shared experts' when the
  block has them; the routed experts' output takes no all-reduce (SP: all-gather and
  reduce-scatter) of the (b, s, h) stream over tp, the dispatch, combine and expert-TP
  collectives above move their copies instead.
- token dispatcher (`ModelInfo.moe_dispatcher`): the dispatch and combine above are the default
  alltoall dispatcher's; `moe_dispatch.dispatch_combine_s` prices allgather's and DeepEP's traffic
  instead (the expert-TP collectives and the slice gather stay as they are).
- all-to-all overlap: `ep_comm_s(..., a2a_overlap=)` hides that share of the dispatch and
  combine all-to-alls behind other compute (an engine overlapping them with another
  micro-batch's work); 0 by default, every all-to-all blocking.
- memory: expert parameters per rank P_e = expert_params / (ep etp); their gradients and
  optimizer states follow ZeRO over the expert-data-parallel group (tp cp dp / (etp ep) ranks;
  HSDP's shard group applies to the non-expert parameters only); the experts' saved activations x F.
- gradient reduction: the dense part's gradients over the dp * cp data ranks, tp apart; expert
  gradients over the expert-data ranks, etp * ep apart (`ParallelConfig.expert_data_ranks`,
  `expert_data_stride`): each part of a block pays its own collectives.
- capacity factor C (`ModelInfo.moe_capacity_factor`, 0: none, nothing dropped): each expert
  takes at most C T k / E copies per micro-batch; copies routed beyond that are dropped (they skip
  the expert and reach the combine as zeros, Megatron-LM's and GShard's token dropping). The
  busiest expert's load factor becomes min(F, C) and, when F > C, it drops the share 1 - C/F of
  the F T k / E copies routed to it (`dropped_share`). Whole step: the busiest expert's excess
  alone is (F - C) T k / E copies, so at least (F - C) / E of all T k routed copies are dropped
  (`dropped_share_lower_bound`); the other experts' loads are not modelled (F names only the
  busiest), so that is a lower bound, not an estimate of the total. Padding to capacity
  (`ModelInfo.moe_pad_to_capacity`, Megatron-LM's --moe-pad-expert-input-to-capacity): every
  expert's input buffer is padded to exactly C T k / E rows, so every expert's GEMMs, saved
  activations and the all-to-all volume are C times the balanced share whatever the routing: the
  load factor is C (also when C > F: the padding rows cost as real ones). Padding is modelled as
  what a capacity factor with that flag does, and is off by default as in Megatron-LM, where a
  capacity factor without the flag drops without padding (load min(F, C)). `load_factor` is the
  one place these rules apply: the GEMMs, the saved expert activations and the all-to-alls read it;
  `planner.models.config.check_capacity` checks the factor where a model is described.
"""
from __future__ import annotations

from dataclasses import replace

from meshplan.planner.contracts.config import DEFAULT_MOE_DISPATCHER
from meshplan.planner.costing.collectives import collective_time_s
from meshplan.planner.costing.communication import dp_comm_s
from meshplan.planner.costing.device_time import DTYPE_BYTES, memory_time_s
from meshplan.planner.costing.memo import through
from meshplan.planner.costing.fp8 import experts_in_fp8, fp8_gemm_time_s
from meshplan.planner.costing.moe_compute import (expert_gemms, flop_curve_times_s, fp8_grouped_times_s,
                                                  grouped_gemm_times_s, is_expert_linear, router_flops, router_times_s,
                                                  shuffle_time_s)
from meshplan.planner.costing.moe_dispatch import dispatch_combine_s
from meshplan.planner.costing.moe_overlap import compute_slowdown, hidden_a2a_share, paired_share
from meshplan.planner.costing.state_memory import grad_copy_bytes_per_param, state_bytes
from meshplan.planner.costing.tp_split import rank_params
from meshplan.planner.costing.precision import COMPUTE_DTYPE, activation_scale, recipe


def dense_part(layer, info=None):
    """The MoE block without its routed experts: attention, router, shared experts, norms, the
    dispatch and combine permutations. What every data rank runs whatever ep is. With `info`,
    without the router's gate FLOPs too: `with_routed_experts` prices the gate by its shape
    (`moe_compute.router_times_s`). Its TP collectives are its non-expert regions'
    (`moe_tp_regions`)."""
    split = layer.tp_split
    sharded = layer.act_tp_sharded_bytes - min(layer.expert_act_bytes, layer.act_tp_sharded_bytes)
    replicated = layer.act_tp_replicated_bytes - max(0, layer.expert_act_bytes - layer.act_tp_sharded_bytes)
    gate = gate_flops(layer, info) if info is not None else 0.0
    causal = layer.causal_fwd_flops - layer.expert_fwd_flops - gate if layer.causal_fwd_flops else 0
    num_params = layer.num_params - layer.expert_params
    return replace(
        layer, num_params=num_params,
        param_bytes=round(layer.param_bytes * num_params / layer.num_params) if layer.num_params else 0,
        fwd_flops=layer.fwd_flops - layer.expert_fwd_flops - gate,
        bwd_flops=layer.bwd_flops - layer.expert_bwd_flops - 2 * gate,
        causal_fwd_flops=max(0, causal), act_tp_sharded_bytes=sharded, act_tp_replicated_bytes=max(0, replicated),
        expert_params=0, active_expert_params=0, expert_fwd_flops=0, expert_bwd_flops=0, expert_act_bytes=0,
        dispatch_bytes=0,
        tp_split=replace(split, column_linears=tuple(n for n in split.column_linears if not is_expert_linear(n)),
                         row_linears=tuple(n for n in split.row_linears if not is_expert_linear(n)),
                         num_allreduce_per_pass=moe_tp_regions(split)))


def moe_tp_regions(split) -> int:
    """TP collective regions per pass of a MoE block: one per row-parallel Linear that is not a
    routed expert's (attention's output, the shared experts' down), at most the block's count.

    The routed experts' output never takes the dense MLP's all-reduce (or SP all-gather and
    reduce-scatter) of the (b, s, h) stream: Megatron-Core's MoE layer routes the sequence-parallel
    shard it is given and its dispatchers move the copies over the EP group, with the expert-TP
    group's gather and reduce-scatter of the copies beside them (`token_dispatcher.py`: the
    all-to-all over ep_group, then gather_from_sequence_parallel_region over the expert-TP group;
    `expert_tp_comm_s` here); only its shared experts (`SharedExpertMLP`) gather and
    reduce-scatter the stream as a dense MLP does. meshplan's executor likewise sums the experts'
    partial outputs over the expert-TP group before the combine (`executor.parallel.expert`). A
    block with no non-expert row Linear named (a model whose layout names none) keeps its count."""
    regions = sum(not is_expert_linear(name) for name in split.row_linears)
    return min(split.num_allreduce_per_pass, regions) if regions else split.num_allreduce_per_pass


def gate_flops(layer, info) -> float:
    """The router gate's forward FLOPs per sample priced by its shape (`moe_compute.router_flops`),
    0 when the block's dense FLOPs do not hold them (the gate then stays priced with them)."""
    gate = router_flops(layer, info)
    return gate if gate <= layer.fwd_flops - layer.expert_fwd_flops - layer.attn_fwd_flops else 0.0


def capacity_factor(info) -> float:
    """C, the experts' capacity over the balanced T k / E copies; 0.0: no capacity (none dropped)."""
    return float(getattr(info, "moe_capacity_factor", 0.0) or 0.0)


def load_factor(info) -> float:
    """The busiest rank's expert work and received tokens over the balanced share (`routed_load`
    of the graph's routing options)."""
    return routed_load(float(getattr(info, "moe_imbalance", 1.0) or 1.0), capacity_factor(info),
                       bool(getattr(info, "moe_pad_to_capacity", False)))


def routed_load(imbalance: float, capacity: float, pad_to_capacity: bool) -> float:
    """F without a capacity factor (capacity 0), min(F, C) with one, C when expert inputs are
    padded to capacity."""
    if not capacity:
        return imbalance
    return capacity if pad_to_capacity else min(imbalance, capacity)


def dropped_share(info) -> float:
    """Share of the copies routed to the busiest expert that its capacity drops (`dropped_share_of`)."""
    return dropped_share_of(float(getattr(info, "moe_imbalance", 1.0) or 1.0), capacity_factor(info))


def dropped_share_of(imbalance: float, capacity: float) -> float:
    """1 - C/F when F > C, else 0 (capacity 0: none dropped)."""
    return 1.0 - capacity / imbalance if capacity and imbalance > capacity else 0.0


def dropped_share_lower_bound(info) -> float:
    """Share of all routed copies of a step dropped at least: the busiest expert's excess (F - C) / E."""
    imbalance, capacity = float(getattr(info, "moe_imbalance", 1.0) or 1.0), capacity_factor(info)
    if not capacity or imbalance <= capacity or not info.num_experts:
        return 0.0
    return (imbalance - capacity) / info.num_experts


def expert_gemm_flops(layer, config, info) -> tuple[float, float, int]:
    """(forward FLOPs, backward FLOPs, forward GEMMs) of the busiest rank's experts, one micro-batch:
    a tp group's tokens' expert work shared by its tp ranks whatever etp and ep are."""
    ep = config.ep
    scale = config.rank_microbatch / config.tp * load_factor(info)
    num_gemms = expert_gemms(layer) * max(1, info.num_experts // ep)
    return layer.expert_fwd_flops * scale, layer.expert_bwd_flops * scale, num_gemms


def folded_dispatch(config) -> tuple[float, bool]:
    """(share of a tp group's T tokens one rank dispatches, whether the expert-TP group gathers
    them): (etp/tp, False) when the tp group's ranks hold the same tokens (no SP) and etp divides
    tp, else (1/tp, etp > 1) (module docstring)."""
    tp, etp = config.tp, config.expert_tp
    if not config.sp and tp % etp == 0:
        return etp / tp, False
    return 1 / tp, etp > 1


def dispatch_send_bytes(layer, config, act_scale: float) -> float:
    """D: one rank's routed copies of one micro-batch in the compute dtype (`folded_dispatch`)."""
    return layer.dispatch_bytes * config.rank_microbatch * act_scale * folded_dispatch(config)[0]


def all_to_all_s(send_bytes: float, config, cluster, info) -> float:
    """One dispatch (or combine) all-to-all over the EP group (ep ranks etp apart), at the busiest
    rank's F D."""
    if config.ep == 1 or send_bytes <= 0:
        return 0.0
    return collective_time_s("all_to_all", send_bytes * load_factor(info), config.ep, cluster, config.expert_tp)


def expert_tp_comm_s(send_bytes: float, config, cluster, info) -> float:
    """One pass's expert-TP collectives over etp consecutive ranks: when `folded_dispatch` gathers,
    the all-gather of the received copies before the experts and the reduce-scatter of their
    output (etp F D each); when the group's ranks received the same copies, the all-reduce of the
    down projection's partial outputs (forward) or of the input's partial gradients (backward), F D."""
    etp = config.expert_tp
    if etp == 1 or send_bytes <= 0:
        return 0.0
    received = send_bytes * load_factor(info)
    if not folded_dispatch(config)[1]:
        return collective_time_s("all_reduce", received, etp, cluster)
    return (collective_time_s("all_gather", etp * received, etp, cluster)
            + collective_time_s("reduce_scatter", etp * received, etp, cluster))


def slice_gather_s(layer, config, cluster, info, act_scale: float) -> float:
    """Without SP, when etp < tp: the all-gather over the tp/etp expert-TP groups of a tp group
    (etp apart) of their combined token slices, T h b gathered, that restores the tokens the tp
    group holds alike (forward only: its backward keeps each slice's gradient)."""
    share, gathers = folded_dispatch(config)
    # under SP each rank dispatches and gets back its own sequence shard: nothing to gather
    if config.sp or gathers or share == 1 or not layer.dispatch_bytes:
        return 0.0
    gathered = layer.dispatch_bytes * config.rank_microbatch * act_scale / max(1, info.top_k)
    return collective_time_s("all_gather", gathered, round(1 / share), cluster, config.expert_tp)


def ep_comm_s(send_bytes: float, config, cluster, info, slice_s: float = 0.0,
              a2a_overlap: float = 0.0) -> tuple[float, float]:
    """(forward, backward) blocking seconds of one micro-batch's expert exchanges: dispatch +
    combine (all-to-alls under the default dispatcher; `moe_dispatch` prices each) and the
    expert-TP collectives each pass (`expert_tp_comm_s`), the forward's `slice_s`
    (`slice_gather_s`), and the recomputed forward's again under full recomputation.

    `a2a_overlap`: the share of the all-to-alls an engine hides behind other compute (another
    micro-batch's, as Megatron-LM's --overlap-moe-expert-parallel-comm does); 0, the default,
    keeps every all-to-all on the compute stream's path."""
    if not 0.0 <= a2a_overlap <= 1.0:
        raise ValueError(f"the all-to-all overlap share must lie in [0, 1], got {a2a_overlap}")
    a2a_s = a2a_pass_s(send_bytes, config, cluster, info) * (1.0 - a2a_overlap)
    exchange = a2a_s + expert_tp_comm_s(send_bytes, config, cluster, info)
    fwd, bwd = exchange + slice_s, exchange
    if config.recompute == "full":
        bwd += fwd
    return fwd, bwd


def a2a_pass_s(send_bytes: float, config, cluster, info) -> float:
    """One pass's dispatch and combine (`moe_dispatch.dispatch_combine_s` under the model's
    dispatcher), nothing hidden."""
    return dispatch_combine_s(getattr(info, "moe_dispatcher", DEFAULT_MOE_DISPATCHER), send_bytes * load_factor(info),
                              send_bytes / max(1, info.top_k), config.ep, config.expert_tp, cluster, info.num_experts,
                              info.top_k, info.moe_router_groups, info.moe_router_group_topk)


def combined_1f1b_share(dense, layer, config, cluster, info, profile_dtype: str | None, memo: dict | None) -> float:
    """The share of the block's all-to-alls Megatron-Core's combined 1F1B hides
    (`moe_overlap.hidden_a2a_share`), from the block's own times: attention (the dense part, its
    blocking collectives and the router) and experts, forward and backward, beside the
    all-to-alls of each pass (a fully recomputed block's backward reruns its forward's)."""
    fwd_s, bwd_s, router_fwd_s, router_bwd_s, _ = _memo_expert_times(layer, config, cluster, info, profile_dtype,
                                                                     memo)
    full = config.recompute == "full"
    a2a_fwd_s = a2a_pass_s(dispatch_send_bytes(layer, config, activation_scale(config.precision, profile_dtype)),
                           config, cluster, info)
    attn_fwd_s = dense.fwd_busy_s + router_fwd_s  # the dense part's compute stream (it has no all-to-all)
    attn_bwd_s = dense.bwd_busy_s + router_bwd_s + (router_fwd_s if full else 0.0)
    share = paired_share(config.pp, config.virtual_stages, config.num_microbatches)
    slowdown = compute_slowdown(getattr(info, "moe_dispatcher", DEFAULT_MOE_DISPATCHER), cluster.device.num_sms)
    return hidden_a2a_share(attn_fwd_s, fwd_s, attn_bwd_s, bwd_s + (fwd_s if full else 0.0), a2a_fwd_s,
                            a2a_fwd_s * (2 if full else 1), share, slowdown)


def check_expert_parallel(info, ep: int, etp: int | None = None) -> None:
    """ValueError unless ep and etp fit the model: a mixture of experts whose expert count ep
    divides and whose experts' width etp divides (the mesh rules are `ParallelConfig`'s)."""
    for name, degree in (("ep", ep), ("etp", etp)):
        if degree not in (None, 1) and not info.num_experts:
            raise ValueError(f"expert {'' if name == 'ep' else 'tensor '}parallelism ({name}={degree}) needs a "
                             f"mixture-of-experts model; this one has no routed experts: use {name} 1")
    if info.num_experts % ep:
        raise ValueError(f"ep={ep} must divide the {info.num_experts} routed experts of each MoE block")
    if etp not in (None, 1) and info.expert_ffn % etp:
        raise ValueError(f"etp={etp} must divide the routed experts' width {info.expert_ffn} (each expert's "
                         "SwiGLU is split etp ways)")


def expert_compute_s(layer, config, cluster, info, dtype: str, load: float) -> tuple[float, float]:
    """(forward, backward) GEMM seconds of the busiest rank's experts, one micro-batch: grouped
    GEMMs by shape at the per-expert rows (`moe_compute.grouped_gemm_times_s`), or, for a model
    that names no expert width, its expert FLOPs on the efficiency curve at the per-expert size."""
    in_fp8 = experts_in_fp8(config)
    grouped = (fp8_grouped_times_s(layer, config, cluster, info, load) if in_fp8
               else grouped_gemm_times_s(layer, config, cluster, info, dtype, load))
    if grouped is not None:
        return grouped
    fwd_flops, bwd_flops, gemms = expert_gemm_flops(layer, config, info)
    if in_fp8:  # shapes unknown: the fp8 size curve, as a dense block's unknown Linears (no casts counted)
        return fp8_gemm_time_s(fwd_flops, gemms, cluster), fp8_gemm_time_s(bwd_flops, 2 * gemms, cluster)
    return flop_curve_times_s(fwd_flops, bwd_flops, gemms, cluster, dtype)


# The `ParallelConfig` fields the routed experts' times read (`_expert_times`): a memo keys on them,
# and on the fp8 ones where the experts run in fp8 (the recipe's casts, a weight's cast per step).
EXPERT_TIME_FIELDS = ("precision", "rank_microbatch", "tp", "sp", "ep", "expert_tp", "recompute")
FP8_EXPERT_TIME_FIELDS = ("engine", "fp8_recipe", "num_microbatches")


def expert_time_key(config) -> tuple:
    """What the routed experts' times read of `config`: the memo keys of `_memo_expert_times`."""
    fields = EXPERT_TIME_FIELDS + (FP8_EXPERT_TIME_FIELDS if experts_in_fp8(config) else ())
    return tuple(getattr(config, name) for name in fields)


def _expert_times(layer, config, cluster, info, profile_dtype: str | None) -> tuple:
    """(expert forward, expert backward, router forward, router backward seconds, saved expert
    bytes) of one micro-batch on the busiest rank: what `with_routed_experts` adds to the dense
    part's compute, reading only the `EXPERT_TIME_FIELDS` of `config`."""
    dtype = COMPUTE_DTYPE[config.precision]
    act_scale = activation_scale(config.precision, profile_dtype)
    load = load_factor(info)
    saved = layer.expert_act_bytes * config.rank_microbatch * act_scale / config.tp * load
    traffic = cluster.device.elementwise_bytes_per_activation_byte * saved
    fwd_s, bwd_s = expert_compute_s(layer, config, cluster, info, dtype, load)
    shuffle_s = shuffle_time_s(layer, config, cluster, info, load, DTYPE_BYTES.get(dtype, 2))
    fwd_s += memory_time_s(traffic, cluster) + shuffle_s
    bwd_s += memory_time_s(2 * traffic, cluster) + shuffle_s
    router_fwd_s, router_bwd_s = router_times_s(layer, config, cluster, info, dtype) if gate_flops(layer, info) \
        else (0.0, 0.0)
    return fwd_s, bwd_s, router_fwd_s, router_bwd_s, saved


def _exchange_times(layer, config, cluster, info, profile_dtype: str | None, a2a_overlap: float) -> tuple:
    """(forward, backward) EP seconds of one micro-batch (`ep_comm_s`), `a2a_overlap` of the
    all-to-alls hidden; it reads the same `EXPERT_TIME_FIELDS`."""
    act_scale = activation_scale(config.precision, profile_dtype)
    return ep_comm_s(dispatch_send_bytes(layer, config, act_scale), config, cluster, info,
                     slice_gather_s(layer, config, cluster, info, act_scale), a2a_overlap)


def _memo_expert_times(layer, config, cluster, info, profile_dtype: str | None, memo: dict | None) -> tuple:
    """`_expert_times` through `memo`, once per value of the `EXPERT_TIME_FIELDS` (whatever share of
    the all-to-alls is hidden: that is `_exchange_times`')."""
    key = ("expert_times", id(layer), id(cluster), id(info), profile_dtype, *expert_time_key(config))
    return through(memo, key, _expert_times, layer, config, cluster, info, profile_dtype)


def _memo_exchange_times(layer, config, cluster, info, profile_dtype: str | None, a2a_overlap: float,
                         memo: dict | None) -> tuple:
    key = ("expert_exchange", id(layer), id(cluster), id(info), profile_dtype, a2a_overlap,
           *(getattr(config, name) for name in EXPERT_TIME_FIELDS))  # the fp8 fields do not move the all-to-alls
    return through(memo, key, _exchange_times, layer, config, cluster, info, profile_dtype, a2a_overlap)


def with_routed_experts(dense, layer, config, cluster, info, profile_dtype: str | None,
                        state_recipe: str = "executor", a2a_overlap: float = 0.0, memo: dict | None = None):
    """A MoE block's `LayerCost` from its dense part's (`dense_part(layer, info)`, priced as any
    layer): plus the router's gate by its shape and the experts on the busiest rank: grouped
    GEMMs at the per-expert rows with the token shuffles (`moe_compute`), their states over the
    expert-data group, and the dispatch / combine all-to-alls (`a2a_overlap` of them hidden).

    `memo`: a dict the caller keeps for one graph and cluster (`layer_cost`'s): the times are
    priced once per value of the `EXPERT_TIME_FIELDS` (a search prices each at many data,
    pipeline and ZeRO degrees, which only the states below read)."""
    if config.moe_a2a_overlap:
        a2a_overlap = combined_1f1b_share(dense, layer, config, cluster, info, profile_dtype, memo)
    fwd_s, bwd_s, router_fwd_s, router_bwd_s, saved = _memo_expert_times(layer, config, cluster, info,
                                                                         profile_dtype, memo)
    ep_fwd_s, ep_bwd_s = _memo_exchange_times(layer, config, cluster, info, profile_dtype, a2a_overlap, memo)
    # the experts' states: P_e = expert_params / (ep etp) per rank, ZeRO over the expert-data group
    params = rank_params(layer, info, config.tp, config.ep, config.expert_tp)[1]
    ranks, zero = config.expert_data_ranks, config.zero
    states = state_bytes(params, ranks, zero, config.precision, state_recipe, config.tp, config.pp)
    grad_s, gather_s, fwd_gather_s, bwd_gather_s = dp_comm_s(params, config, cluster, state_recipe=state_recipe,
                                                             group=(ranks, config.expert_data_stride))
    owned = params / (ranks if zero >= 1 else 1)
    optimizer_s = owned * cluster.optimizer_bytes_per_param / (
        cluster.device.memory_bw_bytes_per_s * cluster.device.memory_efficiency)
    gathered = params * recipe(config.precision)["param"]
    copies = (zero == 3) + (state_recipe == "executor" and ranks > 1 and zero >= 1
                            and (config.pp == 1 or zero == 3))
    full = config.recompute == "full"
    grad_copy_s = memory_time_s(grad_copy_bytes_per_param(config) * params, cluster)  # FSDP2's, as the dense part's
    return dense.replaced(
        fwd_compute_s=dense.fwd_compute_s + router_fwd_s + fwd_s,
        bwd_compute_s=dense.bwd_compute_s + router_bwd_s + bwd_s + grad_copy_s,
        recompute_s=dense.recompute_s + (router_fwd_s + fwd_s if full else 0.0),
        fwd_gather_s=dense.fwd_gather_s + fwd_gather_s, bwd_gather_s=dense.bwd_gather_s + bwd_gather_s,
        dp_grad_comm_s=dense.dp_grad_comm_s + grad_s, dp_param_gather_s=dense.dp_param_gather_s + gather_s,
        optimizer_step_s=dense.optimizer_step_s + optimizer_s,
        param_bytes=dense.param_bytes + states["params"], grad_bytes=dense.grad_bytes + states["grads"],
        optimizer_bytes=dense.optimizer_bytes + states["optimizer"],
        activation_bytes=dense.activation_bytes + (0.0 if full else saved),
        buffer_bytes=dense.buffer_bytes + (saved if full else 0.0) + copies * gathered,
        ep_fwd_comm_s=ep_fwd_s, ep_bwd_comm_s=ep_bwd_s, expert_fwd_s=fwd_s, expert_bwd_s=bwd_s,
        expert_state_bytes=states["params"] + states["grads"] + states["optimizer"],
        owned_params=dense.owned_params + owned)
