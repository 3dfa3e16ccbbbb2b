"""Time of Megatron-Core's --recompute-modules (`costing.module_recompute`): each named module's
forward runs again in backward, priced from its GEMMs by shape and the bytes the memory recipe
says it drops; the attention core alone is the default selective recomputation's.

Expected values are built from the parts `layer_cost` reports (the routed experts' forward, the EP
forward exchanges) and from `gemm`'s shape rule, independently of the module's own sums; the
tolerance is floating-point only (1e-9 relative)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.costing import gemm
from meshplan.planner.costing.device_time import memory_time_s
from meshplan.planner.costing.hardware import load_cluster
from meshplan.planner.costing.layer_cost import layer_cost
from meshplan.planner.costing.moe_compute import router_times_s
from meshplan.planner.profiling.profiler import profile

SEQ = 4096
H100 = load_cluster("h100-sxm")


def _block(graph, moe: bool):
    return next(layer for layer in graph.layers if layer.kind == "block" and bool(layer.expert_params) == moe)


def _cost(graph, layer, config):
    return layer_cost(layer, config, H100, graph.info, profile_dtype=graph.dtype, attention="cudnn")


def _qwen3_config(**changes) -> ParallelConfig:
    base = dict(gpus=256, global_batch=2048, tp=2, pp=8, dp=16, sp=True, zero=1, ep=32, etp=1,
                schedule="interleaved", virtual_stages=4, engine="megatron", recompute="selective")
    return ParallelConfig(**{**base, **changes})


def test_core_attn_named_is_the_default_selective_recomputation():
    graph = profile("qwen3-235b-a22b", SEQ, attention="cudnn")
    block = _block(graph, moe=True)
    default = _cost(graph, block, _qwen3_config())
    named = _cost(graph, block, _qwen3_config(recompute_modules=("core_attn",)))
    assert default.recompute_s > 0
    assert named.recompute_s == pytest.approx(default.recompute_s, rel=1e-9)


def test_moe_module_reruns_the_experts_router_and_exchanges():
    """`moe`: the routed experts' forward, the gate's, and the dispatch and combine again in
    backward; `layernorm` adds the MoE norm's output traffic (h b /tp per token under SP)."""
    graph = profile("qwen3-235b-a22b", SEQ, attention="cudnn")
    block, info = _block(graph, moe=True), graph.info
    config = _qwen3_config(recompute_modules=("layernorm", "moe"))
    cost = _cost(graph, block, config)
    plain = _cost(graph, block, replace(config, recompute="none", recompute_modules=()))
    router_fwd_s = router_times_s(block, config, H100, info, "bf16")[0]
    b, h, t, experts = 2, info.hidden, config.tp, info.num_experts
    dropped = b * h / t + 4 * experts / t  # the MoE norm's output (layernorm) and the fp32 router logits (moe)
    traffic_s = memory_time_s(H100.device.elementwise_bytes_per_activation_byte * dropped * SEQ, H100)
    assert cost.recompute_s == pytest.approx(plain.expert_fwd_s + router_fwd_s + traffic_s, rel=1e-9)
    assert cost.ep_bwd_comm_s == pytest.approx(plain.ep_bwd_comm_s + plain.ep_fwd_comm_s, rel=1e-9)
    assert cost.ep_fwd_comm_s == pytest.approx(plain.ep_fwd_comm_s, rel=1e-9)


def test_elementwise_modules_cost_their_dropped_bytes_only():
    """`layernorm` and `moe_act`: no GEMM, only the bytes they drop at the forward's traffic per byte."""
    graph = profile("qwen3-235b-a22b", SEQ, attention="cudnn")
    block = _block(graph, moe=True)
    config = _qwen3_config(recompute_modules=("layernorm", "moe_act"))
    b, h, t = 2, graph.info.hidden, config.tp
    copies = graph.info.top_k / t
    dropped = b * h / t + copies * b * graph.info.expert_ffn  # the norm's output, the experts' fc2 inputs
    expected = memory_time_s(H100.device.elementwise_bytes_per_activation_byte * dropped * SEQ, H100)
    assert _cost(graph, block, config).recompute_s == pytest.approx(expected, rel=1e-9)


def test_mlp_module_reruns_a_dense_blocks_mlp_gemms():
    graph = profile("llama3-8b", SEQ, attention="cudnn")
    block, info = _block(graph, moe=False), graph.info
    config = ParallelConfig(gpus=8, global_batch=8, tp=2, dp=4, sp=True, zero=1, engine="megatron",
                            recompute="selective", recompute_modules=("mlp",))
    h, f, b, t = info.hidden, info.ffn, 2, config.tp
    shapes = ((h, f, True), (h, f, True), (f, h, False))
    gemm_s = gemm.linear_times_s(shapes, SEQ, t, H100, "bf16")[0]
    dropped = b * h / t + b * 2 * f / t + b * f / t  # the fused norm's output, fc1's output, fc2's input
    traffic_s = memory_time_s(H100.device.elementwise_bytes_per_activation_byte * dropped * SEQ, H100)
    assert _cost(graph, block, config).recompute_s == pytest.approx(gemm_s + traffic_s, rel=1e-9)


def test_recomputing_more_modules_never_costs_less_time():
    graph = profile("qwen3-235b-a22b", SEQ, attention="cudnn")
    block = _block(graph, moe=True)
    seconds = [_cost(graph, block, _qwen3_config(recompute_modules=modules)).recompute_s
               for modules in (("layernorm",), ("layernorm", "moe_act"), ("layernorm", "moe_act", "moe"),
                               ("layernorm", "moe_act", "moe", "core_attn"))]
    assert seconds == sorted(seconds) and seconds[0] > 0


def test_traced_latent_attention_moe_is_priced_module_by_module():
    """DeepSeek-V3, traced through transformers, whose blocks Megatron's memory recipe prices term
    by term (`engine_memory.formulas_describe`): its recompute modules are timed the same way, the
    `moe` module rerunning the routed experts' forward and the dispatch and combine."""
    pytest.importorskip("transformers")
    graph = profile("deepseek-v3", SEQ, attention="cudnn")
    block = _block(graph, moe=True)
    config = ParallelConfig(gpus=2048, global_batch=4096, pp=16, dp=128, zero=1, ep=64, engine="megatron",
                            recompute="selective", recompute_modules=("mla_up_proj", "layernorm", "moe"))
    cost = _cost(graph, block, config)
    plain = _cost(graph, block, replace(config, recompute="none", recompute_modules=()))
    assert cost.recompute_s > plain.expert_fwd_s > 0
    assert cost.ep_bwd_comm_s == pytest.approx(plain.ep_bwd_comm_s + plain.ep_fwd_comm_s, rel=1e-9)
