"""Megatron-Core without a TP overlap: each column Linear's backward all-gather and reduce-scatter
beside its own GEMMs (`costing.tp_backward`), against the rule worked by hand on Llama 3 8B's block
at TP 8 (8,192 tokens, 64 MiB a collective). The hand sums and `layer_cost` add the same terms, so
they agree to 1e-12 relative."""
from __future__ import annotations

import pytest

from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.costing import tp_backward
from meshplan.planner.costing.collectives import all_gather_time_s, all_reduce_time_s, reduce_scatter_time_s
from meshplan.planner.costing.communication import tp_comm_parts_s
from meshplan.planner.costing.fused_tp import block_regions
from meshplan.planner.costing.gemm import gemm_time_s
from meshplan.planner.costing.layer_cost import layer_cost
from meshplan.planner.profiling.profiler import profile

TP, HIDDEN, KV, FFN = 8, 4096, 1024, 14336
COLUMNS = {"attention": ((HIDDEN, HIDDEN), (HIDDEN, KV), (HIDDEN, KV)),  # q, k, v: (in, out)
           "mlp": ((HIDDEN, FFN), (HIDDEN, FFN))}                        # up, gate


def megatron(**changes) -> ParallelConfig:
    base = dict(gpus=8, global_batch=1, tp=TP, pp=1, dp=1, microbatch_size=1, sp=True, engine="megatron",
                tp_comm_overlap=False)
    return ParallelConfig(**{**base, **changes})


def _column_gemms_s(region: str, tokens: int, h100) -> tuple[float, float]:
    """(input-gradient, weight-gradient) seconds of a region's column Linears at TP 8, by hand; the
    weight gradients accumulate into Megatron's fp32 `main_grad` (4 bytes, read and written)."""
    shapes = COLUMNS[region]
    dgrad = sum(gemm_time_s(tokens, in_dim, out_dim / TP, h100, "bf16") for in_dim, out_dim in shapes)
    wgrad = sum(gemm_time_s(in_dim, out_dim / TP, tokens, h100, "bf16", accumulate_bytes=4)
                for in_dim, out_dim in shapes)
    return dgrad, wgrad


def test_each_column_collective_exposes_what_its_gemm_does_not_cover(llama, h100):
    """Without recomputation: the two row Linears' output-gradient gathers block; each region's
    regather runs beside its column input gradients and its input gradient's reduce-scatter beside
    their weight gradients. Attention's q, k, v input gradients (k, v 128 outputs a rank) are shorter
    than the 64 MiB regather, the MLP's up and gate are not: both branches of max(0, c - g)."""
    block, info = llama
    tokens = 8192
    size = block.output_bytes
    assert size == tokens * HIDDEN * 2
    link = h100.link_for_group(TP, 1)
    gather, scatter = all_gather_time_s(size, TP, link), reduce_scatter_time_s(size, TP, link)
    attention, mlp = _column_gemms_s("attention", tokens, h100), _column_gemms_s("mlp", tokens, h100)
    assert attention[0] < gather < mlp[0]
    expected = 2 * gather + sum(max(0.0, gather - dgrad) + max(0.0, scatter - wgrad)
                                for dgrad, wgrad in (attention, mlp))
    cost = layer_cost(block, megatron(), h100, info)
    assert cost.tp_bwd_comm_s == pytest.approx(expected, rel=1e-12)
    assert cost.tp_fwd_comm_s == pytest.approx(2 * gather + 2 * scatter, rel=1e-12)  # the forward blocks
    assert cost.tp_bwd_comm_s < sum(tp_comm_parts_s(block, megatron(), h100, 1.0)[1])


def test_a_recomputed_block_still_regathers_and_sequence_parallelism_off_overlaps_the_all_reduces(llama, h100):
    """Under full recomputation Transformer Engine's rerun forward saves the sequence shard again, so
    the backward regathers as without it (beside the input gradients), and the rerun forward's
    collectives block once more; without SP each region's input-gradient all-reduce runs beside its
    weight gradients (Transformer Engine's `allreduce(..., async_op=True)`)."""
    block, info = llama
    tokens, size = 8192, block.output_bytes
    link = h100.link_for_group(TP, 1)
    gather, scatter = all_gather_time_s(size, TP, link), reduce_scatter_time_s(size, TP, link)
    gemms = [_column_gemms_s(region, tokens, h100) for region in COLUMNS]
    full = layer_cost(block, megatron(recompute="full"), h100, info)
    rerun = 2 * gather + 2 * scatter
    beside = sum(max(0.0, gather - dgrad) + max(0.0, scatter - wgrad) for dgrad, wgrad in gemms)
    assert full.tp_bwd_comm_s == pytest.approx(2 * gather + beside + rerun, rel=1e-12)
    reduce = all_reduce_time_s(size, TP, link)
    no_sp = layer_cost(block, megatron(sp=False), h100, info)
    assert no_sp.tp_bwd_comm_s == pytest.approx(sum(max(0.0, reduce - wgrad) for _, wgrad in gemms), rel=1e-12)
    assert no_sp.tp_fwd_comm_s == pytest.approx(2 * reduce, rel=1e-12)


