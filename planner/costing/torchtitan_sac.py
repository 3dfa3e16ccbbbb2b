"""Time of torchtitan's per-op selective activation checkpointing (`[activation_checkpoint] mode =
"selective"`, `selective_ac_option = "op"`: what `--engine torchtitan --recompute selective` means).

torchtitan wraps each transformer block in torch's selective checkpoint
(`torch.utils.checkpoint.create_selective_checkpoint_contexts`) with a policy that saves the
outputs of the ops on its list and recomputes every other op in backward
(torchtitan/distributed/activation_checkpoint.py `_apply_op_sac` with the model's
`_op_sac_save_list`, torchtitan/models/llama3/infra/parallelize.py at v0.2.2; the same rule since
its first performance tables, commit 0413364's `no_recompute_list`). The list names `aten.mm`, the
SDPA kernels, `reduce_scatter_tensor` and `aten.max`, and the policy recomputes every second
`aten.mm` of the block's forward (a count kept per block). A Llama block's forward runs its
Linears' mm's in the order wq, wk, wv, wo, w1, w3, w2 (`gemm.block_linear_shapes`' order), so wk,
wo and w3 rerun, the attention kernel does not, and every norm, RoPE, SiLU, product and residual
add does. The extra seconds of one micro-batch on one rank:

- bf16: the block's forward less its attention kernel (`compute_time.attention_core_recompute_s`)
  and the saved Linears' forward GEMMs (by shape, `gemm.linear_times_s`, as the forward prices
  them). A block whose Linears' shapes meshplan does not know (a traced model's) reruns all of
  them: the cautious side.
- fp8 (torchao's `Float8Linear`): the policy's dispatch mode sees a Float8 Linear's product as
  `aten.mm` on torchao's Float8 tensor subclass (its `aten._scaled_mm` runs beneath, in the
  subclass's own dispatch), so it saves and reruns Float8 Linears as it does bf16 ones, eagerly
  and under torch.compile (tests/planner/costing/test_torchtitan_sac.py runs torchtitan's policy
  on a torchao Float8 block; torchtitan's Float8 rows keep bf16's memory: 76.8 GiB against
  77.0 compiled, docs/performance.md Table 1). A saved Linear's forward GEMM does not rerun (in
  fp8, or bf16 where a filter leaves it); the casts feeding it do (priced, the cautious side).
- TP: the sequence-parallel all-gathers before the column Linears are not on the list and run
  again; the reduce-scatters after the row Linears are saved: half the forward's collectives
  (`TP_RERUN_SHARE`, `tp_rerun_s`).
- A MoE block: its routed experts' grouped GEMMs (`torch._grouped_mm`, not on the list) rerun
  with their shuffles (`LayerCost.expert_fwd_s`, `with_routed_experts`).

What the policy keeps is `engine_memory`'s torchtitan rule, from the same `saved_linear_shapes` (a
MoE block's routed experts rebuilt, not kept). Not priced: torchtitan 0.2's Qwen3 list leaves out
`all_to_all_single`, so a Qwen3 MoE block's dispatch and combine would rerun too (DeepSeek-V3's
list saves them); meshplan's `moe` blocks do not say which torchtitan model runs them.
"""
from __future__ import annotations

from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.contracts.graph import LayerProfile, ModelInfo
from meshplan.planner.costing import gemm
from meshplan.planner.costing.device_time import infer_seq
from meshplan.planner.costing.fp8 import is_fp8, recipe_of
from meshplan.planner.costing.fp8_filter import fp8_linears
from meshplan.planner.costing.tp_split import is_split

ENGINE = "torchtitan"
# Share of the forward's TP collectives the rerun repeats: its all-gathers, not its reduce-scatters.
TP_RERUN_SHARE = 0.5


def applies(config: ParallelConfig) -> bool:
    """Whether selective recomputation is torchtitan's per-op policy."""
    return config.engine == ENGINE and config.recompute == "selective"


def _saves(index: int) -> bool:
    """Whether the policy saves the output of the block's `index`-th Linear (0-based): every first,
    third, fifth ... `aten.mm`, bf16 or Float8 alike."""
    return index % 2 == 0


def saved_linear_shapes(shapes: tuple) -> tuple:
    """The Linears whose forward outputs the policy saves."""
    return tuple(shape for index, shape in enumerate(shapes) if _saves(index))


def recomputed_linear_shapes(shapes: tuple) -> tuple:
    """The Linears whose forward GEMMs rerun in backward: the others."""
    return tuple(shape for index, shape in enumerate(shapes) if not _saves(index))


def recompute_s(layer: LayerProfile, config: ParallelConfig, cluster, info: ModelInfo, fwd_s: float,
                attention_s: float, profile_dtype: str, dtype: str) -> float:
    """Seconds of one micro-batch's rerun on one rank (module docstring): the layer's forward
    `fwd_s` less its attention kernel `attention_s` and its saved Linears' forward GEMMs (at
    `dtype`; under fp8 the fp8 ones at the recipe's rate, `fp8_filter.fp8_linears`). Layers
    torchtitan does not checkpoint (embedding, output) rerun nothing."""
    if layer.kind != "block":
        return 0.0
    seconds = fwd_s - attention_s
    seq = infer_seq(layer, info, profile_dtype)
    shapes = gemm.block_linear_shapes(layer, info, seq)
    if not shapes:
        return max(0.0, seconds)
    tokens = config.rank_microbatch * seq
    shard = config.tp if is_split(layer, config.tp) else 1
    fp8_config = is_fp8(config.precision)
    in_fp8 = fp8_linears(layer, info, config, profile_dtype).in_fp8 if fp8_config else (False,) * len(shapes)
    saved = [index for index in range(len(shapes)) if _saves(index)]
    fp8_block = recipe_of(config).scale_block if fp8_config else 0
    for fp8_on, gemm_dtype, scale_block in ((False, dtype, 0), (True, "fp8", fp8_block)):
        if group := tuple(shapes[index] for index in saved if in_fp8[index] is fp8_on):
            seconds -= gemm.linear_times_s(group, tokens, shard, cluster, gemm_dtype, scale_block)[0]
    return max(0.0, seconds)


def tp_rerun_s(tp_fwd_s: float, config: ParallelConfig, layer: LayerProfile) -> float:
    """The forward TP collectives the rerun repeats in backward."""
    return TP_RERUN_SHARE * tp_fwd_s if applies(config) and layer.kind == "block" else 0.0


def with_routed_experts(cost, layer: LayerProfile, config: ParallelConfig):
    """`cost` (a `LayerCost`) with a MoE block's routed experts rerun (their forward)."""
    if not (applies(config) and layer.expert_params):
        return cost
    return cost.replaced(recompute_s=cost.recompute_s + cost.expert_fwd_s)
