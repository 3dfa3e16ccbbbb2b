"""Model specs: built-in presets, parametric `gpt:`/`llama:`/`moe:` specs, `file.py:fn` and `hf:config.json`,
and the published-config presets (`PUBLISHED_CONFIGS`: names of shipped `config.json` files).

`build_model(spec, seq, tp=1, device="meta") -> BuiltModel` is the one way every command and the
executor turn a spec string into a module. `build_for_profile` builds the same model with its
repeated blocks collapsed to one of each type, which is all the profiler needs. Importing this
package does not import torch.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from meshplan.planner.contracts.errors import MeshplanError, did_you_mean
from meshplan.planner.contracts.graph import ModelInfo, TPSplit
from meshplan.planner.models.built import MAX_PARAMETRIC_LAYERS, BuiltModel, LayerGroup, ProfileModel
from meshplan.planner.models.config import TransformerConfig

# Published shapes: GPT-2 (Radford et al. 2019, HF configs); Llama 2 (Touvron et al. 2023,
# Table 1 + params.json); Llama 3 / 3.1 (Dubey et al. 2024, Table 3). `context_length` is each
# release's max_position_embeddings (Llama 2: 4096; Llama 3.1: 131072; Mixtral 8x7B: 32768,
# 8x22B: 65536; Qwen3: 40960).
PRESETS: dict[str, TransformerConfig] = {
    "gpt2": TransformerConfig("gpt", 12, 768, 12, 50257),
    "gpt2-medium": TransformerConfig("gpt", 24, 1024, 16, 50257),
    "gpt2-large": TransformerConfig("gpt", 36, 1280, 20, 50257),
    "gpt2-xl": TransformerConfig("gpt", 48, 1600, 25, 50257),
    "llama2-7b": TransformerConfig("llama", 32, 4096, 32, 32000, ffn=11008, tied_embeddings=False,
                                   context_length=4096),
    "llama2-13b": TransformerConfig("llama", 40, 5120, 40, 32000, ffn=13824, tied_embeddings=False,
                                    context_length=4096),
    "llama2-70b": TransformerConfig("llama", 80, 8192, 64, 32000, ffn=28672, num_kv_heads=8,
                                    tied_embeddings=False, context_length=4096),
    "llama3-8b": TransformerConfig("llama", 32, 4096, 32, 128256, ffn=14336, num_kv_heads=8,
                                   tied_embeddings=False, rope_theta=500000.0, context_length=131072),
    "llama3-70b": TransformerConfig("llama", 80, 8192, 64, 128256, ffn=28672, num_kv_heads=8,
                                    tied_embeddings=False, rope_theta=500000.0, context_length=131072),
    "llama3-405b": TransformerConfig("llama", 126, 16384, 128, 128256, ffn=53248, num_kv_heads=8,
                                     tied_embeddings=False, rope_theta=500000.0, context_length=131072),
    # Mixtures of experts, from the Hugging Face config.json of each release. Mixtral
    # (mistralai/Mixtral-8x7B-v0.1, mistralai/Mixtral-8x22B-v0.1): hidden_size, num_hidden_layers,
    # num_attention_heads, num_key_value_heads, num_local_experts, num_experts_per_tok,
    # intermediate_size (each expert), vocab_size, rope_theta 1e6, untied; published 46.7B total /
    # 12.9B active and 141B / 39B. Qwen3 (Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B): head_dim 128
    # whatever hidden / heads, q/k RMSNorm (both modelled), num_experts 128, num_experts_per_tok 8,
    # moe_intermediate_size, no shared experts, mlp_only_layers [] (no dense block; intermediate_size
    # is unused), rms_norm_eps 1e-6; published 30.5B / 3.3B and 235B / 22B.
    "mixtral-8x7b": TransformerConfig("moe", 32, 4096, 32, 32000, num_kv_heads=8, tied_embeddings=False,
                                      rope_theta=1e6, num_experts=8, top_k=2, expert_ffn=14336,
                                      context_length=32768),
    "mixtral-8x22b": TransformerConfig("moe", 56, 6144, 48, 32768, num_kv_heads=8, tied_embeddings=False,
                                       rope_theta=1e6, num_experts=8, top_k=2, expert_ffn=16384,
                                       context_length=65536),
    "qwen3-30b-a3b": TransformerConfig("moe", 48, 2048, 32, 151936, num_kv_heads=4, tied_embeddings=False,
                                       norm_eps=1e-6, rope_theta=1e6, attn_head_dim=128, qk_norm=True,
                                       num_experts=128, top_k=8, expert_ffn=768, context_length=40960),
    "qwen3-235b-a22b": TransformerConfig("moe", 94, 4096, 64, 151936, num_kv_heads=4, tied_embeddings=False,
                                         norm_eps=1e-6, rope_theta=1e6, attn_head_dim=128, qk_norm=True,
                                         num_experts=128, top_k=8, expert_ffn=1536,
                                         context_length=40960),
}

# Published mixtures of experts whose attention the zoo's families do not build (multi-head latent
# attention; alternating sliding-window / full attention with per-head sinks and biases): each
# name stands for its released config.json, shipped in `planner/models/published/` and profiled
# as an `hf:` spec is, by tracing transformers' own model on the meta device. The files are the
# hub repositories' config.json (deepseek-ai/DeepSeek-V3, deepseek-ai/DeepSeek-V2-Lite,
# openai/gpt-oss-20b, openai/gpt-oss-120b) without `quantization_config` (the released weights'
# FP8 / MXFP4 storage) and `auto_map` (remote code). Every one is a mixture of experts.
PUBLISHED_CONFIGS: dict[str, str] = {
    "deepseek-v3": "deepseek_v3.json",
    "deepseek-v2-lite": "deepseek_v2_lite.json",
    "gpt-oss-20b": "gpt_oss_20b.json",
    "gpt-oss-120b": "gpt_oss_120b.json",
}
PUBLISHED_DIR = Path(__file__).resolve().parent / "published"

_PARAMETRIC_KEYS = {
    "gpt": {"layers", "hidden", "heads", "kv_heads", "vocab", "ffn", "tied", "positions"},
    "llama": {"layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "tied", "rope_theta", "head_dim", "qk_norm",
              "qkv_bias"},
    "moe": {"layers", "hidden", "heads", "kv_heads", "experts", "top_k", "expert_ffn", "vocab", "shared_experts",
            "dense_layers", "ffn", "tied", "rope_theta", "head_dim", "qk_norm", "qkv_bias", "aux_loss"},
}
_REQUIRED_KEYS = {"gpt": ("layers", "hidden", "heads", "vocab"), "llama": ("layers", "hidden", "heads", "vocab"),
                  "moe": ("layers", "hidden", "heads", "kv_heads", "experts", "top_k", "expert_ffn", "vocab")}
_BOOL_KEYS = ("tied", "qk_norm", "qkv_bias")
_FLOAT_KEYS = ("rope_theta", "aux_loss")
_EXAMPLES = {"gpt": "gpt:layers=12,hidden=768,heads=12,vocab=50257",
             "llama": "llama:layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=128256",
             "moe": "moe:layers=32,hidden=4096,heads=32,kv_heads=8,experts=8,top_k=2,expert_ffn=14336,vocab=32000"}


def known_models() -> list[str]:
    """The zoo's presets, then the published configs, each sorted."""
    return sorted(PRESETS) + sorted(PUBLISHED_CONFIGS)


