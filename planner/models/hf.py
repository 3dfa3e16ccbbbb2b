"""Hugging Face causal LMs from a config file: the `hf:path/config.json` spec.

Needs the optional `transformers` extra; nothing is downloaded and no weights exist: the model is
built from its config on the meta device. Layers: the input embedding, each decoder layer, and
the final norm + output head (+ the loss). transformers' own mask code calls `.item()`, which
the meta device cannot do, so the forward passes a ready 4-D boolean causal mask.

Mixture-of-experts configs (`mixtral`, `qwen2_moe`, `qwen3_moe`) are not built through
transformers: `hf_moe_config` maps them onto meshplan's `moe` family (`planner.models.moe`), so
they profile under its balanced-routing assumption with exactly their parameters (Qwen3's q/k norms
and head_dim, Qwen2-MoE's q/k/v biases and gated shared expert included). Not carried over, as they
change no shape: routing-weight renormalisation (`norm_topk_prob`; meshplan renormalises), the
auxiliary-loss settings, and sliding windows (profiled as full causal attention). Other MoE
types (`deepseek_v3`, ...) are refused with what meshplan lacks for them.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.contracts.graph import ModelInfo, TPSplit
from meshplan.planner.models.config import TransformerConfig

# Megatron column/row Linears of a Llama-style decoder layer, relative to the layer.
_COLUMN_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
_ROW_LINEARS = ("self_attn.o_proj", "mlp.down_proj")
_FINAL_NORM_NAMES = ("norm", "ln_f", "final_layernorm", "final_layer_norm")


def read_config(path_text: str) -> dict:
    path = Path(path_text)
    if not path.is_file():
        raise MeshplanError(f"HF config {path_text!r} not found; use hf:path/config.json (a config file, no weights)")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MeshplanError(f"HF config {path_text!r} is not valid JSON: {exc}") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise MeshplanError(f"HF config {path_text!r} has no \"model_type\"; it must be a transformers config.json")
    return data


def hf_max_positions(path_text: str) -> int:
    """The config's position limit (0 when absent or unreadable): caps the default --seq."""
    try:
        data = json.loads(Path(path_text).read_text())
    except (OSError, ValueError):
        return 0
    value = data.get("max_position_embeddings", data.get("n_positions", 0)) if isinstance(data, dict) else 0
    return value if isinstance(value, int) and value > 0 else 0


def hf_vocab(path_text: str) -> int:
    """The vocabulary size transformers reads from the config (no model is built)."""
    moe = hf_moe_config(path_text)
    if moe is not None:
        return moe.vocab
    return int(_make_config(path_text).vocab_size)


# MoE model types meshplan maps onto its moe family, and those it cannot (with what is missing).
_MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
_UNMODELLED_MOE = {
    "deepseek_v3": "multi-head latent attention (kv_lora_rank / q_lora_rank projections) and DeepSeek's "
                   "grouped sigmoid routing are not modelled",
    "deepseek_v2": "multi-head latent attention (kv_lora_rank / q_lora_rank projections) is not modelled",
}
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")
# Config key of each MoE field, by model type (intermediate_size is each expert's width in Mixtral).
_EXPERT_FIELDS = {
    "mixtral": {"num_experts": "num_local_experts", "top_k": "num_experts_per_tok", "expert_ffn": "intermediate_size"},
    "qwen2_moe": {"num_experts": "num_experts", "top_k": "num_experts_per_tok", "expert_ffn": "moe_intermediate_size"},
    "qwen3_moe": {"num_experts": "num_experts", "top_k": "num_experts_per_tok", "expert_ffn": "moe_intermediate_size"},
}


