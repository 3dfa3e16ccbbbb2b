"""The mixture-of-experts family: published parameter counts (total and active), spec parsing,
balanced routing on the meta device, real top-k routing on CPU, and Hugging Face MoE configs."""
from __future__ import annotations

import json

import pytest
import torch

from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.models.registry import PRESETS, build_model, is_moe_spec, parse_spec

# Published totals and active parameters per token, in billions, with the precision they are
# published to (Mistral AI's Mixtral 8x7B and 8x22B announcements; the Qwen3-30B-A3B and
# Qwen3-235B-A22B model cards).
PUBLISHED = {
    "mixtral-8x7b": (46.7, 12.9, 0.1),
    "mixtral-8x22b": (141, 39, 1),
    "qwen3-30b-a3b": (30.5, 3.3, 0.1),
    "qwen3-235b-a22b": (235, 22, 1),
}
TINY = "moe:layers=3,hidden=64,heads=4,kv_heads=2,experts=4,top_k=2,expert_ffn=48,vocab=256"


def _counts(module) -> tuple[int, int]:
    """(total, active) from the built module: a token uses top_k / experts of the routed experts."""
    cfg = module.cfg
    total = sum(p.numel() for p in module.parameters())
    routed = sum(p.numel() for name, p in module.named_parameters() if ".moe.experts." in name)
    return total, total - routed + routed * cfg.top_k // cfg.num_experts


def _formula(cfg) -> tuple[int, int]:
    """Parameters from the shape alone, term by term (untied, no biases, no dense blocks)."""
    h, d, heads, kv = cfg.hidden, cfg.head_dim, cfg.num_heads, cfg.kv_heads
    attention = 2 * h * heads * d + 2 * h * kv * d + (2 * d if cfg.qk_norm else 0)
    expert = 3 * h * cfg.expert_ffn
    common = attention + 2 * h + h * cfg.num_experts  # two norms, the router
    embeddings = 2 * cfg.padded_vocab() * h + h  # embedding, head, final norm
    total = embeddings + cfg.num_layers * (common + cfg.num_experts * expert)
    active = embeddings + cfg.num_layers * (common + cfg.top_k * expert)
    return total, active


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_match_published_total_and_active(name):
    module = build_model(name, 16).module  # meta: shapes only
    total, active = _counts(module)
    assert (total, active) == _formula(PRESETS[name])
    published_total, published_active, precision = PUBLISHED[name]
    assert abs(total / 1e9 - published_total) <= precision / 2
    if name == "qwen3-30b-a3b":
        # The shape gives 3.353B active; Qwen publishes 3.3B, the figure cut (not rounded) to 0.1B.
        assert int(active / 1e8) == 33
    else:
        assert abs(active / 1e9 - published_active) <= precision / 2


def test_mixtral_8x7b_exact_count():
    # 46,702,792,704: the parameter count of the released Mixtral-8x7B-v0.1 safetensors.
    assert _counts(build_model("mixtral-8x7b", 16).module)[0] == 46_702_792_704


