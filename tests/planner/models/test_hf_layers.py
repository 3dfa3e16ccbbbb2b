"""Hugging Face configs modelled as they are built: published configs count exactly transformers'
parameters, non-uniform layers (dense and MoE, sliding-window and global) are each measured, and
the collapsed profile equals tracing every layer."""
from __future__ import annotations

import functools
import json
from dataclasses import replace
from pathlib import Path

import pytest

from meshplan.planner.profiling.profiler import profile

transformers = pytest.importorskip("transformers")
import torch  # noqa: E402

FIXTURES = Path(__file__).parent / "hf_configs"  # sources in hf_configs/SOURCES.md
PUBLISHED = sorted(path.stem for path in FIXTURES.glob("*.json"))


def transformers_count(data: dict) -> int:
    """transformers' own count: the whole model built from the config on the meta device."""
    config = transformers.AutoConfig.for_model(**data)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def shrunk(name: str, tmp_path, **overrides) -> str:
    """A published config with small widths and 4 layers (same structure), as an hf: spec."""
    data = json.loads((FIXTURES / f"{name}.json").read_text())
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        data.pop(key, None)
    small = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, head_dim=32,
                 num_key_value_heads=2, vocab_size=512, moe_intermediate_size=32, num_experts=8,
                 num_local_experts=4, num_experts_per_tok=2)
    data.update({key: value for key, value in small.items() if key in data})
    if data["model_type"] == "deepseek_v3":
        data.update(num_key_value_heads=4, first_k_dense_replace=1, n_routed_experts=8, n_group=2, topk_group=1,
                    q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)
    data.update(overrides)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(data))
    return f"hf:{path}"


# fixture -> published parameter count (model cards; DeepSeek-V2 paper: 15.7 B total)
PUBLISHED_SIZE = {"falcon_mamba_7b": 7.27e9, "mamba_2p8b": 2.77e9, "deepseek_v2_lite": 15.7e9, "olmo2_7b": 7.30e9,
                  "starcoder2_15b": 16e9, "gpt_oss_20b": 20.91e9, "llama3_8b": 8.03e9, "mixtral_8x7b": 46.7e9, "gemma2_9b": 9.24e9}


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_configs_count_like_transformers(name):
    data = json.loads((FIXTURES / f"{name}.json").read_text())
    graph = profile(f"hf:{FIXTURES / name}.json", 8, cache=False)
    assert graph.total_params == transformers_count(data)
    assert abs(graph.total_params / PUBLISHED_SIZE.get(name, graph.total_params) - 1) < 0.025
    assert len([layer for layer in graph.layers if layer.kind == "block"]) == data["num_hidden_layers"]


def test_deepseek_v3_is_traced_with_its_dense_and_moe_layers():
    graph = profile(f"hf:{FIXTURES / 'deepseek_v3.json'}", 8, cache=False)
    # DeepSeek-V3's 671 B (the 37.4 B of one MoE layer times 61 was the old answer).
    assert graph.total_params == 671_026_404_352
    assert graph.info.num_experts == 256 and graph.info.top_k == 8 and graph.info.dense_layers == 3
    assert 37.0e9 < graph.active_params < 38.0e9  # DeepSeek states 37 B activated
    blocks = [layer for layer in graph.layers if layer.kind == "block"]
    assert [b.repeat_of for b in blocks[:5]] == [None, "blocks.0", "blocks.0", None, "blocks.3"]
    assert blocks[0].expert_params == 0 and blocks[3].expert_params == 256 * 3 * 7168 * 2048
    assert graph.info.attn_implementation == "sdpa"


@pytest.mark.parametrize("name", ["deepseek_v3", "gpt_oss_20b", "mixtral_8x7b",
                                  "qwen3_30b_a3b"])