def hf_moe_config(path_text: str) -> TransformerConfig | None:
    """The meshplan `moe` config of a Mixtral / Qwen2-MoE / Qwen3-MoE config.json; None for
    configs without experts; MeshplanError for MoE types meshplan does not model."""
    data = read_config(path_text)
    model_type = data["model_type"]
    if model_type not in _MOE_TYPES:
        if model_type in _UNMODELLED_MOE or any(data.get(key) for key in _EXPERT_KEYS):
            reason = _UNMODELLED_MOE.get(model_type, "its expert layout is not one meshplan maps")
            raise MeshplanError(f"HF config {path_text!r}: model_type {model_type!r} is a mixture of experts that "
                                f"meshplan cannot profile: {reason}; supported MoE types: {', '.join(_MOE_TYPES)}")
        return None
    wanted = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size") + tuple(
        _EXPERT_FIELDS[model_type].values())
    missing = [key for key in wanted if not isinstance(data.get(key), int)]
    if missing:
        raise MeshplanError(f"HF config {path_text!r} ({model_type}): missing or non-integer {', '.join(missing)}")
    fields = dict(family="moe", num_layers=data["num_hidden_layers"], hidden=data["hidden_size"],
                  num_heads=data["num_attention_heads"], vocab=data["vocab_size"],
                  num_kv_heads=data.get("num_key_value_heads") or 0,
                  tied_embeddings=bool(data.get("tie_word_embeddings", False)),
                  norm_eps=float(data.get("rms_norm_eps", 1e-6)), rope_theta=_rope_theta(data),
                  attn_head_dim=data.get("head_dim") or 0,
                  **{name: data[key] for name, key in _EXPERT_FIELDS[model_type].items()})
    if model_type != "mixtral":
        fields.update(_qwen_moe_fields(data, model_type, path_text))
    try:
        return TransformerConfig(**fields)
    except (TypeError, ValueError) as exc:
        raise MeshplanError(f"HF config {path_text!r} ({model_type}): {exc}") from None


def _rope_theta(data: dict) -> float:
    parameters = data.get("rope_parameters") if isinstance(data.get("rope_parameters"), dict) else {}
    return float(data.get("rope_theta") or parameters.get("rope_theta") or 10000.0)


def _qwen_moe_fields(data: dict, model_type: str, path_text: str) -> dict:
    """Qwen2-MoE: q/k/v biases, one gated shared expert; Qwen3-MoE: q/k norms. Both: dense blocks
    at `mlp_only_layers` and off the `decoder_sparse_step` grid, which meshplan needs to lead."""
    layers, step = data["num_hidden_layers"], data.get("decoder_sparse_step", 1) or 1
    only_dense = set(data.get("mlp_only_layers") or ())
    dense = [i for i in range(layers) if i in only_dense or (i + 1) % step]
    if dense != list(range(len(dense))):
        raise MeshplanError(f"HF config {path_text!r} ({model_type}): dense blocks at layers {dense[:8]} "
                            "(mlp_only_layers / decoder_sparse_step); meshplan's moe family puts dense blocks first")
    fields = {"dense_layers": len(dense), "ffn": data.get("intermediate_size", 0) if dense else 0}
    if model_type == "qwen3_moe":
        if data.get("attention_bias"):
            raise MeshplanError(f"HF config {path_text!r} (qwen3_moe): attention_bias (an o_proj bias too) is not "
                                "modelled")
        return {**fields, "qk_norm": True}
    shared = data.get("shared_expert_intermediate_size", 0) or 0
    return {**fields, "qkv_bias": bool(data.get("qkv_bias", True)), "num_shared_experts": 1 if shared else 0,
            "shared_expert_ffn": shared, "shared_expert_gate": bool(shared)}


def _make_config(path_text: str, num_layers: int | None = None):
    data = read_config(path_text)
    try:
        import transformers
    except ImportError:
        raise MeshplanError("hf: model specs need the optional transformers extra: pip install 'meshplan[hf]'") from None
    try:
        config = transformers.AutoConfig.for_model(**data)
    except Exception as exc:  # noqa: BLE001 - transformers' own validation errors are not ValueErrors
        raise MeshplanError(f"HF config {path_text!r}: transformers cannot read it: {exc}") from None
    from meshplan.planner.models.built import MAX_PARAMETRIC_LAYERS

    layers = getattr(config, "num_hidden_layers", None)
    if num_layers is None and isinstance(layers, int) and not 1 <= layers <= MAX_PARAMETRIC_LAYERS:
        raise MeshplanError(f"HF config {path_text!r}: num_hidden_layers must be between 1 and "
                            f"{MAX_PARAMETRIC_LAYERS:,}, got {layers}")
    if num_layers is not None:
        config.num_hidden_layers = num_layers
        if isinstance(getattr(config, "layer_types", None), list):
            config.layer_types = config.layer_types[:num_layers]
    return config


