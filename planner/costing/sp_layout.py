"""The layout copies of batch-first sequence parallelism: what DTensor's sequence-parallel
collectives copy around NCCL's, beyond the bytes they move.

NCCL gathers and scatters along a tensor's leading dimension only. Megatron-LM keeps activations
sequence-first, (s, b, h), so its sequence-parallel all-gathers and reduce-scatters act on dim 0
and copy nothing. torch's tensor parallelism (DTensor `SequenceParallel`, `PrepareModuleInput`,
`RowwiseParallel(output_layouts=Shard(1))`), which torchtitan and meshplan's executor run, keeps
them batch-first, (b, s, h), and shards the sequence, dim 1. Its functional collectives
(torch/distributed/_functional_collectives.py) then rearrange around the collective on the compute
stream:

- `all_gather_single(gather_dim=1)`: NCCL gathers the ranks' shards along dim 0, then
  `torch.cat(torch.chunk(res, group_size, dim=0), dim=1)` copies the gathered tensor into
  (b, s, h) order: its bytes read and written once. torch's releases of 2026
  (`torch._utils._maybe_view_chunk_cat`, pytorch/pytorch pull request 169404, "Optimize bs=1 case
  for allgather on dim 1 to not split/cat", December 2025; in the 2.13 this project installs)
  return a view where every dimension before the gathered one has size 1, at micro-batch 1: so
  meshplan's executor copies at micro-batches above 1 only, torchtitan as its overlap record runs
  it (torch 2.6-2.9) at every micro-batch.
- `reduce_scatter_single(scatter_dim=1)`: `_chunk_or_narrow_cat` first concatenates the input's
  sequence chunks along dim 0, copying the whole input, at every micro-batch.

Each all-gather's backward is such a reduce-scatter and each reduce-scatter's backward such an
all-gather, so a block pass copies what `communication.tp_comm_parts_s` moves: `count` gathers
and `count` scatters of its (b, s, h) stream a pass, fp8 where torchtitan's Float8 TP plan
gathers fp8 (`fp8.tp_gather_bytes_share`), the regather of a kept shard in backward, the
forward's copies again when the forward reruns (full recomputation; torchtitan's per-op policy
reruns its all-gathers, `torchtitan_sac`). The vocab-parallel embedding's output reduce-scatter
and the head's input all-gather, and their gradients' collectives, copy as the blocks' do.

torch's micro-pipelined TP (async TP) fuses collectives with their matmuls
(`overlap.fused_tp_collectives`) and moves the gathered or scattered dimension to the front
itself (torch/distributed/_symmetric_memory `_fused_all_gather_matmul`,
`_fused_matmul_reduce_scatter`; Inductor's micro-pipeline pass restrides their inputs,
`force_stride_order`): a fused collective has no cat. But a fused all-gather hands back its
gathered tensor sequence-major (`unflatten`: a movedim view), and Inductor gives that tensor to
the all-gather's other users, the weight gradient's matmul among them, which reshapes it into
batch-first (tokens, features) rows: a copy in backward wherever the micro-batch holds more than
one sequence (at one sequence the reshape is a view).

The copies are memory-bound, priced at the device's achieved bandwidth (`device_time.memory_time_s`).
A profile whose sequence-parallel overhead was measured (`sp_layer_overhead_s` > 0: `meshplan
calibrate` times a block with and without SP) carries them in that figure and is not charged again.
"""
from __future__ import annotations

from meshplan.planner.contracts.cluster import ClusterProfile
from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.contracts.graph import LayerProfile
from meshplan.planner.costing import fp8, torchtitan_sac
from meshplan.planner.costing.communication import regathers
from meshplan.planner.costing.device_time import memory_time_s
from meshplan.planner.costing.overlap import fused_scatter_regions, fused_tp_collectives
from meshplan.planner.costing.tp_split import is_split

# Engines whose sequence parallelism is DTensor's on batch-first activations, and whether each one's
# torch gathers at micro-batch 1 without a copy (`torch._utils._maybe_view_chunk_cat`).
BATCH_FIRST_SP_ENGINES = {"torchtitan": False, "meshplan": True}
# A copy reads its tensor and writes it once.
COPY_PASSES = 2


def applies(layer: LayerProfile, config: ParallelConfig, cluster: ClusterProfile) -> bool:
    """Whether `layer`'s sequence-parallel collectives copy their tensors here (module docstring)."""
    return (config.sp and config.engine in BATCH_FIRST_SP_ENGINES and is_split(layer, config.tp)
            and cluster.device.sp_layer_overhead_s == 0.0)


def _gather_copies(config: ParallelConfig) -> bool:
    """Whether an all-gather on the sequence dimension copies its result at this micro-batch."""
    return config.rank_microbatch > 1 or not BATCH_FIRST_SP_ENGINES[config.engine]


def copy_bytes(layer: LayerProfile, config: ParallelConfig, act_scale: float) -> tuple[float, float, float]:
    """(forward, backward, rerun) bytes one micro-batch's layout copies move on one rank, the
    caller having checked `applies`; the rerun is what recomputation repeats of the forward's."""
    mbs = config.rank_microbatch
    if layer.tp_split.kind != "block":
        if layer.kind == "embedding":  # the output's reduce-scatter; its gradient's all-gather
            tensor = layer.output_bytes * mbs * act_scale
            return COPY_PASSES * tensor, COPY_PASSES * tensor * _gather_copies(config), 0.0
        tensor = layer.input_bytes * mbs * act_scale  # the head: its input's all-gather, its gradient's scatter
        return COPY_PASSES * tensor * _gather_copies(config), COPY_PASSES * tensor, 0.0
    count = layer.tp_split.num_allreduce_per_pass
    tensor = layer.output_bytes * mbs * act_scale
    gathered = tensor * fp8.tp_gather_bytes_share(layer, config)
    copied = gathered * _gather_copies(config)  # an unfused all-gather's cat
    fused = fused_tp_collectives(layer, config)
    fwd_fused, bwd_fused, scatters_fuse = fused or (False, False, False)
    # the forward's reduce-scatters (each a row Linear's product) fuse wherever the micro-pipeline runs
    fwd = count * (copied * (not fwd_fused) + tensor * (fused is None))
    unfused_scatters = count - (min(count, fused_scatter_regions(layer, config)) if scatters_fuse else 0)
    regather = copied if regathers(config) else 0.0
    bwd = count * (copied + regather) * (not bwd_fused) + unfused_scatters * tensor
    # a fused all-gather returns its gathered tensor sequence-major (`unflatten`'s movedim); the
    # weight gradient it feeds reshapes it into batch-first (tokens, features) rows, a copy in
    # backward wherever the micro-batch holds more than one sequence
    bwd += count * gathered * (mbs > 1) * (fwd_fused + bwd_fused)
    if config.recompute == "full":
        rerun = fwd
    elif torchtitan_sac.applies(config):
        rerun = count * copied * (not fwd_fused)
    else:
        rerun = 0.0
    return COPY_PASSES * fwd, COPY_PASSES * bwd, COPY_PASSES * rerun


def copy_times_s(layer: LayerProfile, config: ParallelConfig, cluster: ClusterProfile,
                 act_scale: float) -> tuple[float, float, float]:
    """(forward, backward, rerun) seconds of `copy_bytes` on the compute stream; zeros where the
    layer's collectives copy nothing (`applies`)."""
    if not applies(layer, config, cluster):
        return 0.0, 0.0, 0.0
    fwd, bwd, rerun = copy_bytes(layer, config, act_scale)
    return memory_time_s(fwd, cluster), memory_time_s(bwd, cluster), memory_time_s(rerun, cluster)
