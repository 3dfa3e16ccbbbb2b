"""torch's fused collective-matmuls (`costing.fused_tp`): each fused collective of a Llama 3 8B block
at TP 8 against its own matmuls, counted by hand from the GEMMs' prices (`gemm.gemm_time_s`)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.costing import fused_tp
from meshplan.planner.costing.communication import tp_comm_parts_s
from meshplan.planner.costing.gemm import gemm_time_s
from meshplan.planner.costing.layer_cost import layer_cost
from meshplan.planner.costing.overlap import unpipelined_tp_comm_s

SEQ, MBS, TP = 8192, 2, 8
TOKENS = MBS * SEQ


def config(**kw) -> ParallelConfig:
    base = dict(gpus=8, global_batch=MBS, tp=TP, pp=1, dp=1, microbatch_size=MBS, sp=True, engine="torchtitan",
                tp_comm_overlap=True, recompute="selective")
    return ParallelConfig(**{**base, **kw})


def chunked(rows: float, n: int, k: int, h100) -> float:
    """A GEMM of `rows` x k @ k x n run as TP row chunks, as the fused op runs it."""
    return TP * gemm_time_s(rows / TP, n, k, h100, "bf16")


def exposed(comm_s: float, matmul_s: float) -> float:
    return max(comm_s / TP, comm_s - matmul_s)


def test_each_fused_collective_hides_behind_its_own_matmuls_only(llama, h100):
    """bf16, per-op checkpointing. Forward: attention's all-gather beside q (4096 -> 512 a rank),
    k and v (4096 -> 128), the MLP's beside up and gate (4096 -> 1792); o's reduce-scatter beside o
    (512 -> 4096), down's beside down (1792 -> 4096). Backward: o's and down's output-gradient
    all-gathers beside their input-gradient GEMMs; the reduce-scatters after q, k, v and up, gate
    (several column Linears a region) stay blocking, the caller's."""
    block, info = llama
    cfg = config()
    (gathers, scatters), (bwd_gathers, bwd_scatters) = parts = tp_comm_parts_s(block, cfg, h100, 1.0)
    gather, scatter = gathers / 2, scatters / 2
    qkv = chunked(TOKENS, 512, 4096, h100) + 2 * chunked(TOKENS, 128, 4096, h100)
    up_gate = 2 * chunked(TOKENS, 1792, 4096, h100)
    o, down = chunked(TOKENS, 4096, 512, h100), chunked(TOKENS, 4096, 1792, h100)
    o_dgrad, down_dgrad = chunked(TOKENS, 512, 4096, h100), chunked(TOKENS, 1792, 4096, h100)
    forward = exposed(gather, qkv) + exposed(gather, up_gate) + exposed(scatter, o) + exposed(scatter, down)
    backward = exposed(bwd_gathers / 2, o_dgrad) + exposed(bwd_gathers / 2, down_dgrad)
    assert fused_tp.exposed_fused_s(block, cfg, h100, info, parts, "bf16") == pytest.approx((forward, backward))
    assert unpipelined_tp_comm_s(block, cfg, parts) == pytest.approx((0.0, bwd_scatters))
    # attention's narrow matmuls leave most of its gather and of o's scatter exposed; the MLP's hide theirs
    assert exposed(gather, qkv) > gather / TP and exposed(scatter, o) > scatter / TP
    assert exposed(gather, up_gate) == pytest.approx(gather / TP)


def test_layer_cost_charges_the_fused_exposure_and_the_blocking_rest(llama, h100):
    """`layer_cost`'s TP seconds: the unfused collectives whole plus the fused ones' exposure,
    the per-op policy's rerun repeating half the forward's (its all-gathers)."""
    block, info = llama
    cfg = config()
    parts = tp_comm_parts_s(block, cfg, h100, 1.0)
    fwd_s, bwd_s = fused_tp.exposed_fused_s(block, cfg, h100, info, parts, "bf16")
    _, unfused_bwd_s = unpipelined_tp_comm_s(block, cfg, parts)
    cost = layer_cost(block, cfg, h100, info)
    pass_s = cost.tp_fwd_comm_s - fwd_s  # DTensor's fixed per-pass dispatch, the same both ways
    assert pass_s >= 0
    assert cost.tp_bwd_comm_s == pytest.approx(unfused_bwd_s + bwd_s + pass_s + 0.5 * (fwd_s + pass_s))


def test_nothing_fused_without_async_tp_or_known_shapes(llama, h100):
    """Blocking TP, Megatron's userbuffers (the whole-pass rule) and a traced block: None."""
    block, info = llama
    for cfg in (config(tp_comm_overlap=False), config(engine="megatron", recompute="full")):
        assert fused_tp.exposed_fused_s(block, cfg, h100, info, tp_comm_parts_s(block, cfg, h100, 1.0), "bf16") is None
    unknown = replace(info, num_heads=0)
    cfg = config()
    assert fused_tp.exposed_fused_s(block, cfg, h100, unknown, tp_comm_parts_s(block, cfg, h100, 1.0), "bf16") is None


def test_fused_backward_scatters_pair_with_their_regions_input_gradients(llama, h100):
    """A block with one column Linear a region (GPT-2's fused c_attn and c_fc): the micro-pipeline
    fuses both backward reduce-scatters too, each beside its region's input-gradient GEMMs (here
    unchunked: `overlap.micro_pipeline_pieces` chunks a single MLP column only), and nothing of the
    backward stays blocking."""
    block, info = llama
    fused = replace(block, tp_split=replace(block.tp_split, column_linears=("attn.c_attn", "mlp.c_fc")))
    cfg = config()
    parts = tp_comm_parts_s(fused, cfg, h100, 1.0)
    (_, _), (bwd_gathers, bwd_scatters) = parts
    qkv_dgrad = gemm_time_s(TOKENS, 4096, 512, h100, "bf16") + 2 * gemm_time_s(TOKENS, 4096, 128, h100, "bf16")
    up_gate_dgrad = 2 * gemm_time_s(TOKENS, 4096, 1792, h100, "bf16")
    o_dgrad, down_dgrad = chunked(TOKENS, 512, 4096, h100), chunked(TOKENS, 1792, 4096, h100)
    backward = (exposed(bwd_gathers / 2, o_dgrad) + exposed(bwd_gathers / 2, down_dgrad)
                + exposed(bwd_scatters / 2, qkv_dgrad) + exposed(bwd_scatters / 2, up_gate_dgrad))
    assert unpipelined_tp_comm_s(fused, cfg, parts) == (0.0, 0.0)
    assert fused_tp.exposed_fused_s(fused, cfg, h100, info, parts, "bf16")[1] == pytest.approx(backward)
