"""What torch's fused collective-matmuls leave exposed: each fused collective against its own matmuls.

torch's micro-pipelined TP (torchtitan's async TP) replaces an all-gather and the matmuls that
consume it by one op, `fused_all_gather_matmul`, and a matmul and the reduce-scatter of its
product by `fused_matmul_reduce_scatter` (torch/distributed/_symmetric_memory). Inside the op the
shards move on a side stream while the matmul runs chunk by chunk, and the op returns when both
are done: the collective hides behind its own matmuls and nothing else. Attention's kernel, the
norms and the other region's GEMMs run before or after it, not beside it. So a region whose
matmuls are short exposes what its collective takes beyond them: attention's all-gather beside q,
k and v (the k and v projections are narrow under grouped-query attention), o's reduce-scatter
beside o's one GEMM.

Per fused collective of `c` seconds beside its matmuls' `g` (row chunks, `overlap.micro_pipeline_pieces`,
each Linear in its dtype), the exposed time is max(c / tp, c - g): the first piece, as
`overlap.exposed_tp_comm_s` counts it for a whole pass, or what the matmuls are too short to cover.
The fused collectives of a Llama block (`overlap.fused_tp_collectives`):

- forward: each region's all-gather beside its column Linears' GEMMs (q, k, v; up, gate), each
  region's reduce-scatter beside its row Linear's GEMM (o; down);
- backward: each region's all-gather of the row Linear's output gradient beside that Linear's
  input-gradient GEMM, and the reduce-scatter of a single-column region's input gradient (GPT-2's
  fused c_attn, c_fc) beside that Linear's input-gradient GEMMs.

The rest is blocking, as `overlap.unpipelined_tp_comm_s` says, and so is a kept shard's regather
for the weight gradients (no recomputation): its consumer contracts over the gathered rows, which
is not a pattern the pass fuses. Blocks whose Linears' shapes meshplan does not know keep the
whole-pass rule (`overlap.exposed_tp_comm_s`).
"""
from __future__ import annotations

from meshplan.planner.contracts.cluster import ClusterProfile
from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.contracts.engine_rules import wgrad_accumulator_bytes
from meshplan.planner.contracts.graph import LayerProfile, ModelInfo
from meshplan.planner.costing import fp8, gemm
from meshplan.planner.costing.communication import regather_s
from meshplan.planner.costing.device_time import infer_seq
from meshplan.planner.costing.fp8_filter import fp8_linears
from meshplan.planner.costing.overlap import fused_scatter_regions, fused_tp_collectives, micro_pipeline_pieces

# A Llama or GPT block: attention's region, then the MLP's (`gemm.block_linear_shapes`' order).
REGIONS = 2


def block_regions(shapes: tuple, num_regions: int) -> tuple[range, ...] | None:
    """A block's `num_regions` TP regions over its Linear `shapes` (`gemm.block_linear_shapes`), each
    ending at its row Linear: the token mixer's (attention's, a Mamba-2 mixer's), then the MLP's (a
    MoE block's dense part: its shared experts'); None where the shapes do not make that many, each
    with a column Linear."""
    if not 0 < num_regions <= REGIONS:
        return None
    ends = [i + 1 for i, shape in enumerate(shapes) if not shape[2]]
    regions = tuple(range(start, end) for start, end in zip([0] + ends, ends))
    if len(regions) != num_regions or (ends and ends[-1] != len(shapes)):
        return None
    return regions if all(any(shapes[i][2] for i in region) for region in regions) else None


