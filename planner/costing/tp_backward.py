"""What Megatron-Core's TP leaves exposed in backward without a TP overlap: each column Linear's two
collectives beside its own GEMMs.

Without `--tp-comm-overlap` (Megatron-LM's default) a block's TP collectives block the compute
stream, except the two of each column Linear's backward. Transformer Engine's Linears
(`_LayerNormLinear.backward`, `_LayerNormMLP.backward`, `_Linear.backward`: "Tensor-parallel
communication is overlapped with dgrad GEMM") and Megatron-Core's own
`LinearWithGradAccumulationAndAsyncCommunication.backward` launch them with `async_op=True`:

- the all-gather of the kept sequence shard, the weight gradient's input (in every backward, a
  recomputed block's too: `communication.regathers`), runs beside the input-gradient GEMM and is
  waited on before the weight-gradient GEMM;
- the input gradient's reduce-scatter (all-reduce without sequence parallelism) runs beside the
  weight-gradient GEMM.

Both go to one NCCL stream in that order, so a region's column backward takes
max(dgrad, gather) + max(wgrad, scatter) where its compute alone takes dgrad + wgrad: each collective
exposes what its GEMM does not cover. A row Linear's output-gradient all-gather feeds its input
gradient and blocks, as do the forward's collectives. Megatron-Core fuses a region's column Linears
(linear_qkv, linear_fc1), so a region's GEMM is its column shapes' together
(`gemm.block_linear_shapes`, each in its dtype: `fused_tp.block_region_gemms`). A MoE block's regions
are its dense part's (`expert_parallel.moe_tp_regions`: attention, and its shared experts if it has
them; the routed experts take no TP collective). Blocks whose shapes meshplan does not know
(multi-head latent attention, traced layers) keep the blocking rule. The compute beside the
collectives is not slowed, as under the other TP and data-parallel overlaps.
"""
from __future__ import annotations

from meshplan.planner.contracts.cluster import ClusterProfile
from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.contracts.graph import LayerProfile, ModelInfo
from meshplan.planner.costing.communication import regather_s
from meshplan.planner.costing.fused_tp import block_region_gemms
from meshplan.planner.costing.overlap import overlap_of


def applies(layer: LayerProfile, config: ParallelConfig) -> bool:
    """Whether the engine runs this block's backward column collectives beside their GEMMs: its
    record says so (`EngineOverlap.tp_backward_beside_gemms`) and no TP overlap pipelines them."""
    if config.tp < 2 or layer.tp_split.kind != "block" or not layer.tp_split.num_allreduce_per_pass:
        return False  # the cheap tests first: this runs for every layer a cost table prices
    overlap = overlap_of(config)
    return overlap.tp_backward_beside_gemms and not overlap.tp_comm_overlap


def exposed_backward_s(layer: LayerProfile, config: ParallelConfig, cluster: ClusterProfile, info: ModelInfo,
                       parts, profile_dtype: str) -> float | None:
    """Seconds of one micro-batch's backward TP collectives (`parts` as `communication.tp_comm_parts_s`
    gives them) on the compute path: the row Linears' gathers whole, each region's regather and
    input-gradient scatter beyond its column GEMMs (module docstring); None where this does not
    apply or the block's shapes are unknown."""
    if not applies(layer, config):
        return None
    count = layer.tp_split.num_allreduce_per_pass
    block = block_region_gemms(layer, info, config, cluster, profile_dtype, count)
    if block is None:
        return None
    shapes, regions, times = block
    (gathers, _), (bwd_gathers, bwd_scatters) = parts
    regather = regather_s(gathers, config) / count  # a region's
    scatter = bwd_scatters / count
    exposed = bwd_gathers - count * regather  # the row Linears' output-gradient gathers
    for region in regions:
        columns = [times[i] for i in region if shapes[i][2]]
        exposed += max(0.0, regather - sum(t[1] for t in columns)) + max(0.0, scatter - sum(t[2] for t in columns))
    return exposed
