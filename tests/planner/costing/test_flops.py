"""Model FLOPs (MFU) against executed FLOPs (HFU): the simulator counts both from `costing.flops`,
whose causal-attention and recomputation rules are worked out here by hand."""
from __future__ import annotations

import pytest

from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.costing.flops import executed_flops_per_sample, executed_flops_per_step, model_flops_per_step
from meshplan.planner.costing.hardware import load_cluster
from meshplan.planner.profiling.profiler import profile
from meshplan.planner.simulation.simulator import simulate_config

SPEC, SEQ = "gpt:layers=4,hidden=512,heads=8,vocab=1024", 4096


def test_a_causal_flash_block_executes_its_flops_less_three_masked_halves():
    graph = profile(SPEC, SEQ)
    block = next(layer for layer in graph.layers if layer.kind == "block")
    h, s = 512, SEQ
    masked = 2 * h * s * (s - 1)  # forward: the masked s(s-1)/2 entries of QK^T and of x V, 2 FLOPs each
    assert block.fwd_flops - block.causal_fwd_flops == masked
    expected = block.fwd_flops + block.bwd_flops - 3 * masked  # backward skips twice the forward's share
    assert executed_flops_per_sample(block, "none", graph.info, graph.dtype, "flash") == expected
    # full recomputation runs the causal forward once more; math attention computes every product
    assert executed_flops_per_sample(block, "full", graph.info, graph.dtype, "flash") == (
        expected + block.fwd_flops - masked)
    assert executed_flops_per_sample(block, "none", graph.info, graph.dtype, "math") == (
        block.fwd_flops + block.bwd_flops)
    # under torch's early stop (meshplan's executor, torchtitan) the MLP's down projection (4h -> h)
    # is not rerun; Megatron-Core's checkpoint reruns the whole forward
    down = 2 * s * 4 * h * h
    for engine, left_out in (("meshplan", down), ("torchtitan", down), ("megatron", 0)):
        config = ParallelConfig(gpus=1, global_batch=1, dp=1, microbatch_size=1, recompute="full", engine=engine)
        assert executed_flops_per_sample(block, "full", graph.info, graph.dtype, "flash", config) == (
            expected + block.fwd_flops - masked - left_out), engine


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_the_simulator_reports_mfu_and_hfu_from_model_and_executed_flops(recompute):
    graph, cluster = profile(SPEC, SEQ), load_cluster("h100-sxm")
    config = ParallelConfig(gpus=8, global_batch=16, dp=8, microbatch_size=1, recompute=recompute)
    simulated = simulate_config(graph, cluster, config)
    recomputes = [recompute if layer.kind == "block" else "none" for layer in graph.layers]
    executed = executed_flops_per_step(graph, 16, recomputes, config)
    step_s = simulated.step_time_s
    model_flops = sum(layer.fwd_flops + layer.bwd_flops for layer in graph.layers) * 16  # MFU: attention whole
    assert model_flops_per_step(graph, 16) == model_flops
    assert simulated.model_tflops_per_gpu == pytest.approx(model_flops / step_s / 8e12)
    assert simulated.hw_tflops_per_gpu == pytest.approx(executed / step_s / 8e12)
    # at 4096 tokens and hidden 512 attention dominates: half of it is never run
    assert simulated.hfu < simulated.mfu


def test_full_recomputation_reruns_what_torch_reruns_in_the_executor():
    """The executor's full recomputation (`apply_recompute`, torch.utils.checkpoint non-reentrant)
    as torch's FlopCounterMode counts one block's backward, against the same block without it: the
    forward's Linears again, less the MLP's down projection, which torch's early stop never
    reruns (exact; FlopCounterMode counts no FLOPs for the CPU attention kernel, so the Linears
    alone are compared). The cost model's executed FLOPs rerun the same, attention included."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from meshplan.executor.parallel.recompute import apply_recompute
    from meshplan.planner.models.registry import build_model

    spec, seq = "gpt:layers=1,hidden=64,heads=4,vocab=128", 32
    graph = profile(spec, seq)
    layer = next(layer for layer in graph.layers if layer.kind == "block")
    counted = {}
    for mode in ("none", "full"):
        block = build_model(spec, seq, device="cpu").module.blocks[0]
        apply_recompute(block, mode)
        out = block(torch.randn(1, seq, 64, requires_grad=True))
        with FlopCounterMode(display=False) as counter:
            out.sum().backward()
        counted[mode] = counter.get_total_flops()
    down = 2 * seq * 4 * 64 * 64
    assert counted["full"] - counted["none"] == layer.fwd_flops - layer.attn_fwd_flops - down
    config = ParallelConfig(gpus=1, global_batch=1, dp=1, microbatch_size=1, recompute="full")
    rerun = (executed_flops_per_sample(layer, "full", graph.info, graph.dtype, "math", config)
             - executed_flops_per_sample(layer, "none", graph.info, graph.dtype, "math", config))
    assert rerun == layer.fwd_flops - down


def test_early_stop_takes_the_down_projections_forward_off_the_recomputation_time():
    """Full recomputation's seconds: the forward's under Megatron-Core (it reruns everything), the
    forward less the down projection's GEMM by shape under meshplan's executor and torchtitan."""
    from meshplan.planner.costing import gemm
    from meshplan.planner.costing.compute_time import compute_times_s

    graph, cluster = profile(SPEC, SEQ), load_cluster("h100-sxm")
    block = next(layer for layer in graph.layers if layer.kind == "block")
    down_s = gemm.linear_times_s(((4 * 512, 512, False),), 2 * SEQ, 1, cluster, "bf16")[0]
    for engine, left_out_s in (("megatron", 0.0), ("meshplan", down_s), ("torchtitan", down_s)):
        config = ParallelConfig(gpus=8, global_batch=16, dp=8, microbatch_size=2, recompute="full", engine=engine)
        fwd_s, _, recompute_s = compute_times_s(block, config, cluster, graph.info, 1.0, 1.0, graph.dtype)
        assert down_s > 0 and recompute_s == pytest.approx(fwd_s - left_out_s, rel=1e-12), engine
