"""Published Hugging Face configs beyond plain transformers: state-space models (Mamba, Falcon-Mamba),
multi-head latent attention (DeepSeek-V2-Lite, DeepSeek-V3), q/k norms over all heads (OLMo-2),
biases everywhere (StarCoder2), a multimodal config (Gemma-3 12B, read from its directory) and
sliding windows. Each profiles with transformers' parameter count and near its published size
(`test_hf_layers` holds every fixture to both), and plans."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshplan.planner.profiling.profiler import profile

pytest.importorskip("transformers")

FIXTURES = Path(__file__).parent / "hf_configs"
def shrunk(tmp_path, name: str, **overrides) -> str:
    data = json.loads((FIXTURES / f"{name}.json").read_text())
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        data.pop(key, None)
    data.update(overrides)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(data))
    return f"hf:{path}"


def test_a_multimodal_config_in_a_directory_profiles_its_text_backbone():
    graph = profile(f"hf:{FIXTURES / 'gemma3_12b'}/", 64, cache=False)
    # transformers' Gemma3ForCausalLM of the text_config on the meta device: 11,766,034,176 (the
    # published 12.2 B holds the 0.4 B vision tower too)
    assert graph.total_params == 11_766_034_176
    assert len([layer for layer in graph.layers if layer.kind == "block"]) == 48
    assert any("multimodal config (gemma3)" in note and "vision_config" in note for note in graph.info.notes)


def test_a_directory_without_config_json_says_what_it_reads(tmp_path):
    from meshplan.planner.contracts.errors import MeshplanError

    with pytest.raises(MeshplanError, match=r"config.json.*not found; use hf:path/config.json, hf:dir/"):
        profile(f"hf:{tmp_path}", 64, cache=False)


def test_sliding_window_layers_cost_the_keys_each_query_sees(tmp_path):
    """Gemma-3: five layers of window 8 per global one; at seq 32 query i sees min(i + 1, 8) keys."""
    from meshplan.planner.profiling.tracing import seen_entries

    assert seen_entries(32, 8) == 8 * 9 // 2 + 24 * 8 and seen_entries(32, 64) == 32 * 33 // 2
    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4, head_dim=16,
                 num_key_value_heads=2, vocab_size=300, sliding_window=8)
    graph = profile(shrunk(tmp_path, "gemma3_1b", **small), 32, cache=False)
    assert "sliding windows (8 tokens): each query costs the min(position, window) keys it sees" in graph.info.notes
    sliding, full = graph.layers[1], graph.layers[6]
    assert sliding.attn_fwd_flops == full.attn_fwd_flops > 0
    for layer, seen in ((sliding, seen_entries(32, 8)), (full, seen_entries(32, 32))):
        skipped = layer.attn_fwd_flops * (32 * 32 - seen) // (32 * 32)
        assert layer.fwd_flops - layer.causal_fwd_flops == skipped


def test_mamba_traces_the_fused_scan(tmp_path):
    """Kernel-shaped scan: saved bytes linear in the sequence (no d_inner x d_state per position),
    and the depthwise conv's backward at twice its forward (torch prices it as a dense conv)."""
    spec = shrunk(tmp_path, "mamba_2p8b", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  time_step_rank=8, vocab_size=300)
    short, long = (profile(spec, seq, cache=False).layers[1] for seq in (64, 128))
    state_bytes = 128 * 16 * 4  # the scan's fp32 state at one position: d_inner x d_state
    per_position = (long.activation_bytes - short.activation_bytes) / 64
    assert per_position < state_bytes / 2  # transformers' loop keeps several states per position
    # 128 channels, kernel 4, 128 + 3 outputs (padded both sides, then cut to the sequence)
    assert long.conv_bwd_flops == 2 * long.conv_fwd_flops == 2 * (2 * 128 * 4 * 131)
    assert long.bwd_flops == 2 * long.fwd_flops


MAMBA2 = {"model_type": "mamba2", "architectures": ["Mamba2ForCausalLM"], "hidden_size": 64, "num_heads": 8,
          "head_dim": 16, "state_size": 16, "n_groups": 2, "expand": 2, "conv_kernel": 4, "chunk_size": 32,
          "num_hidden_layers": 2, "vocab_size": 300, "tie_word_embeddings": False, "use_bias": False,
          "use_conv_bias": True}


