"""torch's micro-pipelined TP (torchtitan's async TP) runs each fused GEMM as tp row chunks and sums
the partials of each fused reduce-scatter itself (`overlap.micro_pipeline_pieces`,
`overlap.micro_pipeline_reduce_s`): against GEMM times and memory traffic derived by hand."""
from __future__ import annotations

from dataclasses import replace

import pytest

from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.costing import gemm
from meshplan.planner.costing.compute_time import compute_times_s
from meshplan.planner.costing.device_time import memory_time_s
from meshplan.planner.costing.overlap import micro_pipeline_pieces, micro_pipeline_reduce_s
from meshplan.planner.profiling.profiler import profile

SEQ = 8192


def _block(spec, seq=SEQ):
    graph = profile(spec, seq)
    block = next(layer for layer in graph.layers if layer.kind == "block")
    return graph, block, gemm.block_linear_shapes(block, graph.info, seq)


def config(**kw) -> ParallelConfig:
    base = dict(gpus=8, global_batch=2, tp=8, pp=1, dp=1, microbatch_size=2, sp=True, engine="torchtitan",
                tp_comm_overlap=True, torch_compile=True)  # async TP runs compiled
    return ParallelConfig(**{**base, **kw})


def test_chunked_gemms_are_tp_gemms_of_a_tp_th_of_the_rows(h100):
    """A (forward, input-gradient) chunk count of n prices n GEMMs of rows / n; the weight
    gradient stays one GEMM over every row."""
    shapes = ((4096, 1024, True), (4096, 4096, False))
    tokens, tp = 16384, 8
    fwd_s, bwd_s = gemm.linear_times_s(shapes, tokens, tp, h100, "bf16", pieces=((8, 1), (8, 8)))
    want_fwd = 8 * gemm.gemm_time_s(tokens / 8, 128, 4096, h100, "bf16") + \
        8 * gemm.gemm_time_s(tokens / 8, 4096, 512, h100, "bf16")
    want_bwd = (gemm.gemm_time_s(tokens, 4096, 128, h100, "bf16") + gemm.gemm_time_s(4096, 128, tokens, h100, "bf16")
                + 8 * gemm.gemm_time_s(tokens / 8, 512, 4096, h100, "bf16")
                + gemm.gemm_time_s(512, 4096, tokens, h100, "bf16"))
    assert (fwd_s, bwd_s) == pytest.approx((want_fwd, want_bwd), rel=1e-12)
    assert gemm.linear_times_s(shapes, tokens, tp, h100, "bf16", pieces=((1, 1), (1, 1))) == \
        gemm.linear_times_s(shapes, tokens, tp, h100, "bf16")


def test_which_gemms_the_micro_pipeline_chunks():
    """Llama's block: every forward GEMM (its all-gathers and reduce-scatters fuse) and the row
    Linears' input gradients (their output gradients' all-gathers fuse); not the column Linears'
    input gradients, whose regions sum several before the reduce-scatter. GPT's single up
    projection's does. Under rowwise fp8 the casts after the gathers and the gradient rescales
    keep the gathers and the backward scatters unfused; vanilla TP and Megatron's userbuffers chunk
    nothing here."""
    _, llama, llama_shapes = _block("llama3-8b")
    assert micro_pipeline_pieces(llama, config(), llama_shapes) == ((8, 1),) * 3 + ((8, 8),) + ((8, 1),) * 2 + ((8, 8),)
    _, gpt, gpt_shapes = _block("gpt:layers=2,hidden=1024,heads=16,vocab=1024", 1024)
    assert micro_pipeline_pieces(gpt, config(), gpt_shapes)[4:] == ((8, 8), (8, 8))
    rowwise = config(precision="fp8", fp8_recipe="rowwise")
    assert micro_pipeline_pieces(llama, rowwise, llama_shapes) == ((1, 1),) * 3 + ((8, 1),) + ((1, 1),) * 2 + ((8, 1),)
    assert micro_pipeline_pieces(llama, config(tp_comm_overlap=False), llama_shapes) is None
    assert micro_pipeline_pieces(llama, config(engine="megatron", torch_compile=False), llama_shapes) is None


def test_fused_reduce_scatters_sum_their_partials_in_memory(h100):
    """Each fused matmul-reduce-scatter reads the tp partial chunks landed on the rank (every row of
    the product, bf16) and writes its own: 2 x (1 + 1/tp) bytes per output value, forward for o
    and down (hidden wide), backward for GPT's single up projection's input gradient."""
    _, llama, shapes = _block("llama3-8b")
    tokens = 2 * SEQ
    fwd_s, bwd_s = micro_pipeline_reduce_s(llama, config(), shapes, tokens, h100)
    assert fwd_s == pytest.approx(memory_time_s(2 * tokens * 4096 * 2.0 * (1 + 1 / 8), h100))
    assert bwd_s == 0.0
    _, gpt, gpt_shapes = _block("gpt:layers=2,hidden=1024,heads=16,vocab=1024", 1024)
    _, gpt_bwd = micro_pipeline_reduce_s(gpt, config(), gpt_shapes, 2 * 1024, h100)
    assert gpt_bwd == pytest.approx(memory_time_s(2 * 1024 * 1024 * 2.0 * (1 + 1 / 8), h100))


def test_async_tp_block_compute_adds_exactly_the_chunking_and_the_sums(h100):
    """A Llama block's compute under async TP exceeds vanilla TP's by the chunked GEMMs' extra
    seconds plus the sums, nothing else (the overlap itself is priced on the collectives)."""
    graph, block, shapes = _block("llama3-8b")
    async_tp, vanilla = config(), config(tp_comm_overlap=False)
    times = {cfg.tp_comm_overlap: compute_times_s(block, cfg, h100, graph.info, 1.0, 1.0, graph.dtype, graph.attention)
             for cfg in (async_tp, vanilla)}
    tokens = 2 * SEQ
    pieces = micro_pipeline_pieces(block, async_tp, shapes)
    chunked = gemm.linear_times_s(shapes, tokens, 8, h100, "bf16", pieces=pieces)
    whole = gemm.linear_times_s(shapes, tokens, 8, h100, "bf16")
    sums = micro_pipeline_reduce_s(block, async_tp, shapes, tokens, h100)
    for index in (0, 1):
        extra = chunked[index] - whole[index] + sums[index]
        assert extra > 0
        assert times[True][index] - times[False][index] == pytest.approx(extra, rel=1e-9)
    fp8_async = replace(async_tp, precision="fp8", fp8_recipe="tensorwise")
    fp8_vanilla = replace(fp8_async, tp_comm_overlap=False)
    fp8_times = [compute_times_s(block, cfg, h100, graph.info, 1.0, 1.0, graph.dtype, graph.attention)[0]
                 for cfg in (fp8_async, fp8_vanilla)]
    assert fp8_times[0] > fp8_times[1]
