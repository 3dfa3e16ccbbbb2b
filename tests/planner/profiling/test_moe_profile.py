"""Profiling mixtures of experts under balanced routing: FLOPs, saved bytes and parameters of a
MoE block against a hand derivation, the graph's MoE fields, the CLI, and estimate end to end."""
from __future__ import annotations

import json

import pytest

from meshplan.planner.profiling.profiler import graph_from_json, graph_to_json, profile

SEQ, H, HEADS, KV, HEAD_DIM = 128, 256, 4, 2, 64
EXPERTS, TOP_K, F_EXPERT, SHARED, F_DENSE = 8, 2, 96, 2, 512
SPEC = (f"moe:layers=3,hidden={H},heads={HEADS},kv_heads={KV},experts={EXPERTS},top_k={TOP_K},"
        f"expert_ffn={F_EXPERT},vocab=1000,shared_experts={SHARED},dense_layers=1,ffn={F_DENSE}")


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHPLAN_CACHE_DIR", str(tmp_path / "cache"))


def _attention_flops(s: int) -> int:
    """q, k, v, o Linears and the attention matmuls (in full, the model-FLOPs convention)."""
    linears = 2 * s * H * (HEADS * HEAD_DIM) * 2 + 2 * s * H * (KV * HEAD_DIM) * 2
    return linears + 4 * s * s * HEADS * HEAD_DIM


def test_moe_block_flops_match_hand_derivation():
    graph = profile(SPEC, SEQ, cache=False)
    dense, moe = graph.layer("blocks.0"), graph.layer("blocks.1")
    s = SEQ
    router = 2 * s * H * EXPERTS  # Linear(h -> E) on every token
    experts = s * TOP_K * 3 * 2 * H * F_EXPERT  # gate, up, down on each routed copy
    shared = 3 * 2 * s * H * (SHARED * F_EXPERT)  # one SwiGLU of the summed shared width
    assert moe.fwd_flops == _attention_flops(s) + router + experts + shared
    assert moe.expert_fwd_flops == experts
    # Backward: a grad-input and a grad-weight product per forward product.
    assert (moe.bwd_flops, moe.expert_bwd_flops) == (2 * moe.fwd_flops, 2 * experts)
    assert dense.fwd_flops == _attention_flops(s) + 3 * 2 * s * H * F_DENSE
    assert (dense.expert_fwd_flops, dense.expert_params, dense.dispatch_bytes) == (0, 0, 0)
    # Causal kernels skip the masked half of the score products, nothing else.
    assert moe.causal_fwd_flops == moe.fwd_flops - 4 * s * s * HEADS * HEAD_DIM * (s - 1) // (2 * s)


def test_moe_block_parameters_and_routed_bytes():
    graph = profile(SPEC, SEQ, cache=False)
    moe = graph.layer("blocks.1")
    per_expert = 3 * H * F_EXPERT
    attention = 2 * H * HEADS * HEAD_DIM + 2 * H * KV * HEAD_DIM
    assert moe.num_params == attention + 2 * H + H * EXPERTS + EXPERTS * per_expert + 3 * H * SHARED * F_EXPERT
    assert (moe.expert_params, moe.active_expert_params) == (EXPERTS * per_expert, TOP_K * per_expert)
    assert moe.active_params == moe.num_params - (EXPERTS - TOP_K) * per_expert
    assert graph.active_params == graph.total_params - 2 * (EXPERTS - TOP_K) * per_expert
    p = 2  # bf16
    assert moe.dispatch_bytes == SEQ * TOP_K * H * p  # the routed copies of the tokens
    # Saved inside the experts: the dispatched tokens (once, the gate and up products share them),
    # the gate and up outputs the fused SwiGLU keeps, and the down product's input.
    assert moe.expert_act_bytes == SEQ * TOP_K * (H + 3 * F_EXPERT) * p
    assert moe.expert_act_bytes < moe.activation_bytes
    assert [layer.repeat_of for layer in graph.layers] == [None, None, None, "blocks.1", None]
    info = graph.info
    assert (info.family, info.num_experts, info.top_k, info.dense_layers, info.moe_imbalance) == \
        ("moe", EXPERTS, TOP_K, 1, 1.0)


