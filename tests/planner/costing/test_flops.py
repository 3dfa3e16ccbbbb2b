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


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_the_simulator_reports_mfu_and_hfu_from_model_and_executed_flops(recompute):
    graph, cluster = profile(SPEC, SEQ), load_cluster("h100-sxm")
    config = ParallelConfig(gpus=8, global_batch=16, dp=8, microbatch_size=1, recompute=recompute)
    simulated = simulate_config(graph, cluster, config)
    recomputes = [recompute if layer.kind == "block" else "none" for layer in graph.layers]
    executed = executed_flops_per_step(graph, 16, recomputes)
    step_s = simulated.step_time_s
    model_flops = sum(layer.fwd_flops + layer.bwd_flops for layer in graph.layers) * 16  # MFU: attention whole
    assert model_flops_per_step(graph, 16) == model_flops
    assert simulated.model_tflops_per_gpu == pytest.approx(model_flops / step_s / 8e12)
    assert simulated.hw_tflops_per_gpu == pytest.approx(executed / step_s / 8e12)
    # at 4096 tokens and hidden 512 attention dominates: half of it is never run
    assert simulated.hfu < simulated.mfu
