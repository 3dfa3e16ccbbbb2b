"""Model FLOPs (MFU) against executed FLOPs (HFU): the closed form and the simulator count both
the same way, from `costing.flops`."""
from __future__ import annotations

import pytest

from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.costing.flops import executed_flops_per_sample, executed_flops_per_step, model_flops_per_step
from meshplan.planner.costing.hardware import load_cluster
from meshplan.planner.profiling.profiler import profile
from meshplan.planner.simulation.estimator import predict
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
def test_closed_form_and_simulator_report_the_same_mfu_and_hfu(recompute):
    graph, cluster = profile(SPEC, SEQ), load_cluster("h100-sxm")
    config = ParallelConfig(gpus=8, global_batch=16, dp=8, microbatch_size=1, recompute=recompute)
    closed, simulated = predict(graph, cluster, config), simulate_config(graph, cluster, config)
    recomputes = [recompute if layer.kind == "block" else "none" for layer in graph.layers]
    executed = executed_flops_per_step(graph, 16, recomputes)
    for prediction in (closed, simulated):
        step_s = prediction.step_time_s
        assert prediction.model_tflops_per_gpu == pytest.approx(model_flops_per_step(graph, 16) / step_s / 8e12)
        assert prediction.hw_tflops_per_gpu == pytest.approx(executed / step_s / 8e12)
    # at 4096 tokens and hidden 512 attention dominates: half of it is never run
    assert simulated.hfu < simulated.mfu