def hf_config_path(spec: str) -> str | None:
    """The config file behind a spec that transformers' code builds: the path of an `hf:` spec,
    the shipped file of a `PUBLISHED_CONFIGS` name; None for every other spec."""
    if spec.startswith("hf:"):
        return spec[3:]
    if spec in PUBLISHED_CONFIGS:
        return str(PUBLISHED_DIR / PUBLISHED_CONFIGS[spec])
    return None


def parse_spec(spec: str, seq: int) -> TransformerConfig | None:
    """A TransformerConfig for a preset or parametric spec; None for file/hf specs."""
    if spec in PRESETS:
        return PRESETS[spec]
    family, sep, rest = spec.partition(":")
    if not sep or family not in _PARAMETRIC_KEYS:
        return None
    values = _spec_values(spec, family, rest)
    significant = values["layers"].lstrip("+-").lstrip("0")
    if len(significant) > len(str(MAX_PARAMETRIC_LAYERS)) or int(significant or 0) > MAX_PARAMETRIC_LAYERS:
        raise MeshplanError(f"malformed model spec {spec!r}: layers={values['layers'][:20]} is more than "
                            f"meshplan lays out (at most {MAX_PARAMETRIC_LAYERS:,})")
    try:
        ints = {k: int(v) for k, v in values.items() if k not in _BOOL_KEYS + _FLOAT_KEYS}
        flags = {k: values[k].lower() in ("1", "true", "yes") for k in _BOOL_KEYS if k in values}
        kwargs: dict[str, Any] = dict(
            family=family, num_layers=ints["layers"], hidden=ints["hidden"], num_heads=ints["heads"],
            vocab=ints["vocab"], ffn=ints.get("ffn", 0), num_kv_heads=ints.get("kv_heads", 0))
        if family == "gpt":
            kwargs["max_positions"] = ints.get("positions", seq)
            kwargs["tied_embeddings"] = flags.get("tied", True)
        else:
            kwargs["tied_embeddings"] = flags.get("tied", False)
            if "rope_theta" in values:
                kwargs["rope_theta"] = float(values["rope_theta"])
            # Qwen's attention: a head width other than hidden / heads, q/k RMSNorms (Qwen3), q/k/v biases (Qwen2)
            kwargs.update(attn_head_dim=ints.get("head_dim", 0), qk_norm=flags.get("qk_norm", False),
                          qkv_bias=flags.get("qkv_bias", False))
        if family == "moe":
            kwargs.update(num_experts=ints["experts"], top_k=ints["top_k"], expert_ffn=ints["expert_ffn"],
                          num_shared_experts=ints.get("shared_experts", 0), dense_layers=ints.get("dense_layers", 0))
            if "aux_loss" in values:  # the load-balancing loss's coefficient (0 turns it off)
                kwargs["aux_loss_coef"] = float(values["aux_loss"])
        return TransformerConfig(**kwargs)
    except ValueError as exc:
        raise MeshplanError(f"malformed model spec {spec!r}: {exc}") from None


