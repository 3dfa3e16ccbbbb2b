"""Hugging Face causal LMs from a config file: the `hf:path/config.json` spec.

Needs the optional `transformers` extra; nothing is downloaded and no weights exist: the model is
built from its config on the meta device. Layers: the input embedding, each decoder layer, and
the final norm + output head (+ the loss). transformers' own mask code calls `.item()`, which
the meta device cannot do, so the forward passes a ready 4-D boolean causal mask there (and no
mask on a real device: `profile_mask`; none either to a model without attention modules, such as
Mamba, whose mask is a 2-D padding mask). Mamba scans run as the fused kernel while traced
(`planner.models.hf_ssm`). The config is
read and checked first (`planner.models.hf_config`: unknown model types, misspelt keys, --seq
beyond the config's positions).

Layers as they are built: the whole model is built on the meta device and each decoder layer is
given a structural signature (module types and settings, parameter and buffer shapes and dtypes,
the scalar attributes its modules keep, such as a sliding window or a dense-vs-MoE choice, and its
entry in the config's `layer_types`). Layers with equal signatures are measured once; the first
layer of each signature stands for the others. No config key (`first_k_dense_replace`,
`moe_layer_freq`, `mlp_only_layers`, `decoder_sparse_step`, `layer_types`, ...) is assumed to mean
anything: whatever pattern it produces is read off the built modules.

Attention runs through the implementation transformers supports for the architecture: SDPA where
the model class supports it; where it does not (GPT-OSS's sinks, Gemma-2's soft-capping), eager
attention in training and, in a profile, SDPA on the same mask, as the fused kernel the engines
run (`hf_attention.FUSED_PROFILE_ATTENTION`); `ModelInfo.attn_implementation` records which.
Experts of transformers' mixture-of-experts layers run through its `grouped_mm` experts
implementation, whose shapes do not depend on the routing (its eager loop asks `nonzero()`, which
the meta device cannot answer): every token's top-k expert GEMMs are counted, whichever experts
the router picks.

Mixture-of-experts configs of type `mixtral`, `qwen2_moe` and `qwen3_moe` whose dense layers (if
any) lead are not built through transformers: `hf_moe_config` maps them onto meshplan's `moe`
family (`planner.models.moe`), which profiles them under its balanced-routing assumption with
exactly their parameters (Qwen3's q/k norms and head_dim, Qwen2-MoE's q/k/v biases and gated
shared expert included) and gives their experts tensor-parallel splits. Not carried over, as they
change no shape: routing-weight renormalisation (`norm_topk_prob`; meshplan renormalises), the
auxiliary-loss settings, and sliding windows. Other MoE configs (DeepSeek-V3 with its multi-head
latent attention, Qwen MoE configs with dense layers between MoE layers) are traced through
transformers' own modules.
"""
from __future__ import annotations

from dataclasses import replace

from meshplan.planner.contracts.errors import MeshplanError
from meshplan.planner.contracts.graph import ModelInfo, TPSplit
from meshplan.planner.models.config import TransformerConfig
from meshplan.planner.models.hf_attention import (attention_implementation, fused_note, has_attention, profile_mask,
                                                  window_notes)
from meshplan.planner.models.hf_ssm import scan_as_kernel
from meshplan.planner.models.hf_config import (check_seq_limit, first_line, hf_max_positions, make_config, positive_int,
                                               read_config, rope_theta)

__all__ = ["build_hf_for_profile", "build_hf_model", "hf_max_positions", "hf_moe_config", "hf_vocab", "read_config"]

_FINAL_NORM_NAMES = ("norm", "ln_f", "final_layernorm", "final_layer_norm")
# Module attributes that number a layer rather than describe it (left out of its signature).
_INDEX_ATTRIBUTES = frozenset({"training", "layer_idx", "layer_id", "layer_number", "layer_index", "idx"})
# Config keys that give the experts per token, by architecture.
_TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts", "experts_per_token")


def hf_vocab(path_text: str) -> int:
    """The vocabulary size transformers reads from the config (no model is built)."""
    moe = hf_moe_config(path_text)
    if moe is not None:
        return moe.vocab
    return int(_make_config(path_text)[0].vocab_size)