def test_mamba2_traces_the_chunked_scan_as_its_kernel_runs_it(tmp_path, monkeypatch):
    """Mamba-2's scan (`hf_ssm.KernelSSD`): the block's FLOPs are its two Linears, its depthwise conv
    and the SSD kernel's four products per chunk, by hand (backward twice forward); it keeps what
    `mamba_chunk_scan_combined` keeps (the fp32 cumulative decay per head, chunk and position among it),
    no (chunk x chunk) score block per head, and under 40% of the bytes transformers' einsum path keeps."""
    from meshplan.planner.models import hf_ssm

    path = tmp_path / "mamba2.json"
    path.write_text(json.dumps(MAMBA2))
    seq, chunk, heads, head_dim, groups, state, hidden = 64, 32, 8, 16, 2, 16, 64
    inner = heads * head_dim
    block = profile(f"hf:{path}", seq, cache=False).layers[1]
    linears = 2 * seq * hidden * (2 * inner + 2 * groups * state + heads) + 2 * seq * inner * hidden
    chunks = seq // chunk
    ssd = 2 * chunks * (groups * chunk * state * chunk + heads * (chunk * chunk * head_dim + 2 * head_dim * chunk * state))
    assert block.fwd_flops == linears + block.conv_fwd_flops + ssd
    assert block.bwd_flops == 2 * block.fwd_flops
    monkeypatch.setattr(hf_ssm, "_KERNELS", hf_ssm._KERNELS[:1])  # transformers' einsum path
    reference = profile(f"hf:{path}", seq, cache=False).layers[1]
    assert block.activation_bytes < 0.4 * reference.activation_bytes