def _spec_values(spec: str, family: str, rest: str) -> dict[str, str]:
    """key -> value text of a parametric spec, keys known, required ones present, types checked."""
    values: dict[str, str] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not value.strip():
            raise MeshplanError(f"malformed model spec {spec!r}: expected key=value, got {item!r}; "
                                f"e.g. {_EXAMPLES[family]}")
        if key not in _PARAMETRIC_KEYS[family]:
            raise MeshplanError(f"malformed model spec {spec!r}: unknown key {key!r}; "
                                f"{family} specs take {', '.join(sorted(_PARAMETRIC_KEYS[family]))}")
        values[key] = value.strip()
    missing = [key for key in _REQUIRED_KEYS[family] if key not in values]
    if missing:
        raise MeshplanError(f"malformed model spec {spec!r}: missing {', '.join(missing)}")
    for key, value in values.items():
        if key in _BOOL_KEYS and value.lower() not in ("1", "true", "yes", "0", "false", "no"):
            raise MeshplanError(f"malformed model spec {spec!r}: {key} must be true or false, got {value!r}")
        if key not in _BOOL_KEYS + _FLOAT_KEYS and not value.lstrip("+-").isdigit():
            raise MeshplanError(f"malformed model spec {spec!r}: {key} must be an integer, got {value!r}")
    return values


def build_model(spec: str, seq: int, tp: int = 1, device: str = "meta", dtype=None) -> BuiltModel:
    """Build the model a spec names, on `device` (meta by default: no memory, no weights)."""
    if not isinstance(seq, int) or seq <= 0:
        raise MeshplanError(f"sequence length must be a positive integer, got {seq!r}")
    cfg, config_path = _hf_moe_config(spec), hf_config_path(spec)
    if config_path is not None and cfg is None:
        from meshplan.planner.models.hf import build_hf_model
        return build_hf_model(config_path, seq, device=device, dtype=dtype)
    cfg = cfg or parse_spec(spec, seq)
    if cfg is not None:
        return _build_zoo(spec, cfg, seq, tp, device, dtype)
    if spec.partition(":")[0].endswith(".py"):
        from meshplan.planner.models.filemodel import build_file_model
        return build_file_model(spec, device=device, dtype=dtype)
    raise MeshplanError(f"unknown model {spec!r}{_nearest_models(spec)}; known models: {', '.join(known_models())}; "
                        "or a parametric spec (gpt:layers=..,hidden=..,heads=..,vocab=..), path/model.py:fn, "
                        "hf:config.json or hf:owner/name (a Hugging Face hub repository)")