def check_hf_config(path_text: str) -> tuple[str, ...]:
    """Every check of `hf_config.make_config` (model type, misspelt keys, transformers' own
    validation); returns the notes on keys transformers ignores."""
    return _make_config(path_text)[1]


# MoE model types meshplan maps onto its moe family (when their dense layers lead).
_MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
# Config key of each MoE field, by model type (intermediate_size is each expert's width in Mixtral).
_EXPERT_FIELDS = {
    "mixtral": {"num_experts": "num_local_experts", "top_k": "num_experts_per_tok", "expert_ffn": "intermediate_size"},
    "qwen2_moe": {"num_experts": "num_experts", "top_k": "num_experts_per_tok", "expert_ffn": "moe_intermediate_size"},
    "qwen3_moe": {"num_experts": "num_experts", "top_k": "num_experts_per_tok", "expert_ffn": "moe_intermediate_size"},
}


def hf_moe_config(path_text: str) -> TransformerConfig | None:
    """The meshplan `moe` config of a Mixtral / Qwen2-MoE / Qwen3-MoE config.json; None for other
    configs (dense or not, they are traced through transformers) and for Qwen MoE configs whose
    dense layers do not all lead (the moe family puts them first)."""
    data = read_config(path_text)
    model_type = data["model_type"]
    if model_type not in _MOE_TYPES:
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
                  norm_eps=float(data.get("rms_norm_eps", 1e-6)), rope_theta=rope_theta(data),
                  attn_head_dim=data.get("head_dim") or 0,
                  **{name: data[key] for name, key in _EXPERT_FIELDS[model_type].items()})
    if model_type != "mixtral":
        qwen = _qwen_moe_fields(data, model_type, path_text)
        if qwen is None:
            return None
        fields.update(qwen)
    try:
        return TransformerConfig(**fields)
    except (TypeError, ValueError) as exc:
        raise MeshplanError(f"HF config {path_text!r} ({model_type}): {exc}") from None


def _qwen_moe_fields(data: dict, model_type: str, path_text: str) -> dict | None:
    """Qwen2-MoE: q/k/v biases, one gated shared expert; Qwen3-MoE: q/k norms. Both: dense blocks
    at `mlp_only_layers` and off the `decoder_sparse_step` grid; None when they do not all lead
    (then transformers' model is traced as it is)."""
    layers, step = data["num_hidden_layers"], data.get("decoder_sparse_step", 1) or 1
    only_dense = set(data.get("mlp_only_layers") or ())
    dense = [i for i in range(layers) if i in only_dense or (i + 1) % step]
    if dense != list(range(len(dense))):
        return None
    fields = {"dense_layers": len(dense), "ffn": data.get("intermediate_size", 0) if dense else 0}
    if model_type == "qwen3_moe":
        if data.get("attention_bias"):
            return None  # an o_proj bias too, which the moe family does not have
        return {**fields, "qk_norm": True}
    shared = data.get("shared_expert_intermediate_size", 0) or 0
    return {**fields, "qkv_bias": bool(data.get("qkv_bias", True)), "num_shared_experts": 1 if shared else 0,
            "shared_expert_ffn": shared, "shared_expert_gate": bool(shared)}


def _make_config(path_text: str, num_layers: int | None = None):
    """(transformers config, notes) for the file, optionally cut to its first `num_layers` layers."""
    config, notes = make_config(path_text)
    from meshplan.planner.models.built import MAX_PARAMETRIC_LAYERS

    layers = getattr(config, "num_hidden_layers", None)
    if num_layers is None and isinstance(layers, int) and not 1 <= layers <= MAX_PARAMETRIC_LAYERS:
        raise MeshplanError(f"HF config {path_text!r}: num_hidden_layers must be between 1 and "
                            f"{MAX_PARAMETRIC_LAYERS:,}, got {layers}")
    if num_layers is not None:
        config.num_hidden_layers = num_layers
        if _has_layer_types_list(config):
            config.layer_types = config.layer_types[:num_layers]
    return config, notes


