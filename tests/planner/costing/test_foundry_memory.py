"""MosaicML llm-foundry's memory recipe (`costing.foundry_memory`, `--engine llm-foundry`): MPT blocks,
the fused cross-entropy and FSDP's states term by term; its published runs at the largest micro-batch
fit; no pipeline, context or expert parallelism, in a configuration or in the search."""
from __future__ import annotations

import json

import pytest

from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.costing.hardware import load_cluster
from meshplan.planner.costing.layer_cost import layer_cost
from meshplan.planner.profiling.profiler import profile
from meshplan.planner.simulation.estimator import estimate

# MPT-760m (llm-foundry's mpt-760m.yaml): 24 blocks, d_model 1536, 12 heads, vocab 50368.
MPT_760M = "gpt:layers=24,hidden=1536,heads=12,vocab=50368"


def test_mpt_block_head_and_states_term_by_term():
    seq, mbs, gpus = 2048, 4, 8
    graph = profile(MPT_760M, seq)
    config = ParallelConfig(gpus=gpus, global_batch=gpus * mbs, dp=gpus, microbatch_size=mbs, zero=3,
                            engine="llm-foundry")
    cluster = load_cluster("h100-sxm")
    b, h, f, heads, vocab = 2, 1536, 4 * 1536, 12, graph.info.padded_vocab
    tokens = seq * mbs
    block = next(layer for layer in graph.layers if layer.kind == "block")
    cost = layer_cost(block, config, cluster, graph.info, profile_dtype=graph.dtype)
    # two LayerNorms' inputs and outputs, packed QKV (one storage) + output + lse, GELU's input and output
    per_token = 4 * b * h + (3 * b * h + b * h + 4 * heads) + 2 * b * f
    assert cost.activation_bytes == pytest.approx(per_token * tokens)
    assert cost.param_bytes == pytest.approx(block.num_params * 4 / gpus)  # fp32 shards, 16/d in all
    assert cost.grad_bytes + cost.optimizer_bytes == pytest.approx(block.num_params * 12 / gpus)
    # limit_all_gathers: two bf16 units (2 x 2), or in backward the unit's bf16 gradient beside its fp32 copy
    # for DEFAULT's fp32 reduce-scatter (2 + 4), the larger
    assert cost.buffer_bytes == pytest.approx(max(2 * 2, 2 + 4) * block.num_params)
    head = next(layer for layer in graph.layers if layer.kind == "head")
    cost = layer_cost(head, config, cluster, graph.info, profile_dtype=graph.dtype)
    assert cost.activation_bytes == pytest.approx((2 * b * h + b * vocab) * tokens)  # the bf16 logits
    selective = layer_cost(block, ParallelConfig(**{**config.__dict__, "recompute": "selective"}), cluster,
                           graph.info, profile_dtype=graph.dtype)
    assert selective.activation_bytes == pytest.approx((4 * b * h + 2 * b * f) * tokens)  # attention rebuilt


@pytest.mark.parametrize("cluster, gpus, seq, mbs", [("h100-sxm", 8, 2048, 24), ("a100-80g", 8, 2048, 24)])
def test_published_mpt_760m_runs_fit(cluster, gpus, seq, mbs):
    """llm-foundry's MPT-760m rows at their (largest) micro-batch, which ran; one more sample per
    GPU and a third more would not (Composer's automatic micro-batching found 24)."""
    options = dict(gpus=gpus, seq=seq, zero=3, engine="llm-foundry", attention="triton-alibi")
    assert estimate(MPT_760M, cluster, global_batch=gpus * mbs, mbs=mbs, **options).fits
    assert not estimate(MPT_760M, cluster, global_batch=gpus * 32, mbs=32, **options).fits


def test_no_pipeline_context_or_expert_parallelism(run_cli):
    with pytest.raises(ValueError, match="llm-foundry trains with FSDP"):
        ParallelConfig(gpus=2, global_batch=4, pp=2, engine="llm-foundry")
    code, out, err = run_cli("plan", "--model", "gpt:layers=4,hidden=256,heads=4,vocab=1024", "--cluster", "a100-80g",
                             "--gpus", 4, "--gbs", 8, "--seq", 256, "--engine", "llm-foundry", "--top", 3, "--json")
    assert code == 0, err
    data = json.loads(out)
    plans = [data] + data.get("alternatives", [])
    assert data["engine"] == "llm-foundry" and data["mesh"]["pp"] == 1
    assert all(plan.get("mesh", {}).get("pp", 1) == 1 for plan in plans)


def test_fp8_keeps_transformer_engines_fp8_linear_inputs():
    """Under fp8 a TE Linear keeps its input's fp8 cast (1 byte) and not the bf16 input: each norm's
    output and GELU's output drop to 1 byte an element, and out_proj adds an fp8 copy of the
    attention output beside the bf16 one the kernel keeps; the head (the tied embedding's
    F.linear) is not a TE module."""
    seq, mbs, gpus = 2048, 4, 8
    graph = profile(MPT_760M, seq)
    cluster = load_cluster("h100-sxm")
    b, h, f, heads = 2, 1536, 4 * 1536, 12
    tokens = seq * mbs
    config = ParallelConfig(gpus=gpus, global_batch=gpus * mbs, dp=gpus, microbatch_size=mbs, zero=3,
                            engine="llm-foundry", precision="fp8", fp8_recipe="delayed")
    block = next(layer for layer in graph.layers if layer.kind == "block")
    cost = layer_cost(block, config, cluster, graph.info, profile_dtype=graph.dtype)
    per_token = 2 * (b + 1) * h + (3 * b * h + b * h + 1 * h + 4 * heads) + (b + 1) * f
    assert cost.activation_bytes == pytest.approx(per_token * tokens)
    bf16 = layer_cost(block, ParallelConfig(**{**config.__dict__, "precision": "bf16-mixed", "fp8_recipe": None}),
                      cluster, graph.info, profile_dtype=graph.dtype)
    assert bf16.activation_bytes - cost.activation_bytes == pytest.approx((2 * h - h + f) * tokens)
    head = next(layer for layer in graph.layers if layer.kind == "head")
    head_cost = layer_cost(head, config, cluster, graph.info, profile_dtype=graph.dtype)
    assert head_cost.activation_bytes == pytest.approx((2 * b * h + b * graph.info.padded_vocab) * tokens)
