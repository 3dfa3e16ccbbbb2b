"""Megatron-Core's MoE memory (`costing.megatron_activations`): the published Qwen3-235B-A22B and
DeepSeek-V3 layouts fit as Megatron runs them, each MoE block's saved bytes match a hand count
term by term, the recompute modules drop what Megatron-Core drops, and the profile's fallback
counts the routed experts once."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from meshplan.planner.contracts.config import ParallelConfig
from meshplan.planner.costing.hardware import load_cluster
from meshplan.planner.costing.layer_cost import layer_cost
from meshplan.planner.profiling.profiler import profile

DEEPSEEK_V3 = f"hf:{Path(__file__).parents[1] / 'models' / 'hf_configs' / 'deepseek_v3.json'}"
SEQ = 4096
# Megatron-MoE-ModelZoo best_practice/Qwen3/readme.md, cross-node EP row: 256 H100, TP 2, PP 8,
# VPP 4, EP 32, ETP 1, MBS 1, GBS 2048, recompute "norm, act" (sequence parallel with TP and EP).
QWEN3_LAYOUT = dict(gpus=256, gbs=2048, tp=2, pp=8, vpp=4, ep=32, etp=1, zero=1,
                    modules=("layernorm", "moe_act"))
# DeepSeek-V3 technical report (arXiv:2412.19437) section 3.2: 2048 H800, PP 16, EP 64, no TP,
# ZeRO-1; recomputed as Megatron-MoE-ModelZoo's DeepSeek-V3 recipe does
# (--recompute-modules mla_up_proj layernorm moe mlp) at MBS 1.
DEEPSEEK_MODULES = ("mla_up_proj", "layernorm", "moe", "mlp")


def _moe_block_cost(graph, config):
    block = next(layer for layer in graph.layers if layer.expert_params)
    return layer_cost(block, config, load_cluster("h100-sxm"), graph.info, profile_dtype=graph.dtype)


def test_qwen3_published_layout_fits(run_cli):
    layout = QWEN3_LAYOUT
    code, out, err = run_cli(
        "estimate", "--model", "qwen3-235b-a22b", "--cluster", "h100-sxm", "--gpus", layout["gpus"], "--gbs",
        layout["gbs"], "--seq", SEQ, "--tp", layout["tp"], "--pp", layout["pp"], "--vpp", layout["vpp"], "--schedule",
        "interleaved", "--ep", layout["ep"], "--etp", layout["etp"], "--sp", "--zero", layout["zero"],
        "--engine", "megatron", "--recompute", "selective", "--recompute-modules", *layout["modules"])
    assert code == 0, err
    assert "fits: yes" in out and "recompute=selective(layernorm,moe_act)" in out


def test_qwen3_moe_block_terms():
    """Per token on one rank, b = 2, h 4096, 64 heads of 128 (4 K/V heads), 128 experts, top 8,
    expert width 1536, TP 2 with SP, expert TP 1: each rank holds 8/2 routed copies per token."""
    graph = profile("qwen3-235b-a22b", SEQ)
    config = ParallelConfig(gpus=256, global_batch=2048, tp=2, pp=8, dp=16, sp=True, zero=1, ep=32, etp=1,
                            schedule="interleaved", virtual_stages=4, engine="megatron", recompute="selective",
                            recompute_modules=("layernorm", "moe_act"))
    b, h, t = 2, 4096, 2
    attention = b * h / t + b * h / t + b * (8192 + 2 * 512) / t + (b * 8192 + 4 * 64) / t  # norm in/out, QKV, out
    moe = b * h / t + 4 * 128 / t  # norm input (its output rebuilt: layernorm), fp32 router logits
    copies = 8 / t
    routed = copies * (b * h + 4 + b * 2 * 1536)  # fc1 input, prob, fc1 output (fc2 input rebuilt: moe_act)
    cost = _moe_block_cost(graph, config)
    assert cost.activation_bytes == pytest.approx((attention + moe + routed) * SEQ)
    rebuilt = b * h / t + copies * b * 1536
    assert cost.buffer_bytes == pytest.approx(rebuilt * SEQ)
    none = _moe_block_cost(graph, replace(config, recompute="none"))
    assert none.activation_bytes == pytest.approx((attention + moe + routed + rebuilt) * SEQ)


def test_deepseek_v3_published_layout_fits(run_cli):
    pytest.importorskip("transformers")
    code, out, err = run_cli(
        "estimate", "--model", DEEPSEEK_V3, "--cluster", "h100-sxm", "--gpus", 2048, "--pp", 16, "--ep", 64,
        "--zero", 1, "--gbs", 4096, "--seq", SEQ, "--engine", "megatron", "--recompute", "selective",
        "--recompute-modules", *DEEPSEEK_MODULES)
    assert code == 0, err
    assert "fits: yes" in out


def test_deepseek_v3_moe_block_terms():
    """Multi-head latent attention and DeepSeekMoE, per token, no TP: b = 2, h 7168, 128 heads of
    128 + 64 (values 128), latents 1536 (query) and 512 (K/V), 256 experts, top 8, expert width
    2048, one shared expert."""
    pytest.importorskip("transformers")
    graph = profile(DEEPSEEK_V3, SEQ)
    info = graph.info
    assert (info.kv_lora_rank, info.q_lora_rank, info.head_dim, info.v_head_dim) == (512, 1536, 192, 128)
    assert (info.expert_ffn, info.num_shared_experts, info.shared_ffn) == (2048, 1, 2048)
    b, h, heads = 2, 7168, 128
    terms = {"norm inputs": 2 * b * h, "norm outputs": 2 * b * h, "latents": 2 * b * (1536 + 512),
             "up-projected Q, K, V": b * heads * (192 + 192 + 128), "output, lse": b * heads * 128 + 4 * heads,
             "router": 4 * 256, "shared": b * 2048 * 3,
             "routed": 8 * (b * h + 4 + b * 2 * 2048), "routed fc2 input": 8 * b * 2048}
    dropped = {("mla_up_proj", "layernorm", "moe", "mlp"): ("norm outputs", "up-projected Q, K, V", "router",
                                                            "shared", "routed", "routed fc2 input"),
               ("layernorm", "mla_up_proj", "moe_act"): ("norm outputs", "up-projected Q, K, V", "routed fc2 input"),
               ("core_attn",): ()}
    config = ParallelConfig(gpus=2048, global_batch=4096, pp=16, dp=128, zero=1, ep=64, engine="megatron",
                            recompute="selective")
    for modules, names in dropped.items():
        cost = _moe_block_cost(graph, replace(config, recompute_modules=modules))
        kept = sum(value for name, value in terms.items() if name not in names)
        assert cost.activation_bytes == pytest.approx(kept * SEQ), modules
        assert cost.buffer_bytes == pytest.approx((sum(terms.values()) - kept) * SEQ), modules
    full = _moe_block_cost(graph, replace(config, recompute="full"))
    assert full.activation_bytes == pytest.approx(b * h * SEQ)
    assert full.buffer_bytes == pytest.approx(sum(terms.values()) * SEQ)


def test_two_shared_experts_count_their_summed_width_once():
    """DeepSeek-V2-Lite's two shared experts of 1408 are one SwiGLU of 2816 (`shared_ffn`, their
    summed width): the shared experts' fc1 output and fc2 input keep 3 x 2 x 2816 bytes per token,
    not twice that, and dropping them (`shared_experts`) frees exactly that."""
    graph = profile("deepseek-v2-lite", SEQ)
    info = graph.info
    assert (info.num_shared_experts, info.shared_ffn, info.expert_ffn, info.shared_experts_width) == (2, 2816, 1408, 2816)
    config = ParallelConfig(gpus=8, global_batch=8, dp=8, ep=8, zero=1, engine="megatron", recompute="selective",
                            recompute_modules=("shared_experts",))
    kept = _moe_block_cost(graph, replace(config, recompute="none", recompute_modules=()))
    dropped = _moe_block_cost(graph, config)
    assert kept.activation_bytes - dropped.activation_bytes == pytest.approx(3 * 2 * 2816 * SEQ)


def test_gpt_oss_moe_block_terms():
    """GPT-OSS-120B, traced through transformers, priced as Megatron-Core runs it (its own GQA and
    grouped-GEMM experts, not the traced eager experts), per token, no TP: b = 2, h 2880, 64
    query heads of 64 (the config's head_dim, not 2880 / 64) and 8 K/V heads, 128 experts, top 4,
    expert width 2880 (`intermediate_size`: every layer is a MoE layer)."""
    pytest.importorskip("transformers")
    graph = profile("gpt-oss-120b", SEQ)
    info = graph.info
    assert (info.head_dim, info.expert_ffn, info.num_experts, info.top_k, info.num_shared_experts) == (64, 2880, 128, 4, 0)
    b, h, hq, hkv = 2, 2880, 64 * 64, 8 * 64
    attention = 2 * b * h + b * (hq + 2 * hkv) + b * hq + 4 * 64  # norm in/out, Q K V, output, lse
    moe = 2 * b * h + 4 * 128  # norm in/out, fp32 router logits
    routed = 4 * (b * h + 4 + b * 2 * 2880 + b * 2880)  # fc1 input, prob, fc1 output, fc2 input
    config = ParallelConfig(gpus=64, global_batch=512, dp=64, ep=8, zero=1, engine="megatron")
    cost = _moe_block_cost(graph, config)
    assert cost.activation_bytes == pytest.approx((attention + moe + routed) * SEQ)
    # the traced transformers experts (meshplan's executor runs them) keep more
    own = _moe_block_cost(graph, replace(config, engine="meshplan"))
    assert own.activation_bytes > 1.5 * cost.activation_bytes


def test_profile_fallback_counts_routed_experts_once():
    """Under an engine whose formulas do not describe a traced model (torchtitan on a Hugging Face
    DeepSeek), the MoE block keeps the profile's saved bytes, routed experts included once."""
    pytest.importorskip("transformers")
    graph = profile(DEEPSEEK_V3, SEQ)
    block = next(layer for layer in graph.layers if layer.expert_params)
    config = ParallelConfig(gpus=8, global_batch=8, dp=8, zero=1, engine="torchtitan")
    cost = _moe_block_cost(graph, config)
    assert cost.activation_bytes == pytest.approx(block.act_tp_sharded_bytes + block.act_tp_replicated_bytes
                                                  + block.act_attn_score_bytes)


@pytest.mark.parametrize("kwargs, message", [
    (dict(engine="meshplan"), "price them with engine megatron"),
    (dict(engine="megatron", recompute_modules=("attention",)), "unknown recompute module(s) attention"),
])
def test_recompute_modules_are_megatron_names(kwargs, message):
    options = dict(recompute_modules=("moe_act",), recompute="selective")
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ParallelConfig(gpus=1, global_batch=1, **{**options, **kwargs})
    config = ParallelConfig(gpus=1, global_batch=1, engine="megatron", recompute="selective",
                            recompute_modules=["moe_act", "layernorm", "moe_act"])
    assert config.recompute_modules == ("layernorm", "moe_act")
    assert ParallelConfig(gpus=1, global_batch=1).selective_modules == ("core_attn",)


def test_recompute_modules_need_selective_recomputation(run_cli):
    code, _, err = run_cli("estimate", "--model", "qwen3-30b-a3b", "--cluster", "h100-sxm", "--gpus", 8, "--gbs", 8,
                           "--ep", 8, "--engine", "megatron", "--recompute-modules", "moe_act")
    assert code == 2 and "add --recompute selective" in err, err


def test_megatron_arguments_carry_their_recompute_modules(run_cli, tmp_path):
    """`estimate --from` a Megatron-LM command line: its --recompute-modules price the job as the
    same flags on `estimate` do (a name meshplan does not model is noted and left out)."""
    from meshplan.planner.engines.megatron import read_megatron

    args = ("--num-layers 48 --hidden-size 2048 --num-attention-heads 32 --group-query-attention "
            "--num-query-groups 4 --kv-channels 128 --ffn-hidden-size 6144 --swiglu --num-experts 128 "
            "--moe-router-topk 8 --moe-ffn-hidden-size 768 --vocab-size 151936 --seq-length 4096 "
            "--micro-batch-size 1 --global-batch-size 64 --expert-model-parallel-size 8 --bf16 "
            "--use-distributed-optimizer --recompute-granularity selective --recompute-modules moe_act layernorm "
            "offloaded_thing")
    job = read_megatron(args)
    assert job.recompute_modules == ("moe_act", "layernorm")
    assert any("offloaded_thing: not modelled" in note for note in job.notes)
    path = tmp_path / "pretrain.args"
    path.write_text(args)
    code, out, err = run_cli("estimate", "--from", path, "--model", "qwen3-30b-a3b", "--cluster", "h100-sxm",
                             "--gpus", 8, "--json")
    assert code == 0, err
    from_file = json.loads(out)
    code, out, err = run_cli("estimate", "--model", "qwen3-30b-a3b", "--cluster", "h100-sxm", "--gpus", 8, "--gbs", 64,
                             "--seq", 4096, "--ep", 8, "--zero", 1, "--engine", "megatron", "--recompute", "selective",
                             "--recompute-modules", "moe_act", "layernorm", "--json")
    assert code == 0, err
    assert from_file["memory_bytes"][0]["activations"] == pytest.approx(json.loads(out)["memory_bytes"][0]["activations"])


@pytest.mark.parametrize("engine, etp", [("megatron", 1), ("megatron", 2), ("torchtitan", 1), ("deepspeed", 1)])
def test_routed_expert_states_follow_expert_tp(engine, etp):
    """Each rank holds E / ep experts split etp ways (MoE parallel folding), whatever the dense
    layers' TP: the engine's expert states are exactly expert_params / (ep etp) at its bytes per
    parameter (`engine_state_bytes` over the expert-data ranks), and the `experts` figure is that
    part of params + grads + optimizer. Qwen3-235B's block at TP 2 and EP 8 on 32 ranks a stage."""
    from meshplan.planner.costing.engine_memory import engine_state_bytes

    graph = profile("qwen3-235b-a22b", SEQ)
    pp = 1 if engine == "deepspeed" else 8
    config = ParallelConfig(gpus=32 * pp, global_batch=32 * pp, tp=2, pp=pp, dp=16, sp=True, zero=1, ep=8, etp=etp,
                            engine=engine, schedule="1f1b")
    block = next(layer for layer in graph.layers if layer.expert_params)
    cost = _moe_block_cost(graph, config)
    edp = 2 * 16 // (8 * etp)  # tp * dp / (ep * etp)
    assert config.expert_data_ranks == edp
    expected = engine_state_bytes(engine, block.expert_params / (8 * etp), edp, 1, "bf16-mixed", pp)
    assert cost.expert_state_bytes == pytest.approx(sum(expected.values()), rel=1e-12)
    assert cost.expert_state_bytes < cost.param_bytes + cost.grad_bytes + cost.optimizer_bytes
