"""Time of Megatron-Core's fine-grained recomputation: `--recompute-granularity selective
--recompute-modules ...` (`ParallelConfig.recompute_modules`, engine megatron only).

Each named module's forward runs again in backward, one layer at a time, before that layer's
backward needs what it dropped (`megatron/core/transformer/transformer_layer.py`,
`.../moe/moe_layer.py`, `.../multi_latent_attention.py`: `CheckpointWithoutOutput` for
`layernorm`, `moe_act` and `mla_up_proj`, `tensor_parallel.checkpoint` for `mlp`, `moe` and
`shared_experts`). The extra seconds of one micro-batch on one rank are, per module:

- `core_attn`: the attention core's forward (`compute_time.attention_core_recompute_s`, the
  default selective recomputation's).
- `mlp` (a dense block's MLP), `shared_experts` (a MoE block's shared experts, also rerun by
  `moe`) and `mla_up_proj` (multi-head latent attention's query and K/V up-projections): their
  Linears' forward GEMMs by shape on the rank's tokens and TP shard (`gemm.linear_times_s`).
- `moe`: the whole MoE layer's forward: the router's gate, the routed experts' grouped GEMMs with
  their token shuffles and memory-bound work (`LayerCost.expert_fwd_s`), the shared experts, and
  the dispatch and combine exchanges, which the rerun forward sends again (added to the backward's
  blocking EP time, as full recomputation does).
- the memory-bound kernels of every rerun module (norms, activations, the router's softmax): the
  bytes the modules drop (`megatron_activations.block_terms`, the same terms that price their
  memory) times the profile's `elementwise_bytes_per_activation_byte`, the proxy the forward's
  memory-bound kernels are priced by (`compute_time.compute_times_s`). Terms of the routed
  experts are left out under `moe`: `expert_fwd_s` has them.

The TP collectives inside a rerun module (the MLP's sequence-parallel gather) are not priced
again: Megatron-Core's TP communication overlap, which its performance recipes set, hides them
behind the rerun GEMMs. Other engines and layers the formulas do not describe keep the attention
core's recomputation (`compute_time.compute_times_s`).
"""
from __future__ import annotations

from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.contracts.graph import LayerProfile, ModelInfo
from meshplan.planner.costing import gemm
from meshplan.planner.costing.compute_time import attention_core_recompute_s
from meshplan.planner.costing.device_time import infer_seq, memory_time_s
from meshplan.planner.costing.engine_memory import formulas_describe
from meshplan.planner.costing.fp8 import is_fp8
from meshplan.planner.costing.megatron_activations import block_terms, is_gated
from meshplan.planner.costing.moe_compute import router_times_s
from meshplan.planner.costing.precision import COMPUTE_DTYPE
from meshplan.planner.costing.tp_split import is_split


def applies(layer: LayerProfile, config: ParallelConfig, info: ModelInfo) -> bool:
    """Whether the layer's recomputation is priced module by module: named modules on a block whose
    terms Megatron's memory recipe knows (`engine_memory.formulas_describe`: the zoo's families, and
    traced mixtures of experts and latent attention whose widths the config names)."""
    return (config.recompute == "selective" and bool(config.recompute_modules) and layer.kind == "block"
            and formulas_describe(info, config.engine))


def module_linear_shapes(layer: LayerProfile, info: ModelInfo, modules: set[str]) -> tuple:
    """(in, out, column) of the Linears the named modules rerun (module docstring)."""
    h = info.hidden
    columns = 2 if is_gated(layer, info) else 1
    shapes: list[tuple[int, int, bool]] = []
    if "mlp" in modules and not layer.expert_params and layer.tp_split.mlp != "none":
        ffn = info.mlp_width
        shapes += [(h, ffn, True)] * columns + [(ffn, h, False)]
    shared = info.shared_experts_width
    if layer.expert_params and shared and modules & {"shared_experts", "moe"}:
        shapes += [(h, shared, True)] * columns + [(shared, h, False)]
    if "mla_up_proj" in modules and info.kv_lora_rank:
        head_dim, value_dim = info.attention_head_dim, info.value_head_dim
        if info.q_lora_rank:
            shapes.append((info.q_lora_rank, info.num_heads * head_dim, True))
        shapes.append((info.kv_lora_rank, info.num_heads * (head_dim - info.qk_rope_head_dim + value_dim), True))
    return tuple(shapes)


def module_recompute_s(layer: LayerProfile, config: ParallelConfig, cluster, info: ModelInfo, expert_fwd_s: float,
                       act_scale: float, profile_dtype: str, attention: str) -> float:
    """Seconds the named modules' forwards take again in backward, one micro-batch on one rank
    (module docstring); `expert_fwd_s`: the routed experts' forward (`LayerCost.expert_fwd_s`)."""
    modules = set(config.recompute_modules)
    seq = infer_seq(layer, info, profile_dtype)
    tokens = config.rank_microbatch * seq
    dtype = COMPUTE_DTYPE[config.precision]
    seconds = 0.0
    if "core_attn" in modules:
        seconds += attention_core_recompute_s(layer, config, cluster, info, act_scale, profile_dtype, attention)
    shapes = module_linear_shapes(layer, info, modules)
    if shapes:
        tp = config.tp if is_split(layer, config.tp) else 1
        seconds += gemm.linear_times_s(shapes, tokens, tp, cluster, "fp8" if is_fp8(config.precision) else dtype)[0]
    reruns_moe = "moe" in modules and bool(layer.expert_params)
    # under `moe` the routed experts' own terms are in `expert_fwd_s` already
    dropped = sum(term.bytes_per_token for term in block_terms(layer, config, info, attention, seq,
                                                               with_routed=not reruns_moe)
                  if modules.intersection(term.dropped_by))
    seconds += memory_time_s(cluster.device.elementwise_bytes_per_activation_byte * dropped * tokens, cluster)
    if reruns_moe:
        seconds += expert_fwd_s + router_times_s(layer, config, cluster, info, dtype)[0]
    return seconds


def with_module_recompute(cost, layer: LayerProfile, config: ParallelConfig, cluster, info: ModelInfo,
                          act_scale: float, profile_dtype: str, attention: str):
    """`cost` (a `LayerCost`) with its recomputation priced module by module (for a layer that
    `applies`): the modules' forwards, and under `moe` the rerun forward's dispatch and combine
    in backward."""
    seconds = module_recompute_s(layer, config, cluster, info, cost.expert_fwd_s, act_scale, profile_dtype, attention)
    rerun_ep_s = cost.ep_fwd_comm_s if "moe" in config.recompute_modules and layer.expert_params else 0.0
    return cost.replaced(recompute_s=seconds, ep_bwd_comm_s=cost.ep_bwd_comm_s + rerun_ep_s)