def _model_class(path_text: str, config):
    import transformers

    try:
        return transformers.AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        raise MeshplanError(f"HF config {path_text!r}: model_type {config.model_type!r} has no causal LM in "
                            "transformers (AutoModelForCausalLM); meshplan profiles causal LMs only") from None


def _from_config(path_text: str, config, device: str, dtype):
    """transformers' model for the config on `device`, with the attention implementation used."""
    import torch

    model_class = _model_class(path_text, config)
    attn = attention_implementation(model_class, device)
    kwargs = {"dtype": dtype, "attn_implementation": attn}
    if device == "meta" and model_class._can_set_experts_implementation():
        kwargs["experts_implementation"] = "grouped_mm"  # routing-independent shapes (module docstring)
    try:
        import transformers

        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(config, **kwargs)
    except Exception as exc:  # noqa: BLE001 - any failure to build from the user's config is bad input
        raise MeshplanError(f"HF config {path_text!r}: cannot build a causal LM from it: {first_line(exc)}") from exc
    return model, attn


def build_hf_model(path_text: str, seq: int, device: str = "meta", dtype=None, num_layers: int | None = None):
    """The whole model (or its first `num_layers` decoder layers) from the config file."""
    return _build(path_text, seq, device, dtype, num_layers, collapse=False)[0]


def _build(path_text: str, seq: int, device: str, dtype, num_layers: int | None, collapse: bool):
    """(BuiltModel, the index of each decoder layer's first structurally equal layer).

    `collapse`: keep one decoder layer per structural signature (module docstring), named by its
    index in the full model; `BuiltModel.info.num_layers` stays the full count.
    """
    check_seq_limit(path_text, seq)
    config, notes = _make_config(path_text, num_layers)
    model, attn = _from_config(path_text, config, device, dtype)
    base = model.base_model
    layer_list, owner, attribute = _decoder_layers(base, path_text)
    signatures = [layer_signature(layer, config) for layer in layer_list]
    first_of: dict[str, int] = {}
    for index, signature in enumerate(signatures):
        first_of.setdefault(signature, index)
    sources = [first_of[signature] for signature in signatures]
    kept = sorted(set(sources)) if collapse else list(range(len(layer_list)))
    info = replace(_info(config, attn, notes, [layer_list[i] for i in kept], layer_list),
                   pipeline_cut_problem=pipeline_cut_problem(model, path_text))
    if collapse:
        _keep_layers(model, config, owner, attribute, layer_list, kept)
    groups = _layer_groups(model, base, config, {index: layer_list[index] for index in kept})
    tokens = torch_tokens(seq, device)
    # A state-space model takes a 2-D padding mask, which a causal LM without padding does without.
    mask = profile_mask(seq, device) if has_attention(model) else None

    def forward(module, inputs):
        with scan_as_kernel(device):
            return module(input_ids=inputs[0], attention_mask=mask, use_cache=False).logits

    from meshplan.planner.models.built import BuiltModel
    from meshplan.planner.models.transformer import lm_loss

    layer_modules = tuple((g.name, g.kind, g.modules[0] if len(g.modules) == 1 else _module_list(g.modules))
                          for g in groups)
    built = BuiltModel(module=model, example_inputs=(tokens,), info=info, layer_modules=layer_modules,
                       loss_fn=lambda logits, inputs: lm_loss(logits, inputs[0]), targets=tokens,
                       forward_fn=forward, layer_groups=groups)
    return built, sources


def torch_tokens(seq: int, device: str):
    import torch

    return torch.zeros(1, seq, dtype=torch.long, device=device)


def _module_list(modules):
    import torch

    return torch.nn.ModuleList(modules)


