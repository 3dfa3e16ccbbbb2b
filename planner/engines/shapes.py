"""Model shapes between meshplan SPECs and the engines' model descriptions.

torchtitan names a model by (name, flavour); Megatron-LM by its shape arguments; DeepSpeed not at
all (the model is the user's code). A shape that matches a meshplan preset gets the preset's name,
any other zoo shape a parametric `llama:`/`gpt:` spec.
"""
from __future__ import annotations

from meshplan.planner.models.config import TransformerConfig
from meshplan.planner.models.registry import PRESETS, parse_spec

# torchtitan's flavours (torchtitan/models/<name>/__init__.py at v0.2.2) and meshplan's presets of the
# same shape: Llama 3's; Qwen3's MoE ones (48 and 94 layers of 128 experts, top 8, head width 128,
# q/k norms, untied); DeepSeek-V3's "671B" (61 layers, 3 dense, 256 routed and 1 shared expert, top 8
# in 4 of 8 groups) and "16B" (DeepSeek-V2-Lite's: 27 layers, 1 dense, 64 routed and 2 shared, top
# 6, no q compression); GPT-OSS's "20b" and "120b" (24 and 36 layers of 32 and 128 experts, top 4).
TORCHTITAN_FLAVOURS = {("llama3", "8B"): "llama3-8b", ("llama3", "70B"): "llama3-70b",
                       ("llama3", "405B"): "llama3-405b", ("qwen3", "30B-A3B"): "qwen3-30b-a3b",
                       ("qwen3", "235B-A22B"): "qwen3-235b-a22b", ("deepseek_v3", "671B"): "deepseek-v3",
                       ("deepseek_v3", "16B"): "deepseek-v2-lite", ("gpt_oss", "20b"): "gpt-oss-20b",
                       ("gpt_oss", "120b"): "gpt-oss-120b"}


def zoo_shape(spec: str, seq: int) -> TransformerConfig | None:
    """The TransformerConfig of a preset or parametric spec; None for file and hf: models."""
    return parse_spec(spec, seq)


def _key(cfg: TransformerConfig) -> tuple:
    return (cfg.family, cfg.num_layers, cfg.hidden, cfg.num_heads, cfg.kv_heads, cfg.ffn_dim, cfg.vocab,
            cfg.tied_embeddings, cfg.num_experts, cfg.top_k, cfg.expert_ffn, cfg.shared_ffn_dim, cfg.dense_layers,
            cfg.head_dim, cfg.qk_norm, cfg.qkv_bias)


def _attention_keys(cfg: TransformerConfig) -> str:
    """The spec keys of a Llama-style attention beyond the defaults: head_dim, qk_norm, qkv_bias."""
    keys = f",head_dim={cfg.head_dim}" if cfg.head_dim * cfg.num_heads != cfg.hidden else ""
    return keys + (",qk_norm=1" if cfg.qk_norm else "") + (",qkv_bias=1" if cfg.qkv_bias else "")


def spec_for_shape(cfg: TransformerConfig) -> str:
    """The preset with this shape (rope base and norm epsilon aside: they cost nothing), else a
    parametric spec."""
    for name, preset in PRESETS.items():
        if _key(preset) == _key(cfg):
            return name
    keys = f"layers={cfg.num_layers},hidden={cfg.hidden},heads={cfg.num_heads},vocab={cfg.vocab},ffn={cfg.ffn_dim}"
    if cfg.family == "moe":
        return (f"moe:layers={cfg.num_layers},hidden={cfg.hidden},heads={cfg.num_heads},kv_heads={cfg.kv_heads},"
                f"experts={cfg.num_experts},top_k={cfg.top_k},expert_ffn={cfg.expert_ffn},vocab={cfg.vocab},"
                f"shared_experts={cfg.num_shared_experts},dense_layers={cfg.dense_layers},ffn={cfg.ffn_dim},"
                f"tied={int(cfg.tied_embeddings)}{_attention_keys(cfg)}")
    if cfg.family == "llama":
        return f"llama:{keys},kv_heads={cfg.kv_heads},tied={int(cfg.tied_embeddings)}{_attention_keys(cfg)}"
    return f"gpt:{keys},tied={int(cfg.tied_embeddings)},positions={cfg.max_positions}"


def torchtitan_flavour(spec: str) -> tuple[str, str] | None:
    """(name, flavour) of the torchtitan model with this preset's shape, if there is one; an `hf:`
    config by its shape: a Mixtral / Qwen MoE one as the moe family builds it (`hf.hf_moe_config`),
    a Llama-style one as torchtitan's own model (`hf_engine.engine_config`)."""
    from meshplan.planner.models.registry import hf_config_path

    config_path = hf_config_path(spec)
    if config_path is not None:
        from meshplan.planner.models.hf_engine import zoo_config

        cfg = zoo_config(config_path, "torchtitan")
        spec = spec_for_shape(cfg) if cfg is not None else spec
    for key, preset in TORCHTITAN_FLAVOURS.items():
        if preset == spec:
            return key
    return None