def test_dense_graphs_have_no_moe_fields():
    graph = profile("llama:layers=2,hidden=128,heads=4,kv_heads=2,ffn=256,vocab=512", 64)
    assert graph.active_params == graph.total_params and not graph.info.is_moe
    assert all(layer.expert_params == layer.expert_fwd_flops == layer.dispatch_bytes == 0 for layer in graph.layers)


def test_imbalance_is_recorded_and_cache_round_trips():
    graph = profile(SPEC, SEQ, moe_imbalance=1.25)
    assert graph.info.moe_imbalance == 1.25
    again = graph_from_json(json.loads(json.dumps(graph_to_json(graph))))
    assert again == graph and again.layer("blocks.2").expert_fwd_flops == graph.layer("blocks.1").expert_fwd_flops
    assert profile(SPEC, SEQ).info.moe_imbalance == 1.0  # the cached graph stays balanced


def test_moe_specs_profile_in_closed_form_equal_to_the_trace():
    """MoE specs get their graph from `analytic_moe` (not the dense closed form's families), and
    it equals the meta trace (tests/planner/profiling/test_analytic_moe.py covers a grid)."""
    from meshplan.planner.models.registry import parse_spec
    from meshplan.planner.profiling.analytic import FAMILIES

    assert parse_spec(SPEC, SEQ).family not in FAMILIES
    assert profile(SPEC, SEQ, trace=True, cache=False) == profile(SPEC, SEQ, cache=False)


def test_hf_qwen3_moe_profiles(tmp_path):
    pytest.importorskip("transformers")
    config = dict(model_type="qwen3_moe", vocab_size=1024, hidden_size=128, intermediate_size=256,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    graph = profile(f"hf:{path}", 64)
    assert graph.info.family == "moe" and graph.info.num_experts == 8
    block = graph.layer("blocks.0")
    assert block.expert_fwd_flops == 64 * 2 * 3 * 2 * 128 * 64
    assert block.expert_params == 8 * 3 * 128 * 64 and graph.layer("blocks.1").repeat_of == "blocks.0"


def test_profile_cli_json_and_errors(run_cli):
    code, out, _ = run_cli("profile", "--model", "mixtral-8x7b", "--seq", "256", "--json", "--moe-imbalance", "1.2")
    assert code == 0
    data = json.loads(out)
    assert (data["total_params"], data["active_params"]) == (46_702_792_704, 12_879_925_248)
    assert (data["moe_imbalance"], data["top_k"], data["routing"]) == (1.2, 2, "balanced")
    code, out, _ = run_cli("profile", "--model", "mixtral-8x7b", "--seq", "256")
    assert code == 0 and "46.7 B total, 12.9 B active per token" in out
    code, out, _ = run_cli("profile", "--model", "llama3-8b", "--seq", "256", "--json")
    assert "active_params" not in json.loads(out)
    for argv, match in ((("--model", "llama3-8b", "--moe-imbalance", "1.2"), "needs a mixture-of-experts"),
                        (("--model", "mixtral-8x7b", "--moe-imbalance", "0.9"), ">= 1.0"),
                        (("--model", "deepseek-v3", "--seq", "163841"), "exceeds the 163,840 positions")):
        code, _, err = run_cli("profile", "--seq", "256", *argv)
        assert code == 2 and match in err and len(err.strip().splitlines()) == 1


def test_estimate_qwen3_30b_a3b_end_to_end(run_cli):
    code, out, err = run_cli("estimate", "--model", "qwen3-30b-a3b", "--cluster", "h100-sxm", "--gpus", "64",
                             "--gbs", "64", "--seq", "4096", "--zero", "3", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["step_time_s"] > 0 and data["memory_bytes"]
    assert data["breakdown"].get("ep_comm", 0.0) == 0.0  # ep 1: no all-to-all between ranks
    assert all(rank["experts"] > 0 for rank in data["memory_bytes"])
    assert "balanced routing" in err  # the routing assumption is stated
    code, out, err = run_cli("estimate", "--model", "qwen3-30b-a3b", "--cluster", "h100-sxm", "--gpus", "64",
                             "--gbs", "64", "--seq", "4096", "--zero", "3", "--moe-imbalance", "1.3", "--json")
    assert code == 0 and "1.3x the balanced share" in err
    assert json.loads(out)["step_time_s"] > data["step_time_s"]  # the busiest rank's experts take longer