def block_gemm_times_s(layer: LayerProfile, info: ModelInfo, config: ParallelConfig, cluster: ClusterProfile,
                       shapes: tuple, tokens: float, profile_dtype: str) -> list[tuple[float, float, float]]:
    """(forward, input-gradient, weight-gradient) seconds of each of a block's Linears `shapes` on one
    rank (`gemm.linear_gemms_s`), in the dtype each runs in and, under torch's micro-pipeline, in the
    row chunks it runs them as (`overlap.micro_pipeline_pieces`)."""
    pieces = micro_pipeline_pieces(layer, config, shapes) or ((1, 1),) * len(shapes)
    in_fp8 = (fp8_linears(layer, info, config, profile_dtype).in_fp8
              if fp8.is_fp8(config.precision) and fp8.converts(layer) else (False,) * len(shapes))
    scale_block = fp8.recipe_of(config).scale_block if fp8.is_fp8(config.precision) else 0
    accumulate, times = wgrad_accumulator_bytes(config), []
    for shape, chunks, on in zip(shapes, pieces, in_fp8):
        dtype, block = ("fp8", scale_block) if on else ("bf16", 0)
        times.append(gemm.linear_gemms_s(shape, tokens, config.tp, cluster, dtype, block, chunks, accumulate))
    return times


def block_region_gemms(layer: LayerProfile, info: ModelInfo, config: ParallelConfig, cluster: ClusterProfile,
                       profile_dtype: str, num_regions: int):
    """(shapes, regions, GEMM times) of a block's Linears on one rank (`gemm.block_linear_shapes`,
    `block_regions`, `block_gemm_times_s` on the rank's micro-batch tokens): what `exposed_fused_s` and
    `tp_backward` set their collectives beside; None where the shapes are unknown or make no such regions."""
    seq = infer_seq(layer, info, profile_dtype)
    shapes = gemm.block_linear_shapes(layer, info, seq)
    regions = block_regions(shapes, num_regions)
    if regions is None:
        return None
    return shapes, regions, block_gemm_times_s(layer, info, config, cluster, shapes, config.rank_microbatch * seq,
                                               profile_dtype)


def _exposed(comm_s: float, matmul_s: float, tp: int) -> float:
    return max(comm_s / tp, comm_s - matmul_s)


def exposed_fused_s(layer: LayerProfile, config: ParallelConfig, cluster: ClusterProfile, info: ModelInfo,
                    parts, profile_dtype: str) -> tuple[float, float] | None:
    """(forward, backward) seconds the fused collectives of `parts` (`communication.tp_comm_parts_s`)
    expose, each beside its own matmuls (module docstring), the caller adding the unfused ones;
    None where torch's micro-pipeline fuses nothing here or the block's shapes are unknown."""
    fused = fused_tp_collectives(layer, config)
    if fused is None or layer.tp_split.num_allreduce_per_pass != REGIONS:
        return None
    block = block_region_gemms(layer, info, config, cluster, profile_dtype, REGIONS)
    if block is None:
        return None
    shapes, regions, times = block
    fwd_gather, bwd_gather, bwd_scatter = fused
    tp = config.tp
    (gathers, scatters), (bwd_gathers, bwd_scatters) = parts
    gather, scatter = gathers / REGIONS, scatters / REGIONS
    regather = regather_s(gathers, config)  # blocking, whole (`tp_comm_parts_s` counts it in)
    bwd_gather, bwd_scatter_one = (bwd_gathers - regather) / REGIONS, bwd_scatters / REGIONS
    forward = backward = 0.0
    columns_of = []
    for region in regions:
        columns = [times[i] for i in region if shapes[i][2]]
        rows = [times[i] for i in region if not shapes[i][2]]
        columns_of.append(columns)
        if fwd_gather:
            forward += _exposed(gather, sum(t[0] for t in columns), tp)
        forward += _exposed(scatter, sum(t[0] for t in rows), tp)
        if bwd_gather:
            backward += _exposed(bwd_gather, sum(t[1] for t in rows), tp)
    # the backward scatters it fuses, beside their regions' input gradients: the regions of fewest
    # column Linears first (`overlap.fused_scatter_regions` counts them; a fused q, k, v projection
    # is one Linear there and three shapes here)
    fused_scatters = fused_scatter_regions(layer, config) if bwd_scatter else 0
    for columns in sorted(columns_of, key=len)[:fused_scatters]:
        backward += _exposed(bwd_scatter_one, sum(t[1] for t in columns), tp)
    return forward, backward + (regather if bwd_gather else 0.0)  # unfused gathers: the caller's, whole