def _layer_groups(model, base, config, layers: dict) -> tuple:
    """embed, the given decoder layers (by their index in the full model), head."""
    import torch

    from meshplan.planner.models.built import LayerGroup

    norm = next((getattr(base, n) for n in _FINAL_NORM_NAMES if isinstance(getattr(base, n, None), torch.nn.Module)),
                None)
    head_modules = tuple(m for m in (norm, model.get_output_embeddings()) if m is not None)
    # The executor keeps a Hugging Face model's embedding and head whole on every TP rank.
    vocab = TPSplit(reason="the embedding and output head are replicated over TP ranks")
    return ((LayerGroup("embed", "embedding", (model.get_input_embeddings(),), vocab),)
            + tuple(LayerGroup(f"blocks.{index}", "block", (layer,), _block_split(layer, config),
                               expert_modules=tuple(expert_modules(layer)))
                    for index, layer in layers.items())
            + (LayerGroup("head", "head", head_modules, vocab),))


def _keep_layers(model, config, owner, attribute: str, layer_list, kept: list[int]) -> None:
    """Cut the decoder to the kept layers; `layer_types` keeps its length (layers index it by
    their own layer_idx) with the kept layers' types first (forwards index it by position)."""
    import torch

    setattr(owner, attribute, torch.nn.ModuleList([layer_list[i] for i in kept]))
    for cfg in {id(c): c for c in (config, model.config, getattr(model.base_model, "config", config))}.values():
        layer_types = getattr(cfg, "layer_types", None)
        if _has_layer_types_list(cfg) and len(layer_types) == len(layer_list):
            cfg.layer_types = [layer_types[i] for i in kept] + layer_types[len(kept):]
        cfg.num_hidden_layers = len(kept)


def _has_layer_types_list(config) -> bool:
    """Whether the config keeps `layer_types` as a list of its own; Mamba's is a read-only property
    computed from the layer count, Bamba's an alias of one (`attribute_map`)."""
    if not isinstance(getattr(config, "layer_types", None), list):
        return False
    name = (getattr(config, "attribute_map", None) or {}).get("layer_types", "layer_types")
    found = getattr(type(config), name, None)
    return not isinstance(found, property) or found.fset is not None


def build_hf_for_profile(path_text: str, seq: int, dtype=None, collapse: bool = True):
    """The model with one decoder layer per structural signature, and every layer's source."""
    from meshplan.planner.models.built import ProfileModel

    built, sources = _build(path_text, seq, "meta", dtype, None, collapse)
    if not collapse:
        return ProfileModel(built, ())
    layout = (("embed", "embedding", "embed"),) + tuple(
        (f"blocks.{i}", "block", f"blocks.{source}") for i, source in enumerate(sources)) + (("head", "head", "head"),)
    return ProfileModel(built, layout)


def layer_signature(layer, config) -> str:
    """What makes two decoder layers measure alike: for every submodule its type, extra_repr,
    parameter and buffer shapes and dtypes, and the scalar attributes it keeps (sliding_window,
    is_sliding, ...), less those that only number the layer; plus the layer's `layer_types` entry."""
    import hashlib

    parts = []
    for name, sub in layer.named_modules():
        tensors = [(n, tuple(t.shape), str(t.dtype)) for n, t in sub.named_parameters(recurse=False)]
        tensors += [(n, tuple(t.shape), str(t.dtype)) for n, t in sub.named_buffers(recurse=False)]
        scalars = sorted((key, repr(value)) for key, value in vars(sub).items()
                         if not key.startswith("_") and key not in _INDEX_ATTRIBUTES
                         and (value is None or isinstance(value, (bool, int, float, str))))
        parts.append((name, type(sub).__qualname__, sub.extra_repr(), tuple(tensors), tuple(scalars)))
    layer_types = getattr(config, "layer_types", None)
    index = getattr(layer, "layer_idx", getattr(getattr(layer, "self_attn", None), "layer_idx", None))
    if isinstance(layer_types, list) and isinstance(index, int) and 0 <= index < len(layer_types):
        parts.append(("layer_type", layer_types[index]))
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def expert_modules(layer) -> list[str]:
    """Names (relative to the layer) of its routed experts: a module holding 3-D weights (and 2-D
    biases) with one leading expert dimension (transformers' stacked experts), or a ModuleList of
    two or more same-typed modules named `experts`. A convolution's 3-D weight (out x in / groups x
    kernel: a Mamba or gated DeltaNet mixer's depthwise conv without bias) is no stack of experts."""
    import torch

    found: list[str] = []
    for name, sub in layer.named_modules():
        if not name or any(name.startswith(prefix + ".") for prefix in found):
            continue
        if isinstance(sub, torch.nn.modules.conv._ConvNd):
            continue
        params = list(sub.parameters(recurse=False))
        # weights stacked over experts, with their biases (GPT-OSS) stacked the same way
        stacked = params and any(p.dim() == 3 for p in params) and all(p.dim() >= 2 for p in params) \
            and len({p.shape[0] for p in params}) == 1 and params[0].shape[0] > 1
        listed = isinstance(sub, torch.nn.ModuleList) and name.rsplit(".", 1)[-1] == "experts" and len(sub) > 1 \
            and len({type(m) for m in sub}) == 1
        if stacked or listed:
            found.append(name)
    return found