def test_traced_moe_dispatch_counts_a_copy_per_routed_expert(tmp_path, name):
    """transformers' experts take each token once beside a (tokens, top_k) index; the dispatch an
    engine runs sends top_k copies of it: dispatch_bytes is tokens * top_k * hidden (the graph
    contract, as the closed-form MoE profile counts it), the index and weights not counted."""
    seq = 32
    overrides = {"layer_types": ["sliding_attention", "full_attention"] * 2} if name == "gpt_oss_20b" else {}
    graph = profile(shrunk(name, tmp_path, **overrides), seq, cache=False)
    moe = [layer for layer in graph.layers if layer.expert_fwd_flops]
    assert moe and all(layer.dispatch_bytes == seq * graph.info.top_k * graph.info.hidden * 2 for layer in moe)


def test_gemma2_is_profiled_fused_and_alternates_sliding_and_global_layers(tmp_path):
    from meshplan.planner.models.hf_attention import FUSED_PROFILE_ATTENTION

    graph = profile(shrunk("gemma2_9b", tmp_path), 32, cache=False)
    assert graph.info.attn_implementation == FUSED_PROFILE_ATTENTION  # transformers runs Gemma-2 eagerly
    assert [layer.repeat_of for layer in graph.layers[1:5]] == [None, None, "blocks.0", "blocks.1"]
    assert any("sliding_window_size" in note for note in graph.info.notes)


def test_qwen3_moe_with_dense_layers_between_is_traced(tmp_path):
    """mlp_only_layers [2]: not a leading dense block, so transformers' own model is traced."""
    graph = profile(shrunk("qwen3_30b_a3b", tmp_path, mlp_only_layers=[2]), 32, cache=False)
    assert graph.info.family == "hf" and graph.info.num_experts == 8
    blocks = [layer for layer in graph.layers if layer.kind == "block"]
    assert [b.repeat_of for b in blocks] == [None, "blocks.0", None, "blocks.0"]
    assert blocks[2].expert_params == 0 < blocks[0].expert_params


@pytest.mark.parametrize("name,overrides", [("deepseek_v3", {}), ("gemma2_9b", {}),
                                            ("gemma3_1b", {"num_hidden_layers": 7}),
                                            ("qwen3_30b_a3b", {"mlp_only_layers": [1, 3]}), ("falcon_7b", {}),
                                            ("phi3_mini_4k", {"vocab_size": 32064})])
def test_collapsed_profile_equals_tracing_every_layer(tmp_path, monkeypatch, name, overrides):
    from meshplan.planner.models import hf

    spec = shrunk(name, tmp_path, **overrides)
    collapsed = profile(spec, 32, cache=False)
    monkeypatch.setattr(hf, "build_hf_for_profile", functools.partial(hf.build_hf_for_profile, collapse=False))
    full = profile(spec, 32, cache=False)
    assert [replace(layer, repeat_of=None) for layer in collapsed.layers] == \
        [replace(layer, repeat_of=None) for layer in full.layers]


def test_moe_profiles_in_fp32(tmp_path):
    """aten._grouped_mm's meta kernel takes bf16 only: fp32 runs through it with the same FLOPs."""
    spec = shrunk("deepseek_v3", tmp_path)
    bf16, fp32 = profile(spec, 32, cache=False), profile(spec, 32, dtype="fp32", cache=False)
    assert fp32.fwd_flops == bf16.fwd_flops and fp32.bwd_flops == bf16.bwd_flops
    assert sum(layer.param_bytes for layer in fp32.layers) == 4 * fp32.total_params
    block = fp32.layer("blocks.1")
    assert block.expert_fwd_flops == 32 * 2 * 2 * 3 * 128 * 32  # tokens x top-2 x SwiGLU's 3 GEMMs


def test_structurally_equal_layers_share_a_signature():
    from meshplan.planner.models.hf import expert_modules, layer_signature

    data = json.loads((FIXTURES / "gemma3_1b.json").read_text())
    config = transformers.AutoConfig.for_model(**{**data, "num_hidden_layers": 7})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    signatures = [layer_signature(layer, config) for layer in model.model.layers]
    assert len(set(signatures[:5])) == 1 and signatures[5] != signatures[0] and signatures[6] == signatures[0]
    assert expert_modules(model.model.layers[0]) == []