def test_qwen3_modelled_details():
    cfg = PRESETS["qwen3-235b-a22b"]
    assert (cfg.head_dim, cfg.hidden // cfg.num_heads, cfg.qk_norm) == (128, 64, True)
    block = build_model("qwen3-30b-a3b", 16).module.blocks[0]
    assert tuple(block.attn.q.weight.shape) == (32 * 128, 2048)
    assert tuple(block.attn.q_norm.weight.shape) == (128,)


def test_spec_parses_moe_fields():
    cfg = parse_spec(TINY + ",shared_experts=2,dense_layers=1,ffn=96,head_dim=32,qk_norm=true", 64)
    assert (cfg.family, cfg.num_experts, cfg.top_k, cfg.expert_ffn) == ("moe", 4, 2, 48)
    assert (cfg.num_shared_experts, cfg.shared_ffn_dim, cfg.dense_layers, cfg.ffn_dim) == (2, 96, 1, 96)
    assert (cfg.head_dim, cfg.qk_norm, cfg.tied_embeddings) == (32, True, False)
    assert is_moe_spec(TINY) and is_moe_spec("mixtral-8x7b") and not is_moe_spec("llama3-8b")


@pytest.mark.parametrize("spec,match", [
    ("moe:layers=2,hidden=64,heads=4,vocab=256", "missing kv_heads, experts, top_k, expert_ffn"),
    (TINY.replace("top_k=2", "top_k=5"), "top_k must be between 1 and experts \\(4\\), got 5"),
    (TINY + ",dense_layers=1", "needs ffn"),
    (TINY + ",dense_layers=3,ffn=96", "dense_layers \\(3\\) must leave at least one MoE block of 3"),
    (TINY + ",qk_norm=maybe", "qk_norm must be true or false"),
    (TINY + ",capacity=2", "unknown key 'capacity'"),
])
def test_bad_moe_specs(spec, match):
    with pytest.raises(MeshplanError, match=match):
        parse_spec(spec, 64)


def _captured_counts(module, seq: int, device: str):
    seen = []
    handles = [block.moe.experts.register_forward_pre_hook(lambda m, args: seen.append(list(args[1])))
               for block in module.blocks if hasattr(block, "moe")]
    with torch.no_grad():
        module(torch.zeros(1, seq, dtype=torch.long, device=device))
    for handle in handles:
        handle.remove()
    return seen


@pytest.mark.parametrize("seq,experts,top_k", [(64, 4, 2), (96, 8, 2), (40, 16, 4)])
def test_balanced_routing_on_meta(seq, experts, top_k):
    spec = f"moe:layers=2,hidden=64,heads=4,kv_heads=2,experts={experts},top_k={top_k},expert_ffn=32,vocab=256"
    module = build_model(spec, seq).module
    counts = _captured_counts(module, seq, "meta")
    assert counts == [[seq * top_k // experts] * experts] * 2  # exactly tokens * k / E each
    router = module.blocks[0].moe.router
    _, chosen = router(torch.empty(seq, 64, device="meta"))
    assert chosen.shape == (seq, top_k)
    slots = torch.arange(seq * top_k).view(seq, top_k) % experts  # the assignment the router uses
    assert all(len(set(row.tolist())) == top_k for row in slots)  # k distinct experts per token


def test_balanced_routing_rounds_when_experts_do_not_divide():
    module = build_model("moe:layers=1,hidden=64,heads=4,kv_heads=2,experts=8,top_k=2,expert_ffn=32,vocab=256",
                         7).module
    (counts,) = _captured_counts(module, 7, "meta")
    assert sum(counts) == 14 and set(counts) == {1, 2}


def _reference_moe(moe, tokens):
    """Token by token: softmax, top-k, renormalise, sum of the chosen experts' SwiGLUs (+ shared)."""
    out = []
    for x in tokens:
        probs = torch.softmax(moe.router.gate(x).float(), -1)
        weights, experts = probs.topk(moe.top_k)
        weights = weights / weights.sum()
        y = torch.zeros_like(x)
        for weight, expert in zip(weights, experts.tolist()):
            gate, up, down = (lin.weight[expert] for lin in (moe.experts.gate, moe.experts.up, moe.experts.down))
            y = y + weight * ((torch.nn.functional.silu(x @ gate) * (x @ up)) @ down)
        if moe.shared is not None:
            y = y + moe.shared(x)
        out.append(y)
    return torch.stack(out)


def test_real_topk_routing_matches_reference_and_backpropagates():
    from meshplan.planner.models.transformer import init_weights

    spec = TINY + ",shared_experts=1,dense_layers=1,ffn=96"
    built = build_model(spec, 16, device="cpu", dtype=torch.float32)
    init_weights(built.module, seed=0)
    moe = built.module.blocks[1].moe
    tokens = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(moe(tokens[None])[0], _reference_moe(moe, tokens), rtol=1e-5, atol=1e-6)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    loss = built.loss_fn(built.module(ids), (ids,))
    loss.backward()
    assert torch.isfinite(loss)
    for name, param in built.module.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
    assert moe.router.gate.weight.grad.abs().sum() > 0 and moe.experts.down.weight.grad.abs().sum() > 0


# ---------------------------------------------------------------------------------------------
# Hugging Face MoE configs map onto the moe family with exactly their parameters.

HF_CONFIGS = {
    "mixtral": dict(model_type="mixtral", vocab_size=1000, hidden_size=64, intermediate_size=96,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                    num_experts_per_tok=2, rope_theta=1e6, tie_word_embeddings=False),
    "qwen2_moe": dict(model_type="qwen2_moe", vocab_size=1000, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=96,
                      mlp_only_layers=[0], decoder_sparse_step=1, tie_word_embeddings=False),
    "qwen3_moe": dict(model_type="qwen3_moe", vocab_size=1000, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, tie_word_embeddings=False),
}


def write_config(tmp_path, data: dict) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    return f"hf:{path}"


@pytest.mark.parametrize("model_type", sorted(HF_CONFIGS))
def test_hf_moe_configs_map_exactly(tmp_path, model_type):
    transformers = pytest.importorskip("transformers")
    data = HF_CONFIGS[model_type]
    spec = write_config(tmp_path, data)
    ours = build_model(spec, 16)
    assert ours.info.family == "moe" and ours.info.num_experts == data.get("num_experts", 4)
    config = transformers.AutoConfig.for_model(**data)
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(config)
    assert ours.info.padded_vocab == 1024  # the zoo pads 1000 to a multiple of 128: count that apart
    padding = 2 * (1024 - 1000) * 64
    assert sum(p.numel() for p in ours.module.parameters()) - padding == sum(p.numel() for p in theirs.parameters())


def test_hf_deepseek_v3_is_built_by_transformers(tmp_path):
    """Multi-head latent attention is transformers' module, traced as it is (not mapped)."""
    pytest.importorskip("transformers")
    spec = write_config(tmp_path, dict(model_type="deepseek_v3", hidden_size=64, intermediate_size=96,
                                       moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2,
                                       n_group=2, topk_group=1, kv_lora_rank=16, q_lora_rank=32, num_attention_heads=4,
                                       num_key_value_heads=4, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                                       num_hidden_layers=2, first_k_dense_replace=1, vocab_size=100))
    assert not is_moe_spec(spec)  # not the moe family: transformers' model
    built = build_model(spec, 16)
    assert built.info.family == "hf" and (built.info.num_experts, built.info.top_k) == (8, 2)


def test_hf_moe_dense_layers_between_are_traced_not_mapped(tmp_path):
    spec = write_config(tmp_path, {**HF_CONFIGS["qwen3_moe"], "num_hidden_layers": 4, "mlp_only_layers": [2]})
    assert not is_moe_spec(spec)
    pytest.importorskip("transformers")
    assert build_model(spec, 16).info.family == "hf"