def test_the_mamba2_ssd_kernel_keeps_its_decay_and_no_score_block():
    import torch

    from meshplan.planner.models.hf_ssm import kernel_ssd

    batch, seq, heads, head_dim, groups, state, chunk = 1, 256, 8, 16, 2, 16, 64
    meta = dict(device="meta", dtype=torch.bfloat16)
    x = torch.empty(batch, seq, heads, head_dim, requires_grad=True, **meta)
    dt = torch.empty(batch, seq, heads, requires_grad=True, **meta)
    B, C = (torch.empty(batch, seq, groups, state, requires_grad=True, **meta) for _ in range(2))
    A, D, dt_bias = (torch.empty(heads, device="meta", dtype=torch.float32) for _ in range(3))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out, final = kernel_ssd(x, dt, A, B, C, chunk, D=D, dt_bias=dt_bias, dt_softplus=True, return_final_states=True)
    out.sum().backward()
    assert out.shape == x.shape and final.shape == (batch, heads, head_dim, state) and x.grad.shape == x.shape
    shapes = {(tuple(t.shape), t.dtype) for t in saved}
    assert ((batch, heads, seq // chunk, chunk), torch.float32) in shapes
    assert ((batch, seq, heads, head_dim), torch.bfloat16) in shapes  # x and the output
    assert all(t.numel() < seq * chunk * heads for t in saved)  # no (position x chunk) scores per head


def test_estimate_splits_olmo2_starcoder2_and_deepseek_over_tp():
    from meshplan.planner.costing.executable import model_facts, why_not_executable
    from meshplan.planner.contracts.config import ParallelConfig
    from meshplan.planner.simulation.estimator import estimate

    for name in ("olmo2_7b", "starcoder2_15b"):
        assert estimate(f"hf:{FIXTURES / name}.json", "h100-sxm", 2, 4, seq=128, tp=2).step_time_s > 0
    spec = f"hf:{FIXTURES / 'deepseek_v3.json'}"
    result = estimate(spec, "h100-sxm", 256, 512, seq=1024, tp=2, pp=8, ep=8, zero=1)
    assert result.step_time_s > 0
    # the executor does not split transformers' routed experts: train refuses it in one line
    graph = profile(spec, 1024)
    why = why_not_executable(ParallelConfig(gpus=256, global_batch=512, tp=2, pp=8, dp=16), model_facts(graph))
    assert why.startswith("the executor trains Hugging Face mixture-of-experts models with tp=1")


@pytest.mark.parametrize("name, gpus, pins", [("falcon_mamba_7b", 2, ()), ("deepseek_v2_lite", 4, ("--pp", 1, "--zero", 3)),
                                              ("olmo2_7b", 2, ("--tp", 2)), ("starcoder2_15b", 4, ("--tp", 2))])
def test_plans_on_a_small_cluster(run_cli, name, gpus, pins):
    code, out, err = run_cli("plan", "--model", f"hf:{FIXTURES / name}.json", "--cluster", "h100-sxm", "--gpus", gpus,
                             "--gbs", 4, "--seq", 128, *pins, "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["executable"] and plan["prediction"]["step_time_s"] > 0
    assert plan["mesh"]["tp"] == (2 if "--tp" in pins else 1)


def test_kernel_fallback_notices_are_held_back_while_tracing_on_meta_only():
    """transformers warns that a kernel falls back to "much slower" torch code; on the meta device
    nothing runs, so tracing holds the notice back, and restores the logger's level after."""
    import logging

    from meshplan.planner.models.hf_ssm import KERNEL_NOTICE_LOGGER, scan_as_kernel

    notices = logging.getLogger(KERNEL_NOTICE_LOGGER)
    before = notices.level
    with scan_as_kernel("meta"):
        assert not notices.isEnabledFor(logging.WARNING)
    assert notices.level == before
    with scan_as_kernel("cpu"):
        assert notices.level == before


def test_gated_deltanet_kernel_keeps_fla_s_tensors_and_counts_its_chunk_products():
    """`KernelGDN` (flash-linear-attention's chunked gated delta rule): q and k after the in-kernel L2
    norm with their fp32 rstd, v, the fp32 cumulative gate, beta and the inverted chunk matrix A (b x L x
    heads x 64); forward FLOPs the chunk algorithm's products, per value head and chunk of C = 64,
    2 L (3 C K + 2 C V + C^2 + 3 K V), by hand; backward twice that plus the recomputed w, u and states."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from meshplan.planner.models.hf_ssm import GDN_CHUNK, kernel_gdn

    batch, seq, k_heads, v_heads, key_dim, value_dim = 1, 256, 2, 4, 32, 16
    meta = dict(device="meta", dtype=torch.bfloat16)
    q, k = (torch.empty(batch, seq, k_heads, key_dim, requires_grad=True, **meta) for _ in range(2))
    v = torch.empty(batch, seq, v_heads, value_dim, requires_grad=True, **meta)
    g, beta = (torch.empty(batch, seq, v_heads, requires_grad=True, **meta) for _ in range(2))
    saved = []
    with FlopCounterMode(display=False) as forward_count, \
            torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out, final = kernel_gdn(q, k, v, g, beta, initial_state=None, output_final_state=True,
                                use_qk_l2norm_in_kernel=True)
    c, K, V = GDN_CHUNK, key_dim, value_dim
    per_head = 2 * seq * (3 * c * K + 2 * c * V + c * c + 3 * K * V)
    assert forward_count.get_total_flops() == v_heads * per_head
    with FlopCounterMode(display=False) as backward_count:
        out.sum().backward()
    recomputed = 2 * seq * (c * K + c * V + 2 * K * V)
    assert backward_count.get_total_flops() == v_heads * (2 * per_head + recomputed)
    assert out.shape == (batch, seq, v_heads, value_dim) and final.shape == (batch, v_heads, key_dim, value_dim)
    assert q.grad.shape == q.shape and g.grad.shape == g.shape
    shapes = [(tuple(t.shape), t.dtype) for t in saved]
    assert ((batch, seq, v_heads, c), torch.bfloat16) in shapes                      # A
    assert shapes.count(((batch, seq, k_heads), torch.float32)) == 2                  # q and k rstd
    assert ((batch, seq, v_heads), torch.float32) in shapes                           # the cumulative gate


def test_qwen3_next_profiles_with_its_experts_not_its_convolutions(tmp_path):
    """Qwen3-Next (gated DeltaNet and gated attention, 3:1, over MoE blocks) profiles: its delta rule
    runs as `KernelGDN` (transformers' torch path solves a triangular system meshplan cannot count),
    and its mixers' bias-free depthwise conv (a 3-D weight) is not taken for a stack of experts."""
    from transformers import Qwen3NextConfig

    small = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                 num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                 intermediate_size=64, vocab_size=300)
    data = {**Qwen3NextConfig(**small).to_dict(), "model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"]}
    data.pop("transformers_version", None)
    path = tmp_path / "qwen3_next.json"
    path.write_text(json.dumps(data, default=str))
    graph = profile(f"hf:{path}", 128, cache=False)
    assert graph.info.num_experts == 8 and graph.info.top_k == 2
    blocks = [layer for layer in graph.layers if layer.kind == "block"]
    assert len(blocks) == 4 and all(layer.bwd_flops > 2 * layer.fwd_flops * 0.99 for layer in blocks)