def _num_experts(layer) -> int:
    names = expert_modules(layer)
    if not names:
        return 0
    sub = layer.get_submodule(names[0])
    params = list(sub.parameters(recurse=False))
    return params[0].shape[0] if params else len(sub)


def _top_k(config, layer) -> int:
    for sub in layer.modules():
        value = getattr(sub, "top_k", None)
        if isinstance(value, int) and value > 0:
            return value
    return next((getattr(config, key) for key in _TOP_K_KEYS if isinstance(getattr(config, key, None), int)), 0)


def _decoder_layers(base, path_text: str):
    """(the decoder layers, the module holding them, its attribute name): the longest ModuleList."""
    import torch

    lists = [(name, m) for name, m in base.named_children() if isinstance(m, torch.nn.ModuleList)]
    if not lists:
        raise MeshplanError(f"HF config {path_text!r}: the model has no list of decoder layers meshplan can split")
    name, layers = max(lists, key=lambda item: len(item[1]))
    return layers, base, name


def _block_split(layer, config) -> TPSplit:
    """The layer's Megatron split from its modules and weight shapes (`hf_tp`), or kind "none"
    with the reason (routed experts, Linears of no known layout)."""
    from meshplan.planner.models.hf_tp import block_split

    return block_split(layer, expert_modules(layer))


def _info(config, attn: str, notes: tuple[str, ...], kept_layers: list, all_layers) -> ModelInfo:
    heads = getattr(config, "num_attention_heads", 0) or 0
    moe_layer = next((layer for layer in kept_layers if expert_modules(layer)), None)
    moe = {}
    if moe_layer is not None:
        dense = sum(1 for layer in all_layers if not expert_modules(layer))
        moe = dict(num_experts=_num_experts(moe_layer), top_k=_top_k(config, moe_layer), dense_layers=dense,
                   **_expert_widths(config, every_layer_moe=dense == 0), **_router_groups(config))
    return ModelInfo(family="hf", num_layers=len(all_layers),
                     hidden=getattr(config, "hidden_size", 0) or 0, num_heads=heads,
                     num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                     ffn=getattr(config, "intermediate_size", 0) or 0, vocab=config.vocab_size,
                     padded_vocab=config.vocab_size, tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
                     attn_implementation=attn, notes=notes + fused_note(attn) + window_notes(attn, kept_layers),
                     **moe, **_mamba2_shape(kept_layers),
                     **(_latent_attention(config) or _head_dim(config)))


def _mamba2_shape(layers) -> dict:
    """The first Mamba-2 mixer's heads, head width, groups and state width, as ModelInfo names
    them (read off the module: each family's config names them its own way); {} without one."""
    from meshplan.planner.models.hf_tp import mamba2_mixer, ssm_mixer_path

    for layer in layers:
        path = ssm_mixer_path(layer)
        if path is not None and not isinstance(mamba2_mixer(layer, path), str):
            mixer = layer.get_submodule(path) if path else layer
            return dict(mamba_heads=mixer.num_heads, mamba_head_dim=mixer.head_dim, mamba_groups=mixer.n_groups,
                        mamba_state=mixer.ssm_state_size, mamba_chunk=positive_int(getattr(mixer, "chunk_size", 0)))
    return {}


