"""torchtitan's TP under torchao's Float8 and torch's async TP, against values derived by hand:
the Float8 TP plan's fp8 all-gathers and shard casts (tensorwise), rowwise's rescaled gradient
GEMMs, and which collectives Inductor's micro-pipeline can fuse (`costing.overlap.unpipelined_tp_comm_s`)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.contracts.overlap import engine_overlap
from meshplan.planner.costing import fp8
from meshplan.planner.costing.collectives import all_gather_time_s, reduce_scatter_time_s
from meshplan.planner.costing.communication import tp_comm_parts_s
from meshplan.planner.costing.device_time import memory_time_s
from meshplan.planner.costing.fp8_layouts import gathered_transpose_times_s
from meshplan.planner.costing.hardware import load_cluster
from meshplan.planner.costing.overlap import exposed_tp_comm_s, unpipelined_tp_comm_s

SEQ = 8192


def config(**kw) -> ParallelConfig:
    base = dict(gpus=8, global_batch=2, tp=8, pp=1, dp=1, microbatch_size=2, sp=True, engine="torchtitan")
    return ParallelConfig(**{**base, **kw})


def fp8_config(recipe: str, **kw) -> ParallelConfig:
    return config(precision="fp8", fp8_recipe=recipe, **kw)


def test_tensorwise_under_torchtitan_gathers_fp8_and_scatters_bf16(llama, h100):
    """A Llama block's two regions, 2 x 8192 tokens x 4096 bf16 per all-gather: torchtitan's Float8
    TP plan (tensorwise) gathers the fp8 cast, 1 byte a value; rowwise, and tensorwise under
    Megatron, gather bf16. Reduce-scatters stay bf16 (the GEMMs' outputs) in every case."""
    block, _ = llama
    link = h100.link_for_group(8, 1)
    size = 2 * SEQ * 4096 * 2.0
    assert block.output_bytes * 2 == pytest.approx(size)
    parts = tp_comm_parts_s(block, fp8_config("tensorwise", recompute="full"), h100, 1.0)
    (gather, scatter), (bwd_gather, bwd_scatter) = parts
    assert gather == pytest.approx(2 * all_gather_time_s(size / 2, 8, link))
    assert scatter == bwd_scatter == pytest.approx(2 * reduce_scatter_time_s(size, 8, link))
    assert bwd_gather == pytest.approx(gather)  # the row Linears' output gradients, cast before the gather
    # no recomputation: torchtitan's Linears keep the gathered inputs, Megatron-LM gathers its shards again
    assert tp_comm_parts_s(block, fp8_config("tensorwise"), h100, 1.0)[1][0] == pytest.approx(gather)
    (megatron_gather, _), (megatron_bwd_gather, _) = tp_comm_parts_s(
        block, fp8_config("tensorwise", engine="megatron"), h100, 1.0)
    assert megatron_bwd_gather == pytest.approx(2 * megatron_gather)
    for bf16_gathers in (fp8_config("rowwise"), fp8_config("tensorwise", engine="megatron"), config()):
        (gather, _), _ = tp_comm_parts_s(block, bf16_gathers, h100, 1.0)
        assert gather == pytest.approx(2 * all_gather_time_s(size, 8, link))
    assert fp8.fp8_tp_gather(block, fp8_config("tensorwise")) and not fp8.fp8_tp_gather(block, fp8_config("rowwise"))
    assert not fp8.fp8_tp_gather(block, fp8_config("tensorwise", engine="megatron"))


def test_torchtitan_runs_tp_only_with_sequence_parallelism():
    """torchtitan's TP plans shard the sequence around the norms, always: a layout without SP is
    refused, naming the fix, and the search offers SP alone under it."""
    from meshplan.planner.search.candidates import _sp_options

    with pytest.raises(ValueError, match=r"torchtitan's tensor parallelism always shards the sequence .* tp=8 "
                                         r"without sequence parallelism is not what it runs: add --sp"):
        config(sp=False)
    assert config(sp=False, engine="megatron").sp is False
    assert _sp_options(8, "torchtitan", False, True) == (True,)
    assert _sp_options(8, "megatron", False, True) == (False, True)


def test_the_float8_tp_plan_casts_on_the_sequence_shard(llama):
    """Cast before the all-gather: a region's input is cast on the rank's 1/tp of the tokens, and
    so is a row Linear's output gradient (cast before its backward all-gather); a column Linear's
    output gradient is its own 1/tp either way. Llama 3 8B: inputs 2 regions x 4096 and o's 4096
    and down's 14336 inputs (already /tp); output gradients q 4096, k and v 1024, up and gate
    14336 (column, /tp), o and down 4096 each (row)."""
    block, info = llama
    shapes = fp8.gemm.block_linear_shapes(block, info, SEQ)
    tokens, tp = 2 * SEQ, 8
    gathered = fp8.cast_values(block, info, tp, 2, 2.0, shapes, tokens)
    sharded = fp8.cast_values(block, info, tp, 2, 2.0, shapes, tokens, on_shard=True)
    assert gathered[0] == pytest.approx(tokens * (2 * 4096 + (4096 + 14336) / tp))
    assert sharded[0] == pytest.approx(tokens * (2 * 4096 + 4096 + 14336) / tp)
    column = 4096 + 2 * 1024 + 2 * 14336
    assert gathered[2] == pytest.approx(tokens * (column / tp + 2 * 4096))
    assert sharded[2] == pytest.approx(tokens * (column + 2 * 4096) / tp)
    assert sharded[1] == gathered[1]  # weights: their own shards either way


def test_a_cast_after_an_all_gather_reads_the_gathered_tensor_whole(llama, h100):
    """Compiled, a cast loses its first read to the kernel that produced its input; an all-gather
    is no such kernel. Rowwise under SP gathers bf16 and casts after: both regions' gathered
    inputs (2 x 4096 a token) and the row Linears' output gradients (o and down, 4096 each, which
    the backward gathers) keep their first 2-byte read; the rest lose it. Tensorwise under
    torchtitan casts before its gathers (on the norm's output): nothing is collective-fed, and
    neither is anything without SP or TP."""
    block, info = llama
    shapes = fp8.gemm.block_linear_shapes(block, info, SEQ)
    tokens, tp = 2 * SEQ, 8
    rowwise = fp8_config("rowwise", torch_compile=True)
    gathered = fp8.collective_cast_values(block, info, rowwise, tp, 2, 2.0, shapes, tokens)
    assert gathered == pytest.approx((tokens * 2 * 4096, tokens * 2 * 4096))
    assert fp8.collective_cast_values(block, info, fp8_config("tensorwise"), tp, 2, 2.0, shapes, tokens) == (0, 0)
    assert fp8.collective_cast_values(block, info, rowwise, 1, 2, 2.0, shapes, tokens) == (0, 0)
    values = fp8.cast_values(block, info, tp, 2, 2.0, shapes, tokens)
    recipe = fp8.RECIPES["rowwise"]
    fwd, bwd = fp8.cast_times_s(recipe, values, 1.0, h100, fused=True, gathered=gathered)
    inputs, weights, grads = values
    expected_fwd = inputs * recipe.activation_cast_bytes - (inputs - gathered[0]) * 2 + weights * recipe.weight_cast_bytes
    expected_bwd = grads * recipe.activation_cast_bytes - (grads - gathered[1]) * 2
    assert (fwd, bwd) == pytest.approx((memory_time_s(expected_fwd, h100), memory_time_s(expected_bwd, h100)))
    eager = fp8.cast_times_s(recipe, values, 1.0, h100, gathered=gathered)  # eager: no read is fused anyway
    assert eager == pytest.approx(fp8.cast_times_s(recipe, values, 1.0, h100))


def test_rowwise_rescales_each_gradient_gemm_output_once(llama, h100):
    """torchao's rowwise gradient GEMMs run the tensorwise kernel and multiply the scales in after:
    one bf16 read and write of every input gradient (tokens x the Linear's local input) and
    weight gradient (its local weight), 4 bytes a value; no other recipe pays it."""
    block, info = llama
    shapes = fp8.gemm.block_linear_shapes(block, info, SEQ)
    tokens, tp = 2 * SEQ, 8
    inputs = 5 * 4096 + (4096 + 14336) / tp            # q, k, v, up, gate whole; o, down /tp
    weights = sum(i * o for i, o, _ in shapes) / tp
    expected = memory_time_s(4 * (tokens * inputs + weights), h100)
    values = fp8.cast_values(block, info, tp, 2, 2.0, shapes, tokens)
    assert fp8.gradient_rescale_s(fp8.RECIPES["rowwise"], shapes, tokens, tp, values, h100) == pytest.approx(expected)
    for other in ("tensorwise", "delayed"):
        assert fp8.gradient_rescale_s(fp8.RECIPES[other], shapes, tokens, tp, values, h100) == 0.0


def test_the_micro_pipeline_fuses_only_collectives_next_to_a_matmul(llama, h100):
    """torch's async TP on a Llama block (q, k, v and up, gate: several column Linears a region).
    bf16 and torchtitan's tensorwise: every gather feeds matmuls (or fp8 matmuls, cast before it)
    and every forward scatter is a row Linear's product; the backward scatters follow a sum of
    input gradients and stay blocking. Rowwise casts after its gathers, so they all block too.
    Megatron's userbuffers pipeline everything."""
    block, _ = llama
    for cfg in (config(tp_comm_overlap=True), fp8_config("tensorwise", tp_comm_overlap=True)):
        parts = tp_comm_parts_s(block, cfg, h100, 1.0)
        assert unpipelined_tp_comm_s(block, cfg, parts) == pytest.approx((0.0, parts[1][1]))
    rowwise = fp8_config("rowwise", tp_comm_overlap=True)
    parts = tp_comm_parts_s(block, rowwise, h100, 1.0)
    assert unpipelined_tp_comm_s(block, rowwise, parts) == pytest.approx((parts[0][0], sum(parts[1])))
    megatron = config(engine="megatron")
    assert unpipelined_tp_comm_s(block, megatron, tp_comm_parts_s(block, megatron, h100, 1.0)) == (0.0, 0.0)


def test_a_region_with_one_column_linear_fuses_its_backward_scatter(llama, h100):
    """GPT-2's fused c_attn and c_fc: one column Linear a region, whose input gradient is one
    matmul's product, so the micro-pipeline fuses the backward reduce-scatter too, unless rowwise
    multiplies its scales in between."""
    block, _ = llama
    fused = replace(block, tp_split=replace(block.tp_split, column_linears=("attn.c_attn", "mlp.c_fc")))
    cfg = config(tp_comm_overlap=True)
    assert unpipelined_tp_comm_s(fused, cfg, tp_comm_parts_s(fused, cfg, h100, 1.0)) == (0.0, 0.0)
    rowwise = fp8_config("rowwise", tp_comm_overlap=True)
    parts = tp_comm_parts_s(fused, rowwise, h100, 1.0)
    assert unpipelined_tp_comm_s(fused, rowwise, parts) == pytest.approx((parts[0][0], sum(parts[1])))


def test_what_stays_exposed_beside_the_pass_compute():
    """10 ms of collectives, 4 of them unpipelined, beside 1 s of GEMMs at tp 8: the 4 ms and one
    eighth of the other 6; beside 3 ms of GEMMs, what they cannot cover (6 - 3)."""
    cfg = config(tp_comm_overlap=True)
    assert exposed_tp_comm_s(0.010, 1.0, "block", cfg, 0.004) == pytest.approx(0.004 + 0.006 / 8)
    assert exposed_tp_comm_s(0.010, 0.003, "block", cfg, 0.004) == pytest.approx(0.004 + 0.003)
    assert exposed_tp_comm_s(0.010, 1.0, "block", config(), 0.004) == 0.010  # async TP off: all of it


def test_an_engine_names_a_known_tp_overlap_pattern():
    assert engine_overlap("torchtitan").tp_overlap_pattern == "micro_pipeline"
    assert engine_overlap("megatron").tp_overlap_pattern == "userbuffers"
    with pytest.raises(ValueError, match="tp_overlap_pattern must be one of userbuffers, micro_pipeline, got 'x'"):
        replace(engine_overlap("torchtitan"), tp_overlap_pattern="x")


def test_float8_all_gather_casts_the_fp32_shard_and_transposes_the_gathered_weight():
    """FSDP2's float8 all-gather (tensorwise under torchtitan): each gather casts the rank's fp32
    shard to fp8 (4 + 1 bytes a shard value), ZeRO-3 gathers twice a micro-batch, and the input
    gradient's GEMM copies the gathered fp8 weight into its transposed layout (1 + 1 bytes a
    value). Over 8 ranks: 2 + 2 x 5 / 8 = 3.25 bytes a weight value, against tensorwise's 8 for a
    bf16 weight; HSDP shards over its group; rowwise (bf16 gathers) and Megatron (cast once a
    step) keep their own rule."""
    fsdp = dict(gpus=8, global_batch=8, tp=1, dp=8, microbatch_size=1, sp=False, engine="torchtitan",
                precision="fp8")
    assert fp8.gathered_weight_cast_bytes(ParallelConfig(**fsdp, fp8_recipe="tensorwise", zero=3)) == 2 + 10 / 8
    assert fp8.gathered_weight_cast_bytes(ParallelConfig(**fsdp, fp8_recipe="tensorwise", zero=3,
                                                         shard_group=4)) == pytest.approx(2 + 10 / 4)
    assert fp8.gathered_weight_cast_bytes(ParallelConfig(**fsdp, fp8_recipe="tensorwise", zero=1)) == 2 + 5 / 8
    assert fp8.gathered_weight_cast_bytes(ParallelConfig(**fsdp, fp8_recipe="rowwise", zero=3)) is None
    assert fp8.gathered_weight_cast_bytes(ParallelConfig(**{**fsdp, "engine": "megatron"}, fp8_recipe="tensorwise",
                                                         zero=1)) is None
    h100 = load_cluster("h100-sxm")
    recipe = fp8.RECIPES["tensorwise"]
    fwd_s, _ = fp8.cast_times_s(recipe, (0.0, 1e9, 0.0), 1.0, h100, weight_bytes=3.25)
    assert fwd_s == pytest.approx(memory_time_s(3.25e9, h100))
    assert fp8.cast_times_s(recipe, (0.0, 1e9, 0.0), 1.0, h100)[0] == pytest.approx(memory_time_s(8e9, h100))


def test_the_float8_tp_plan_copies_each_gathered_fp8_tensor_into_its_transposed_layout(llama, h100):
    """torchtitan's Float8 TP plan casts on the shard (one layout) and gathers fp8; each weight
    gradient then copies the gathered tensor into the other layout (torchao's `preprocess_addmm`),
    a byte read and a byte written per value. Llama 3 8B at TP 8, micro-batch 2 (16,384 tokens):
    gathered inputs 2 regions x 4096 a token, gathered output gradients o's and down's 4096 each.
    Backward: 2 x (2 + 2) x 4096 x 16,384 bytes less the gradients' unwritten shard layout
    (1/8 of theirs); forward: less the inputs' (1/8). Rowwise gathers bf16 and casts after: no copy."""
    block, info = llama
    shapes = fp8.gemm.block_linear_shapes(block, info, SEQ)
    tokens, tp = 2 * SEQ, 8
    inputs, grads = fp8.gathered_values(block, info, 2, 2.0, shapes, tokens)
    assert (inputs, grads) == pytest.approx((tokens * 2 * 4096, tokens * 2 * 4096))
    expected = (memory_time_s(-tokens * 2 * 4096 / 8, h100),
                memory_time_s(2 * tokens * 4 * 4096 - tokens * 2 * 4096 / 8, h100))
    assert gathered_transpose_times_s(inputs, grads, tp, h100) == pytest.approx(expected)
    tensorwise = fp8_config("tensorwise", torch_compile=True)
    linears = fp8.fp8_linears(block, info, tensorwise, "bf16")
    values = fp8.cast_values(block, info, tp, 2, 2.0, shapes, tokens, on_shard=True)
    recipe = fp8.RECIPES["tensorwise"]
    casts = fp8.cast_times_s(recipe, values, 1.0, h100, True, fp8.gathered_weight_cast_bytes(tensorwise))
    priced = fp8._block_cast_times_s(block, info, h100, tensorwise, linears, tp, tokens, 2.0)
    assert priced == pytest.approx((casts[0] + expected[0], casts[1] + expected[1]))
    rowwise = fp8_config("rowwise", torch_compile=True)
    rowwise_values = fp8.cast_values(block, info, tp, 2, 2.0, shapes, tokens)
    gathered = fp8.collective_cast_values(block, info, rowwise, tp, 2, 2.0, shapes, tokens)
    rowwise_casts = fp8.cast_times_s(fp8.RECIPES["rowwise"], rowwise_values, 1.0, h100, True, None, gathered)
    rescale = fp8.gradient_rescale_s(fp8.RECIPES["rowwise"], shapes, tokens, tp, rowwise_values, h100)
    assert fp8._block_cast_times_s(block, info, h100, rowwise, linears, tp, tokens, 2.0) == pytest.approx(
        (rowwise_casts[0], rowwise_casts[1] + rescale))
