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


@pytest.mark.parametrize("early_stop", [True, False])
def test_full_recomputation_reruns_what_torch_reruns_in_the_executor(early_stop):
    """The executor's full recomputation (`apply_recompute`, torch.utils.checkpoint non-reentrant)
    as torch's FlopCounterMode counts one block's backward, against the same block without it: the
    forward's Linears again, less the MLP's down projection where torch's early stop is on (its
    default), which then never reruns it; all of them with it off (exact; FlopCounterMode counts
    no FLOPs for the CPU attention kernel, so the Linears alone are compared). The cost model's
    executed FLOPs, with the plan's `recompute_early_stop` alike, rerun the same, attention included."""
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
        apply_recompute(block, mode, early_stop)
        out = block(torch.randn(1, seq, 64, requires_grad=True))
        with FlopCounterMode(display=False) as counter:
            out.sum().backward()
        counted[mode] = counter.get_total_flops()
    down = 2 * seq * 4 * 64 * 64 if early_stop else 0
    assert counted["full"] - counted["none"] == layer.fwd_flops - layer.attn_fwd_flops - down
    config = ParallelConfig(gpus=1, global_batch=1, dp=1, microbatch_size=1, recompute="full",
                            recompute_early_stop=early_stop)
    rerun = (executed_flops_per_sample(layer, "full", graph.info, graph.dtype, "math", config)
             - executed_flops_per_sample(layer, "none", graph.info, graph.dtype, "math", config))
    assert rerun == layer.fwd_flops - down


def test_early_stop_takes_the_down_projections_forward_off_the_recomputation_time():
    """Full recomputation's seconds: the forward's under Megatron-Core (it reruns everything) and
    wherever the early stop is turned off, the forward less the down projection's GEMM by shape
    under meshplan's executor, torchtitan and llm-foundry (torch's non-reentrant checkpoint)."""
    from meshplan.planner.costing import gemm
    from meshplan.planner.costing.compute_time import compute_times_s

    graph, cluster = profile(SPEC, SEQ), load_cluster("h100-sxm")
    block = next(layer for layer in graph.layers if layer.kind == "block")
    down_s = gemm.linear_times_s(((4 * 512, 512, False),), 2 * SEQ, 1, cluster, "bf16")[0]
    cases = (("megatron", None, 0.0), ("meshplan", None, down_s), ("torchtitan", None, down_s),
             ("llm-foundry", None, down_s), ("llm-foundry", False, 0.0), ("generic", None, 0.0),
             ("generic", True, down_s))
    for engine, early_stop, left_out_s in cases:
        config = ParallelConfig(gpus=8, global_batch=16, dp=8, microbatch_size=2, recompute="full", engine=engine,
                                recompute_early_stop=early_stop)
        fwd_s, _, recompute_s = compute_times_s(block, config, cluster, graph.info, 1.0, 1.0, graph.dtype)
        assert down_s > 0 and recompute_s == pytest.approx(fwd_s - left_out_s, rel=1e-12), engine


def test_recompute_early_stop_is_kept_only_apart_from_the_engines_rule():
    """`ParallelConfig.recompute_early_stop`: what the engine does anyway is stored as None (equal
    layouts compare equal), a departure is kept, and an early stop asked of a reentrant engine
    (Megatron-Core, DeepSpeed) is refused with the engines that can run it."""
    def config(engine, early_stop):
        return ParallelConfig(gpus=8, global_batch=16, dp=8, microbatch_size=2, recompute="full", engine=engine,
                              recompute_early_stop=early_stop)

    assert config("torchtitan", True) == config("torchtitan", None)
    assert config("megatron", False).recompute_early_stop is None
    assert config("llm-foundry", False).recompute_early_stop is False
    assert config("generic", True).recompute_early_stop is True
    for engine in ("megatron", "deepspeed"):
        with pytest.raises(ValueError, match="reentrant.*meshplan, torchtitan, llm-foundry"):
            config(engine, True)
    with pytest.raises(ValueError, match="true, false or null"):
        config("meshplan", "yes")