def _uniform_layers(config) -> bool:
    """Whether all decoder layers share one structure (so one of them stands for all)."""
    layer_types = getattr(config, "layer_types", None)
    return not layer_types or len(set(layer_types)) == 1


def build_hf_model(path_text: str, seq: int, device: str = "meta", dtype=None, num_layers: int | None = None):
    """The whole model (or its first `num_layers` decoder layers) from the config file."""
    import torch

    from meshplan.planner.models.built import BuiltModel, LayerGroup
    from meshplan.planner.models.transformer import lm_loss

    config = _make_config(path_text, num_layers)
    try:
        import transformers

        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    except Exception as exc:  # noqa: BLE001 - any failure to build from the user's config is bad input
        raise MeshplanError(f"HF config {path_text!r}: cannot build a causal LM from it: {exc}") from None
    base = model.base_model
    decoder_layers = _decoder_layers(base, path_text)
    norm = next((getattr(base, n) for n in _FINAL_NORM_NAMES if isinstance(getattr(base, n, None), torch.nn.Module)), None)
    head_modules = tuple(m for m in (norm, model.get_output_embeddings()) if m is not None)
    vocab = TPSplit(kind="vocab", vocab_size=config.vocab_size)
    groups = ((LayerGroup("embed", "embedding", (model.get_input_embeddings(),), vocab),)
              + tuple(LayerGroup(f"blocks.{i}", "block", (layer,), _block_split(layer, config))
                      for i, layer in enumerate(decoder_layers))
              + (LayerGroup("head", "head", head_modules, vocab),))
    tokens = torch.zeros(1, seq, dtype=torch.long, device=device)
    mask = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()[None, None]

    def forward(module, inputs):
        return module(input_ids=inputs[0], attention_mask=mask, use_cache=False).logits

    layer_modules = tuple((g.name, g.kind, g.modules[0] if len(g.modules) == 1 else torch.nn.ModuleList(g.modules))
                          for g in groups)
    return BuiltModel(module=model, example_inputs=(tokens,), info=_info(config), layer_modules=layer_modules,
                      loss_fn=lambda logits, inputs: lm_loss(logits, inputs[0]), targets=tokens,
                      forward_fn=forward, layer_groups=groups)


def build_hf_for_profile(path_text: str, seq: int, dtype=None):
    """One decoder layer stands for all when the config gives them one type."""
    from meshplan.planner.models.built import ProfileModel

    config = _make_config(path_text)
    if not _uniform_layers(config):
        return ProfileModel(build_hf_model(path_text, seq, dtype=dtype), ())
    total = config.num_hidden_layers
    built = build_hf_model(path_text, seq, dtype=dtype, num_layers=1)
    built = replace(built, info=replace(built.info, num_layers=total))
    layout = (("embed", "embedding", "embed"),) + tuple(
        (f"blocks.{i}", "block", "blocks.0") for i in range(total)) + (("head", "head", "head"),)
    return ProfileModel(built, layout)


def _decoder_layers(base, path_text: str):
    import torch

    lists = [m for m in base.children() if isinstance(m, torch.nn.ModuleList)]
    if not lists:
        raise MeshplanError(f"HF config {path_text!r}: the model has no list of decoder layers meshplan can split")
    return max(lists, key=len)


def _block_split(layer, config) -> TPSplit:
    """Megatron split when the layer has Llama-style q/k/v/o and gate/up/down Linears."""
    present = {name for name, _ in layer.named_modules()}
    if not all(name in present for name in _ROW_LINEARS[:1] + _COLUMN_LINEARS[:3]):
        return TPSplit()
    heads = config.num_attention_heads
    rows = tuple(n for n in _ROW_LINEARS if n in present)
    return TPSplit(kind="block", column_linears=tuple(n for n in _COLUMN_LINEARS if n in present),
                   row_linears=rows, num_heads=heads, num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                   num_allreduce_per_pass=len(rows))


def _info(config) -> ModelInfo:
    heads = getattr(config, "num_attention_heads", 0) or 0
    return ModelInfo(family="hf", num_layers=getattr(config, "num_hidden_layers", 0) or 0,
                     hidden=getattr(config, "hidden_size", 0) or 0, num_heads=heads,
                     num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                     ffn=getattr(config, "intermediate_size", 0) or 0, vocab=config.vocab_size,
                     padded_vocab=config.vocab_size, tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)))