def _nearest_models(spec: str) -> str:
    """" (did you mean ...?)" for an unknown model name (`errors.did_you_mean` over the known
    models); an `owner/name` hub repository id gets its `hf:` form."""
    from meshplan.planner.models.hf_hub import is_hub_id

    if "/" in spec and is_hub_id(spec):
        return f" (did you mean hf:{spec}, the Hugging Face hub repository?)"
    return did_you_mean(spec, known_models())


def _build_zoo(spec: str, cfg: TransformerConfig, seq: int, tp: int, device: str, dtype) -> BuiltModel:
    import torch

    from meshplan.planner.models.transformer import CausalLM, lm_loss

    cfg.check_seq(spec, seq)
    with torch.device(device):
        if cfg.family == "moe":
            from meshplan.planner.models.moe import MoECausalLM

            module = MoECausalLM(cfg, tp=tp)
        else:
            module = CausalLM(cfg, tp=tp)
    if dtype is not None:
        module = module.to(dtype)
    tokens = torch.zeros(1, seq, dtype=torch.long, device=device)
    info = ModelInfo(family=cfg.family, num_layers=cfg.num_layers, hidden=cfg.hidden, num_heads=cfg.num_heads,
                     num_kv_heads=cfg.kv_heads, ffn=cfg.ffn_dim, vocab=cfg.vocab,
                     padded_vocab=module.padded_vocab, tied_embeddings=cfg.tied_embeddings,
                     max_positions=cfg.max_positions if cfg.family == "gpt" else 0, head_dim=cfg.head_dim,
                     **moe_info(cfg))
    layers = [("embed", "embedding", module.embed)]
    layers += [(f"blocks.{i}", "block", block) for i, block in enumerate(module.blocks)]
    layers.append(("head", "head", module.head))
    splits = zoo_tp_splits(cfg, module.padded_vocab)
    groups = tuple(LayerGroup(name, kind, (mod,), splits[_split_key(cfg, name, kind)],
                              _expert_modules(cfg, name, kind)) for name, kind, mod in layers)
    return BuiltModel(module=module, example_inputs=(tokens,), info=info, layer_modules=tuple(layers),
                      loss_fn=lambda logits, inputs: lm_loss(logits, inputs[-1] if len(inputs) > 1 else inputs[0]),
                      config=cfg, targets=tokens, layer_groups=groups)


def zoo_tp_splits(cfg: TransformerConfig, padded_vocab: int) -> dict[str, TPSplit]:
    """Megatron splits of the zoo's layers by kind; Linear names are relative to the layer module.

    A moe config adds "moe_block": attention as in the dense block; the routed experts' stacked
    gate/up column-parallel and down row-parallel (Megatron's expert TP = TP), as the shared
    experts; one all-reduce for the MoE output (routed + shared) as for a dense MLP. The router
    is replicated.
    """
    column = ("attn.q", "attn.k", "attn.v") + (("mlp.gate",) if cfg.family != "gpt" else ()) + ("mlp.up",)
    block = TPSplit(kind="block", column_linears=column, row_linears=("attn.o", "mlp.down"),
                    num_heads=cfg.num_heads, num_kv_heads=cfg.kv_heads, num_allreduce_per_pass=2,
                    mlp_width=cfg.ffn_dim)
    vocab = TPSplit(kind="vocab", vocab_size=padded_vocab)
    splits = {"embedding": vocab, "block": block, "head": vocab}
    if cfg.family == "moe":
        shared = cfg.num_shared_experts > 0
        column = ("attn.q", "attn.k", "attn.v", "moe.experts.gate", "moe.experts.up") + (
            ("moe.shared.gate", "moe.shared.up") if shared else ())
        row = ("attn.o", "moe.experts.down") + (("moe.shared.down",) if shared else ())
        splits["moe_block"] = TPSplit(kind="block", column_linears=column, row_linears=row, num_heads=cfg.num_heads,
                                      num_kv_heads=cfg.kv_heads, num_allreduce_per_pass=2)
    return splits


def _split_key(cfg: TransformerConfig, name: str, kind: str) -> str:
    return "moe_block" if kind == "block" and _is_moe_block(cfg, name) else kind


def _is_moe_block(cfg: TransformerConfig, name: str) -> bool:
    return cfg.family == "moe" and name.startswith("blocks.") and int(name.split(".")[1]) >= cfg.dense_layers


