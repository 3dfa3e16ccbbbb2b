"""Hugging Face configs as the training engines build them.

Megatron-Bridge and torchtitan do not train transformers' modules: they read a Hugging Face
checkpoint into their own model code. Megatron-Bridge registers a bridge per architecture that
builds Megatron-Core's `GPTModel` (Transformer Engine's fused norms, fused attention, bias-SwiGLU)
from the config (src/megatron/bridge/models/llama/llama_bridge.py, mistral/mistral_bridge.py,
qwen/qwen2_bridge.py and qwen/qwen3_bridge.py at commit 067f987df03b8355b03192d88d70f1709fedf51a:
`register_bridge(source=LlamaForCausalLM, target=GPTModel)`, Qwen2 with `add_qkv_bias`, Qwen3 with
`qk_layernorm`); torchtitan's own Llama 3 and Qwen3 models load such checkpoints through their
`state_dict_adapter.py` (torchtitan/models/llama3, torchtitan/models/qwen3). What those engines
save for backward and how long their kernels take is theirs, not what transformers' eager modules
keep (fp32 copies in every RMSNorm, unfused RoPE and SwiGLU), so under `--engine megatron` or
`--engine torchtitan` meshplan prices such a config as the zoo's `llama` family with exactly its
shapes (`engine_config`): the same graph, memory and time as the equivalent `llama:` model. Under
meshplan's own executor, which trains transformers' modules as written, the config is traced.

A config maps only when the `llama` family builds its blocks exactly: SiLU-gated MLPs without
biases, no bias on the output projection, no sliding window; Llama's `attention_bias` (biases on
q, k, v and o) and `mlp_bias`, Mistral's `sliding_window` and Qwen's `use_sliding_window` keep it
traced, as do every other architecture and, under torchtitan, a Llama with tied embeddings
(torchtitan's Llama 3 flavours all keep a separate output projection: such a config is traced,
the cautious side). Shape-free settings are not carried: RoPE scaling,
dropout, initialisation.
"""
from __future__ import annotations

from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.models.config import TransformerConfig
from meshplan.planner.models.hf_config import positive_int, read_config, rope_theta

# model_type -> the engine's own model code for it.
OWN_MODELS = {
    "megatron": {"llama": "Megatron-Core's GPTModel (Megatron-Bridge's llama bridge)",
                 "mistral": "Megatron-Core's GPTModel (Megatron-Bridge's mistral bridge)",
                 "qwen2": "Megatron-Core's GPTModel (Megatron-Bridge's qwen2 bridge)",
                 "qwen3": "Megatron-Core's GPTModel (Megatron-Bridge's qwen3 bridge)"},
    "torchtitan": {"llama": "torchtitan's Llama 3 model",
                   "qwen3": "torchtitan's Qwen3 model"},
}
_SHAPE_KEYS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size", "intermediate_size")
# Routed-expert counts as configs name them: DeepSeek's, Mixtral's and GPT-OSS's, Qwen's.
_EXPERT_KEYS = ("n_routed_experts", "num_local_experts", "num_experts")


def engine_config(path_text: str, engine: str) -> TransformerConfig | None:
    """The `llama`-family config `engine` builds for the Hugging Face config at `path_text`; None
    when the engine trains transformers' modules, or its own code does not build this config's
    blocks as the `llama` family does (module docstring)."""
    data = read_config(path_text)
    model_type = data.get("model_type")
    if model_type not in OWN_MODELS.get(engine, {}) or not _llama_blocks(data, model_type):
        return None
    tied = bool(data.get("tie_word_embeddings", False))  # the four config classes' default
    if engine == "torchtitan" and model_type == "llama" and tied:
        return None
    missing = [key for key in _SHAPE_KEYS if not positive_int(data.get(key))]
    if missing:
        raise MeshplanError(f"HF config {path_text!r} ({model_type}): missing or non-integer {', '.join(missing)}")
    try:
        return TransformerConfig(
            family="llama", num_layers=data["num_hidden_layers"], hidden=data["hidden_size"],
            num_heads=data["num_attention_heads"], vocab=data["vocab_size"], ffn=data["intermediate_size"],
            num_kv_heads=positive_int(data.get("num_key_value_heads")), tied_embeddings=tied,
            norm_eps=float(data.get("rms_norm_eps", 1e-6)), rope_theta=rope_theta(data),
            attn_head_dim=positive_int(data.get("head_dim")), qkv_bias=model_type == "qwen2",
            qk_norm=model_type == "qwen3")
    except ValueError as exc:
        raise MeshplanError(f"HF config {path_text!r} ({model_type}): {exc}") from None


def zoo_config(path_text: str, engine: str) -> TransformerConfig | None:
    """The zoo config `engine` runs for the Hugging Face config: a Mixtral / Qwen MoE config's `moe`
    config (`hf.hf_moe_config`, every engine), else `engine_config`; None when it stays traced."""
    from meshplan.planner.models.hf import hf_moe_config

    return hf_moe_config(path_text) or engine_config(path_text, engine)


def engine_note(path_text: str, engine: str) -> str:
    """What `estimate` and `plan` say of the config under `engine`: that it is priced as the engine's
    own model (`engine_model_note`), or that its traced experts' memory is not torchtitan's
    (`traced_experts_note`); '' otherwise."""
    if engine_config(path_text, engine) is not None:
        return engine_model_note(path_text, engine)
    return traced_experts_note(path_text, engine)


def engine_model_note(path_text: str, engine: str) -> str:
    """One line saying which engine code prices a config `engine_config` maps."""
    model_type = read_config(path_text)["model_type"]
    return (f"priced as {engine} builds it: {OWN_MODELS[engine][model_type]}, not transformers' modules "
            "(the same shapes as a llama: spec)")


def traced_experts_note(path_text: str, engine: str) -> str:
    """Under torchtitan, for a mixture of experts that stays traced (not a Mixtral / Qwen MoE config
    the moe family builds): its memory is transformers' modules', not torchtitan's own; '' otherwise.
    (Megatron's formulas cover traced MoE configs: `engine_memory.formulas_describe`.)"""
    if engine != "torchtitan":
        return ""
    data = read_config(path_text)
    if not any(positive_int(data.get(key)) for key in _EXPERT_KEYS):
        return ""
    from meshplan.planner.models.hf import hf_moe_config

    if hf_moe_config(path_text) is not None:
        return ""
    return ("torchtitan trains its own mixture-of-experts modules; this traced config's memory is priced with "
            "transformers' modules' saved tensors (their eager experts keep several per routed copy), more than "
            "torchtitan keeps")


def _llama_blocks(data: dict, model_type: str) -> bool:
    """Whether the `llama` family builds this config's decoder blocks exactly."""
    activation = data.get("hidden_act", data.get("hidden_activation", "silu"))
    if activation != "silu" or data.get("mlp_bias") or data.get("attention_bias"):
        return False
    if model_type == "mistral" and data.get("sliding_window") is not None:
        return False
    if model_type in ("qwen2", "qwen3") and data.get("use_sliding_window"):
        return False
    return not data.get("layer_types") or set(data["layer_types"]) == {"full_attention"}


