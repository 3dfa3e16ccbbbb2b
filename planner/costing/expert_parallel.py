"""Expert parallelism (EP): each MoE block's routed experts are split over `ep` data ranks.

Layout (Megatron-LM's and torchtitan's): EP is carved out of data (x context) parallelism. The
dp * cp data ranks (tp apart) are regrouped as (dp * cp / ep, ep): the inner `ep` consecutive data
ranks, tp apart, form an EP group and each holds E/ep of the E routed experts of every MoE block;
the dp * cp / ep ranks that hold the same experts (tp * ep apart) form its expert-data-parallel
group. Attention, the router, the shared experts, the norms and dense blocks are untouched:
replicated over the data ranks as without EP. Expert tensor parallelism is the mesh's tp: every
expert's SwiGLU is split tp ways as the block's MLP is (Megatron-LM's default
expert-tensor-parallel size = tp).

Notation, per rank and micro-batch: T tokens on the rank (mbs * s, / cp under CP), k = top_k,
E experts, h hidden, b bytes per element of the compute dtype, F the routing imbalance
(`ModelInfo.moe_imbalance`: the busiest expert receives F times the balanced T k / E copies).

- dispatch: the rank sends its D = T k h b bytes of routed copies (`LayerProfile.dispatch_bytes`;
  / tp with SP, where a TP rank holds T/tp tokens), of which (ep-1)/ep leave the rank, by one
  all-to-all over the EP group (`collectives.collective_time_s("all_to_all", ...)`: NVLink inside
  a node, the rails across nodes). The busiest rank receives F D: the collective is charged at
  F D. Forward: dispatch, expert GEMMs, combine (the same volume back). Backward mirrors it: the
  combine's gradient goes out to the experts, their backward runs, the dispatch's gradient comes
  back: 2 all-to-alls each pass, 4 a2a(F D) per micro-batch, blocking (the expert GEMMs need
  their tokens; the next layer needs the combined output); full recomputation repeats the
  forward's two in backward.
- expert GEMMs: the rank's expert FLOPs are the same as without EP under balanced routing
  (ep ranks' tokens times E/ep experts: T k / E * ep copies each), times F on the busiest rank.
  Each of its E/ep experts runs `n_g` GEMMs (3 for a SwiGLU: gate, up, down) of
      f = expert_fwd_flops * mbs / tp * ep / (n_g E) * F     FLOPs each (forward; backward 2 n_g of them),
  priced on the device's efficiency curve at f (`device_time.compute_time_s`: peak * eff *
  f / (f + f_half)), not at the whole layer's GEMM size: small per-expert batches run far below
  peak, and EP makes them ep times larger. The experts' saved bytes (x F) are streamed by the
  memory-bound kernels as the rest of the layer's are.
- memory: expert parameters per rank P_e = expert_params / (ep tp); their gradients and
  optimizer states follow ZeRO over the expert-data-parallel group (dp cp / ep ranks; HSDP's
  shard group applies to the non-expert parameters only); the experts' saved activations x F.
- gradient reduction: non-expert gradients over the dp * cp data ranks as before; expert
  gradients over the dp cp / ep expert-data ranks, tp * ep apart (`ParallelConfig.expert_data_ranks`,
  `expert_data_stride`).
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

from meshplan.planner.costing.collectives import collective_time_s
from meshplan.planner.costing.communication import dp_comm_s
from meshplan.planner.costing.device_time import compute_time_s, memory_time_s
from meshplan.planner.costing.state_memory import state_bytes
from meshplan.planner.costing.precision import COMPUTE_DTYPE, activation_scale, recipe
from meshplan.planner.costing.tp_split import is_split

# GEMMs per routed expert when the layer's TP split names none: a SwiGLU (gate, up, down).
SWIGLU_GEMMS = 3


def is_expert_linear(name: str) -> bool:
    """A Linear of the routed experts (`moe.experts.gate`), as the TP split names it."""
    return "experts" in name.split(".")


def expert_gemms(layer) -> int:
    """GEMMs each routed expert runs per forward (its Linears in the layer's TP split)."""
    names = layer.tp_split.column_linears + layer.tp_split.row_linears
    return sum(map(is_expert_linear, names)) or SWIGLU_GEMMS


def dense_part(layer):
    """The MoE block without its routed experts: attention, router, shared experts, norms, the
    dispatch and combine permutations. What every data rank runs whatever ep is."""
    split = layer.tp_split
    sharded = layer.act_tp_sharded_bytes - min(layer.expert_act_bytes, layer.act_tp_sharded_bytes)
    replicated = layer.act_tp_replicated_bytes - max(0, layer.expert_act_bytes - layer.act_tp_sharded_bytes)
    causal = layer.causal_fwd_flops - layer.expert_fwd_flops if layer.causal_fwd_flops else 0
    num_params = layer.num_params - layer.expert_params
    return replace(
        layer, num_params=num_params,
        param_bytes=round(layer.param_bytes * num_params / layer.num_params) if layer.num_params else 0,
        fwd_flops=layer.fwd_flops - layer.expert_fwd_flops, bwd_flops=layer.bwd_flops - layer.expert_bwd_flops,
        causal_fwd_flops=max(0, causal), act_tp_sharded_bytes=sharded, act_tp_replicated_bytes=max(0, replicated),
        expert_params=0, active_expert_params=0, expert_fwd_flops=0, expert_bwd_flops=0, expert_act_bytes=0,
        dispatch_bytes=0,
        tp_split=replace(split, column_linears=tuple(n for n in split.column_linears if not is_expert_linear(n)),
                         row_linears=tuple(n for n in split.row_linears if not is_expert_linear(n))))


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


def expert_gemm_flops(layer, config, info, tp_shard: int) -> tuple[float, float, int]:
    """(forward FLOPs, backward FLOPs, forward GEMMs) of the busiest rank's experts, one micro-batch."""
    ep = config.ep
    scale = config.rank_microbatch / tp_shard * load_factor(info)
    num_gemms = expert_gemms(layer) * max(1, info.num_experts // ep)
    return layer.expert_fwd_flops * scale, layer.expert_bwd_flops * scale, num_gemms


def dispatch_send_bytes(layer, config, act_scale: float, split: bool) -> float:
    """D: one rank's routed copies of one micro-batch in the compute dtype (/ tp with SP)."""
    shard = config.tp if config.sp and split else 1
    return layer.dispatch_bytes * config.rank_microbatch * act_scale / shard


def all_to_all_s(send_bytes: float, config, cluster, info) -> float:
    """One dispatch (or combine) all-to-all over the EP group (ep ranks tp apart), at the busiest
    rank's F D."""
    if config.ep == 1 or send_bytes <= 0:
        return 0.0
    return collective_time_s("all_to_all", send_bytes * load_factor(info), config.ep, cluster, config.tp)


def ep_comm_s(send_bytes: float, config, cluster, info) -> tuple[float, float]:
    """(forward, backward) blocking all-to-all seconds of one micro-batch: dispatch + combine each
    pass, and the recomputed forward's two again under full recomputation."""
    one = all_to_all_s(send_bytes, config, cluster, info)
    fwd, bwd = 2 * one, 2 * one
    if config.recompute == "full":
        bwd += fwd
    return fwd, bwd


def check_expert_parallel(info, ep: int, data_ranks: int) -> None:
    """ValueError unless ep fits the model and the mesh: a mixture of experts whose expert count
    ep divides, and ep dividing the dp * cp data ranks."""
    if ep == 1:
        return
    if not info.num_experts:
        raise ValueError(f"expert parallelism (ep={ep}) needs a mixture-of-experts model; this one has no "
                         "routed experts: use ep 1")
    if info.num_experts % ep:
        raise ValueError(f"ep={ep} must divide the {info.num_experts} routed experts of each MoE block")
    if data_ranks % ep:
        raise ValueError(f"ep={ep} must divide the data ranks dp*cp = {data_ranks} (expert parallelism is "
                         "carved out of data and context parallelism)")


def with_routed_experts(dense, layer, config, cluster, info, profile_dtype: str | None,
                        state_recipe: str = "executor"):
    """A MoE block's `LayerCost` from its dense part's (`dense_part`, priced as any layer): plus
    the experts on the busiest rank: GEMMs at the per-expert size, their states over the
    expert-data group, and the dispatch / combine all-to-alls."""
    dtype = COMPUTE_DTYPE[config.precision]
    act_scale = activation_scale(config.precision, profile_dtype)
    split = is_split(layer, config.tp)
    shard = config.tp if split else 1
    fwd_flops, bwd_flops, gemms = expert_gemm_flops(layer, config, info, shard)
    saved = layer.expert_act_bytes * config.rank_microbatch * act_scale / shard * load_factor(info)
    traffic = cluster.device.elementwise_bytes_per_activation_byte * saved
    fwd_s = compute_time_s(fwd_flops, gemms, cluster, dtype) + memory_time_s(traffic, cluster)
    bwd_s = compute_time_s(bwd_flops, 2 * gemms, cluster, dtype, num_launches=2) + memory_time_s(2 * traffic, cluster)
    ep_fwd_s, ep_bwd_s = ep_comm_s(dispatch_send_bytes(layer, config, act_scale, split), config, cluster, info)
    # the experts' states: P_e = expert_params / (ep tp) per rank, ZeRO over the expert-data group
    params = layer.expert_params / config.ep / shard
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
    return replace(
        dense, fwd_compute_s=dense.fwd_compute_s + fwd_s, bwd_compute_s=dense.bwd_compute_s + bwd_s,
        recompute_s=dense.recompute_s + (fwd_s if full else 0.0),
        fwd_gather_s=dense.fwd_gather_s + fwd_gather_s, bwd_gather_s=dense.bwd_gather_s + bwd_gather_s,
        dp_grad_comm_s=dense.dp_grad_comm_s + grad_s, dp_param_gather_s=dense.dp_param_gather_s + gather_s,
        optimizer_step_s=dense.optimizer_step_s + optimizer_s,
        param_bytes=dense.param_bytes + states["params"], grad_bytes=dense.grad_bytes + states["grads"],
        optimizer_bytes=dense.optimizer_bytes + states["optimizer"],
        activation_bytes=dense.activation_bytes + (0.0 if full else saved),
        buffer_bytes=dense.buffer_bytes + (saved if full else 0.0) + copies * gathered,
        ep_fwd_comm_s=ep_fwd_s, ep_bwd_comm_s=ep_bwd_s, expert_fwd_s=fwd_s, expert_bwd_s=bwd_s,
        expert_state_bytes=states["params"] + states["grads"] + states["optimizer"])