def _expert_modules(cfg: TransformerConfig, name: str, kind: str) -> tuple[str, ...]:
    """The routed experts of a MoE block, relative to the block."""
    return ("moe.experts",) if kind == "block" and _is_moe_block(cfg, name) else ()


def moe_info(cfg: TransformerConfig) -> dict[str, Any]:
    """The MoE fields of ModelInfo for a zoo config (empty for dense families)."""
    if cfg.family != "moe":
        return {}
    return dict(num_experts=cfg.num_experts, top_k=cfg.top_k, expert_ffn=cfg.expert_ffn,
                num_shared_experts=cfg.num_shared_experts, shared_ffn=cfg.shared_ffn_dim,
                dense_layers=cfg.dense_layers)


def is_moe_spec(spec: str, seq: int = 2048) -> bool:
    """Whether a spec names a mixture of experts (no torch, no model built; False for file specs)."""
    if spec in PUBLISHED_CONFIGS:
        return True
    cfg = _hf_moe_config(spec) if spec.startswith("hf:") else parse_spec(spec, seq)
    return cfg is not None and cfg.family == "moe"


def _hf_moe_config(spec: str) -> TransformerConfig | None:
    """The meshplan MoE config an `hf:` MoE config maps onto (None for other specs, and for the
    published configs, whose attention the moe family does not build)."""
    if not spec.startswith("hf:"):
        return None
    from meshplan.planner.models.hf import hf_moe_config

    return hf_moe_config(spec[3:])


def context_note(spec: str | None, seq: int | None) -> str:
    """`TransformerConfig.context_note` of a zoo spec ("" for other models or no --seq)."""
    if not spec or not seq or hf_config_path(spec) is not None:
        return ""
    try:
        cfg = parse_spec(spec, seq)
    except MeshplanError:
        return ""  # the build reports the malformed spec
    return cfg.context_note(spec, seq) if cfg is not None else ""


def default_seq(spec: str, wanted: int = 2048) -> int:
    """`wanted`, capped by the learned positions of a GPT preset or an HF config (no torch import)."""
    config_path = hf_config_path(spec)
    if config_path is not None:
        from meshplan.planner.models.hf import hf_max_positions
        limit = hf_max_positions(config_path)
        return min(wanted, limit) if limit else wanted
    try:
        cfg = parse_spec(spec, wanted)
    except MeshplanError:
        return wanted  # the build reports the malformed spec
    if cfg is not None and cfg.family == "gpt":
        return min(wanted, cfg.max_positions)
    return wanted


def build_for_profile(spec: str, seq: int, dtype=None) -> ProfileModel:
    """The model on the meta device with identical blocks collapsed to one, plus the full layout.

    Zoo blocks are identical by construction, and HF decoder layers when the config gives them
    one type, so one block is built instead of all of them (a 126-block model costs one block).
    File models are built whole: only their forward knows how the children connect.
    """
    if not isinstance(seq, int) or seq <= 0:
        raise MeshplanError(f"sequence length must be a positive integer, got {seq!r}")
    cfg, config_path = _hf_moe_config(spec), hf_config_path(spec)
    if config_path is not None and cfg is None:
        from meshplan.planner.models.hf import build_hf_for_profile
        return build_hf_for_profile(config_path, seq, dtype=dtype)
    cfg = cfg or parse_spec(spec, seq)
    if cfg is None:
        return ProfileModel(build_model(spec, seq, device="meta", dtype=dtype), ())
    # One block of each type: a dense one if any, then a MoE one if any.
    dense = cfg.dense_layers if cfg.family == "moe" else cfg.num_layers
    kept = min(dense, 1) + min(cfg.num_layers - dense, 1)
    built = _build_zoo(spec, replace(cfg, num_layers=kept, dense_layers=min(dense, 1) if cfg.family == "moe" else 0),
                       seq, 1, "meta", dtype)
    built = replace(built, info=replace(built.info, num_layers=cfg.num_layers, dense_layers=cfg.dense_layers),
                    config=cfg)
    source = {index: "blocks.0" if index < dense else f"blocks.{kept - 1}" for index in range(cfg.num_layers)}
    layout = (("embed", "embedding", "embed"),) + tuple(
        (f"blocks.{i}", "block", source[i]) for i in range(cfg.num_layers)) + (("head", "head", "head"),)
    return ProfileModel(built, layout)