def _router_groups(config) -> dict:
    """DeepSeek's group-limited routing (n_group, topk_group), as ModelInfo names it; {} without one."""
    groups, group_topk = positive_int(getattr(config, "n_group", 0)), positive_int(getattr(config, "topk_group", 0))
    if groups > 1 and 0 < group_topk < groups:
        return dict(moe_router_groups=groups, moe_router_group_topk=group_topk)
    return {}


def _expert_widths(config, every_layer_moe: bool) -> dict:
    """A MoE config's routed experts' width and its shared experts (`n_shared_experts` of that
    width), as ModelInfo names them: `moe_intermediate_size` (DeepSeek, Qwen-MoE), or where every
    layer is a MoE layer and no such key exists, `intermediate_size`, which then is each expert's
    width (GPT-OSS, Mixtral); {} otherwise."""
    width = positive_int(getattr(config, "moe_intermediate_size", 0))
    if not width:
        width = positive_int(getattr(config, "intermediate_size", 0)) if every_layer_moe else 0
        return {"expert_ffn": width} if width else {}
    shared = positive_int(getattr(config, "n_shared_experts", 0))
    return dict(expert_ffn=width, num_shared_experts=shared, shared_ffn=shared * width)


def _head_dim(config) -> dict:
    """The attention's head width where the config names one (`head_dim`: GPT-OSS's 64 beside a
    2880-wide stream, Gemma's, Qwen3's), which hidden / heads would get wrong; {} without."""
    width = positive_int(getattr(config, "head_dim", 0))
    return {"head_dim": width} if width else {}


def _latent_attention(config) -> dict:
    """Multi-head latent attention's widths (DeepSeek-V2/V3 configs: `kv_lora_rank`, ...), {} without."""
    names = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    values = [positive_int(getattr(config, name, 0)) for name in names]
    if not all(values):
        return {}
    kv_rank, nope, rope, value = values
    return dict(kv_lora_rank=kv_rank, q_lora_rank=positive_int(getattr(config, "q_lora_rank", None)),
                qk_rope_head_dim=rope, v_head_dim=value, head_dim=nope + rope)


def pipeline_cut_problem(model, path_text: str) -> str:
    """Why the executor cannot cut the model into pipeline stages at its decoder layers ("" when
    it can): parameters outside the embedding, decoder layers and final norm (GPT-2's learned
    positions), which no stage would hold."""
    try:
        parts = model_parts(model, path_text)
    except StopIteration:  # no input embedding or output head among the model's children
        return (f"'hf:{path_text}' cannot be cut into pipeline stages: meshplan finds no input embedding on its "
                "base model or no output head on the causal LM; re-plan it with --pp 1")
    kept = (parts["layers"], parts["embed"], parts["norm"])
    glue = [name for name, child in model.base_model.named_children()
            if name not in kept and any(True for _ in child.parameters())]
    if not glue:
        return ""
    return (f"'hf:{path_text}' cannot be cut into pipeline stages: its base model has parameters outside the "
            f"embedding, decoder layers and final norm ({', '.join(glue)}); re-plan it with --pp 1")


def model_parts(model, path_text: str) -> dict:
    """Attribute names of the pieces a causal LM is cut into for pipeline stages: `base` (the base
    model's attribute on the causal LM), `layers`, `embed`, `norm` (on the base model; norm None
    when there is none) and `head` (the output Linear on the causal LM)."""
    import torch

    base = model.base_model
    _, _, layers = _decoder_layers(base, path_text)
    children = dict(base.named_children())
    embed = next(name for name, m in children.items() if m is model.get_input_embeddings())
    norm = next((n for n in _FINAL_NORM_NAMES if isinstance(children.get(n), torch.nn.Module)), None)
    return {"base": next(name for name, m in model.named_children() if m is base), "layers": layers,
            "embed": embed, "norm": norm,
            "head": next(name for name, m in model.named_children() if m is model.get_output_embeddings())}
