"""Hugging Face causal LMs from a config file: the `hf:path/config.json` spec.

Needs the optional `transformers` extra; nothing is downloaded and no weights exist: the model is
built from its config on the meta device. Layers: the input embedding, each decoder layer, and
the final norm + output head (+ the loss). transformers' own mask code calls `.item()`, which
the meta device cannot do, so the forward passes a ready 4-D boolean causal mask.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.contracts.graph import ModelInfo, TPSplit

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
    return int(_make_config(path_text).vocab_size)


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