def test_which_engines_gather_a_kept_shard_again():
    """Megatron's Linears keep the shard in every forward, a recomputed one's too; torchtitan's keep
    the gathered input; meshplan's executor keeps the shard, and a recomputed block its rerun's gather."""
    from meshplan.planner.costing.communication import regathers

    for recompute in ("none", "selective", "full"):
        executor = megatron(engine="meshplan", tp_comm_overlap=None, recompute=recompute)
        assert regathers(megatron(recompute=recompute))
        assert not regathers(megatron(engine="torchtitan", tp_comm_overlap=None, recompute=recompute))
        assert regathers(executor) == (recompute == "none")


def test_only_megatron_without_its_overlap(llama, h100):
    """Megatron's userbuffers keep the whole-pass rule and the engines that block keep blocking."""
    block, info = llama
    parts = tp_comm_parts_s(block, megatron(), h100, 1.0)
    assert tp_backward.exposed_backward_s(block, megatron(tp_comm_overlap=None), h100, info, parts, "bf16") is None
    meshplan = megatron(engine="meshplan", tp_comm_overlap=None)
    assert tp_backward.exposed_backward_s(block, meshplan, h100, info, parts, "bf16") is None
    assert layer_cost(block, meshplan, h100, info).tp_bwd_comm_s == pytest.approx(sum(parts[1]), rel=1e-12)


def test_a_moe_block_s_attention_region_alone_and_unknown_shapes_block(h100):
    """A MoE block without shared experts has one TP region, attention's (`expert_parallel.
    moe_tp_regions`): its regather and scatter beside q, k and v's GEMMs (4 x 512 tokens, hidden 512
    over TP 8: 64 outputs a rank each, shorter than the collectives), o's gradient gather whole.
    Shapes that make no region (a traced layer's none) keep the blocking rule."""
    from meshplan.planner.costing.expert_parallel import dense_part

    graph = profile("moe:layers=2,hidden=512,heads=8,kv_heads=8,experts=4,top_k=2,expert_ffn=512,vocab=1024", 512)
    block = next(layer for layer in graph.layers if layer.kind == "block")
    config = megatron(global_batch=4, microbatch_size=4)
    dense = dense_part(block, graph.info)
    assert dense.tp_split.num_allreduce_per_pass == 1
    tokens, size = 4 * 512, 4 * 512 * 512 * 2.0
    link = h100.link_for_group(TP, 1)
    gather, scatter = all_gather_time_s(size, TP, link), reduce_scatter_time_s(size, TP, link)
    dgrad = 3 * gemm_time_s(tokens, 512, 512 / TP, h100, "bf16")
    wgrad = 3 * gemm_time_s(512, 512 / TP, tokens, h100, "bf16")
    expected = gather + max(0.0, gather - dgrad) + max(0.0, scatter - wgrad)
    assert layer_cost(block, config, h100, graph.info).tp_bwd_comm_s == pytest.approx(expected, rel=1e-12)
    assert expected < sum(tp_comm_parts_s(dense, config, h100, 1.0)[1])
    assert block_regions((), 2) is None
    assert block_regions(((512, 512, True),) * 3 + ((512, 512, False),), 2) is None  # no MLP region


def test_a_region_ends_at_each_row_linear():
    """A Llama block's two regions (q, k, v, o | gate, up, down), a Mamba-2 mixer's one (in_proj |
    out_proj ends it), an MLP-only layer's one; shapes ending on a column Linear, or a region without
    one, make none."""
    attention = ((512, 512, True),) * 3 + ((512, 512, False),)
    mlp = ((512, 1024, True),) * 2 + ((1024, 512, False),)
    mamba = ((512, 2176, True), (1024, 512, False))
    assert block_regions(attention + mlp, 2) == (range(0, 4), range(4, 7))
    assert block_regions(mamba, 1) == (range(0, 2),) and block_regions(mlp[1:], 1) == (range(0, 2),)
    assert block_regions(mamba, 2) is None and block_regions(attention + mlp, 1) is None
    assert block_regions(attention + mlp[:1], 2) is None  # ends on a column Linear
    assert block_regions(((512, 512, False),) * 2, 2) is None  # a region without a column Linear
