"""Tensor-parallel splits of Hugging Face decoder layers, found from their modules and weight shapes
(`planner.models.hf_tp`), and what `plan` and `estimate` do with them."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshplan.planner.contracts.errors import MeshplanError

pytest.importorskip("transformers")

FIXTURES = Path(__file__).parent / "hf_configs"

# fixture -> (layout, column Linears, row Linears, heads, K/V heads, MLP width), published widths
EXPECTED = {
    "llama3_8b": ("separate", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                               "mlp.up_proj"), ("self_attn.o_proj", "mlp.down_proj"), 32, 8, 14336),
    "gemma2_9b": ("separate", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                               "mlp.up_proj"), ("self_attn.o_proj", "mlp.down_proj"), 16, 8, 14336),
    "gemma3_1b": ("separate", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                               "mlp.up_proj"), ("self_attn.o_proj", "mlp.down_proj"), 4, 1, 6912),
    "phi3_mini_4k": ("blocks", ("self_attn.qkv_proj", "mlp.gate_up_proj"), ("self_attn.o_proj", "mlp.down_proj"),
                     32, 32, 8192),
    "pythia_160m": ("per_head", ("attention.query_key_value", "mlp.dense_h_to_4h"),
                    ("attention.dense", "mlp.dense_4h_to_h"), 12, 12, 3072),
    "falcon_7b": ("multi_query", ("self_attention.query_key_value", "mlp.dense_h_to_4h"),
                  ("self_attention.dense", "mlp.dense_4h_to_h"), 71, 1, 18176),
    # q/k/v/o and MLP biases, c_fc/c_proj MLP
    "starcoder2_15b": ("separate", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.c_fc"),
                       ("self_attn.o_proj", "mlp.c_proj"), 48, 4, 24576),
    # q/k RMSNorms over all heads (4096 wide): split with the heads
    "olmo2_7b": ("separate", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                              "mlp.up_proj"), ("self_attn.o_proj", "mlp.down_proj"), 32, 32, 11008),
    # multi-head latent attention (the first layers are dense): heads of the value width 128
    "deepseek_v3": ("mla", ("self_attn.q_b_proj", "self_attn.kv_b_proj", "mlp.gate_proj", "mlp.up_proj"),
                    ("self_attn.o_proj", "mlp.down_proj"), 128, 128, 18432),
    "deepseek_v2_lite": ("mla", ("self_attn.q_proj", "self_attn.kv_b_proj", "mlp.gate_proj", "mlp.up_proj"),
                         ("self_attn.o_proj", "mlp.down_proj"), 16, 16, 10944),
}
NO_LAYOUT = {"gpt_oss_20b": "parameter self_attn.sinks is sized by the heads",
             "mamba_2p8b": "a state-space mixer (mixer) has no tensor-parallel split",
             "falcon_mamba_7b": "a state-space mixer (mixer) has no tensor-parallel split"}
# what stays whole on every rank (MLA's latent projections) and the norms split with the heads
KEPT_WHOLE = {"deepseek_v3": ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.q_a_layernorm",
                              "self_attn.kv_a_layernorm"),
              "deepseek_v2_lite": ("self_attn.kv_a_proj_with_mqa", "self_attn.kv_a_layernorm")}
WIDTH_NORMS = {"olmo2_7b": ("self_attn.q_norm", "self_attn.k_norm")}


def _first_layer(path: Path):
    """(the model built on meta with 2 decoder layers, its first decoder layer)."""
    from meshplan.planner.models.hf import _decoder_layers, build_hf_model

    built = build_hf_model(str(path), 16, num_layers=2)
    layers, _, _ = _decoder_layers(built.module.base_model, str(path))
    return built, layers[0]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_published_layers_split_by_their_layout(name):
    from meshplan.planner.models.hf_tp import tp_layout

    built, layer = _first_layer(FIXTURES / f"{name}.json")
    qkv, columns, rows, heads, kv_heads, width = EXPECTED[name]
    layout = tp_layout(layer)
    assert (layout.qkv, layout.column_linears, layout.row_linears) == (qkv, columns, rows)
    assert (layout.num_heads, layout.num_kv_heads, layout.mlp_width) == (heads, kv_heads, width)
    # the profile's block split records the same, for the cost model and the tracer
    split = next(g for g in built.layer_groups if g.name == "blocks.0").tp_split
    assert split.kind == "block" and split.column_linears == columns and split.row_linears == rows
    assert (split.num_heads, split.num_kv_heads, split.mlp_width, split.num_allreduce_per_pass) == (
        heads, kv_heads, width, 2)
    # every named Linear exists with the shape the head counts imply
    head_dim = layout.head_dim
    fused = layer.get_submodule(columns[0])
    if qkv not in ("separate", "mla"):
        assert fused.out_features == (heads + 2 * kv_heads) * head_dim
    assert (layout.replicated, layout.width_norms) == (KEPT_WHOLE.get(name, ()), WIDTH_NORMS.get(name, ()))
    assert layer.get_submodule(rows[0]).in_features == heads * head_dim
    assert layer.get_submodule(rows[1]).in_features == width


def test_falcon_7b_splits_no_tp_ways_and_phi3_fused_paths():
    from meshplan.planner.models.hf_tp import tp_layout

    _, falcon = _first_layer(FIXTURES / "falcon_7b.json")
    split = tp_layout(falcon).split()
    assert split.max_degree_ok(1) and not any(split.max_degree_ok(tp) for tp in (2, 4, 8))  # 71 heads, 1 K/V head
    _, phi3 = _first_layer(FIXTURES / "phi3_mini_4k.json")
    layout = tp_layout(phi3)
    assert layout.fused_qkv == "self_attn.qkv_proj" and layout.fused_gate_up == "mlp.gate_up_proj"
    assert layout.split().max_degree_ok(8) and not layout.split().max_degree_ok(3)


def test_falcon_grouped_layout_and_qk_norms_stay_replicated(tmp_path):
    from meshplan.planner.models.hf_tp import tp_layout

    falcon = tmp_path / "falcon.json"
    falcon.write_text(json.dumps({**json.loads((FIXTURES / "falcon_7b.json").read_text()), "hidden_size": 64,
                                  "num_attention_heads": 4, "new_decoder_architecture": True, "num_kv_heads": 2,
                                  "vocab_size": 300, "multi_query": False}))
    _, layer = _first_layer(falcon)
    layout = tp_layout(layer)
    assert (layout.qkv, layout.num_heads, layout.num_kv_heads, layout.head_dim) == ("grouped", 4, 2, 16)
    # Qwen3's q/k norms (one weight of head_dim, shared by the heads) are not split
    qwen = tmp_path / "qwen3.json"
    qwen.write_text(json.dumps({"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 96,
                                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                "head_dim": 16, "vocab_size": 300}))
    _, layer = _first_layer(qwen)
    layout = tp_layout(layer)
    assert layout.column_linears[:3] == ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    assert not any("norm" in name for name in layout.column_linears + layout.row_linears)


@pytest.mark.parametrize("name", sorted(NO_LAYOUT))
def test_layers_without_a_layout_say_why(name):
    from meshplan.planner.models.hf import expert_modules
    from meshplan.planner.models.hf_tp import block_split

    _, layer = _first_layer(FIXTURES / f"{name}.json")
    split = block_split(layer, expert_modules(layer))
    assert split.kind == "none" and NO_LAYOUT[name] in split.reason


def _cluster(tmp_path, gpus_per_node: int) -> str:
    """The cpu profile with another node size (a tp of 3 must divide it to reach the model check)."""
    from meshplan.planner.costing.hardware import PROFILES_DIR

    text = (PROFILES_DIR / "cpu.toml").read_text()
    assert "gpus_per_node = 8" in text
    path = tmp_path / "cluster.toml"
    path.write_text(text.replace("gpus_per_node = 8", f"gpus_per_node = {gpus_per_node}"))
    return str(path)


def _small_llama(tmp_path) -> str:
    path = tmp_path / "llama.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                "vocab_size": 300, "max_position_embeddings": 64}))
    return f"hf:{path}"


def test_estimate_refuses_a_tp_the_heads_do_not_divide_and_layers_without_layout(tmp_path):
    from meshplan.planner.simulation.estimator import estimate

    cluster = _cluster(tmp_path, 6)
    with pytest.raises(MeshplanError, match=r"--tp 3 does not divide layer 'blocks.0': 4 heads, 2 KV heads"):
        estimate(_small_llama(tmp_path), cluster, 6, 6, seq=16, tp=3)
    assert estimate(_small_llama(tmp_path), cluster, 6, 6, seq=16, tp=2).step_time_s > 0
    gpt2 = tmp_path / "gpt2.json"
    gpt2.write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 300,
                                "n_positions": 64}))
    with pytest.raises(MeshplanError, match=r"--tp 2: layer 'blocks.0' cannot be split over tensor-parallel "
                                            r"ranks: no attention of"):
        estimate(f"hf:{gpt2}", cluster, 2, 2, seq=16, tp=2)


def test_candidates_offer_tp_and_pp_for_hf_llama_but_not_sp_cp_or_falcon_7b_tp(tmp_path):
    from meshplan.planner.costing.hardware import load_cluster
    from meshplan.planner.profiling.profiler import profile
    from meshplan.planner.search.candidates import Pins, enumerate_candidates

    cluster = load_cluster("h100-sxm")
    graph = profile(f"hf:{FIXTURES / 'llama3_8b.json'}", 4096, cache=False)
    configs = enumerate_candidates(graph, cluster, 16, 64, Pins(zero=1, mbs=1))
    assert {c.tp for c in configs} == {1, 2, 4, 8} and {c.pp for c in configs} >= {1, 2, 4}
    assert not any(c.sp for c in configs) and all(c.cp == 1 for c in configs)
    falcon = profile(f"hf:{FIXTURES / 'falcon_7b.json'}", 2048, cache=False)
    assert {c.tp for c in enumerate_candidates(falcon, cluster, 16, 64, Pins(zero=1, mbs=1))} == {1}


def test_estimate_and_plan_commands_refuse_in_one_line(run_cli, tmp_path):
    cluster, spec = _cluster(tmp_path, 6), _small_llama(tmp_path)
    code, out, err = run_cli("estimate", "--model", spec, "--cluster", cluster, "--gpus", 6, "--gbs", 6,
                             "--seq", 16, "--tp", 3)
    assert code == 2 and not out and len(err.strip().splitlines()) == 1
    assert "--tp 3 does not divide layer 'blocks.0': 4 heads, 2 KV heads, MLP width 128" in err
    code, _, err = run_cli("plan", "--model", f"hf:{FIXTURES / 'falcon_7b.json'}", "--cluster", "h100-sxm",
                           "--gpus", 8, "--gbs", 8, "--seq", 512, "--tp", 2)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "--tp 2 does not divide layer 'blocks.0': 71 heads, 1 KV heads" in err


@pytest.mark.parametrize("name, columns, rows, width", [
    ("mixtral_8x7b", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",), 14336),
    ("qwen3_30b_a3b", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",), 768)])
def test_moe_layers_split_attention_by_layout_and_experts_by_width(name, columns, rows, width):
    """transformers' MoE layers: attention as laid out, the stacked experts by their width (the
    cost model's expert TP); one all-reduce for attention, one for the MoE output."""
    from meshplan.planner.models.hf import expert_modules
    from meshplan.planner.models.hf_tp import block_split, tp_layout

    _, layer = _first_layer(FIXTURES / f"{name}.json")
    layout = tp_layout(layer, expert_modules(layer))
    assert (layout.column_linears, layout.row_linears, layout.experts) == (columns, rows, ("mlp.experts",))
    split = block_split(layer, expert_modules(layer))
    assert (split.kind, split.mlp_width, split.num_allreduce_per_pass) == ("block", width, 2)
